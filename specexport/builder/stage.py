"""A build stage as a value: what it reads, its fingerprint, what it writes, its gate, its manifest entry.

The plan (build/plan.py) lists the stages in the order they run; the build (build/run.py) loops over
them: reuse a stage whose fingerprint and files are unchanged, else `run` it (write into a fresh
partial folder, check it, publish it), and record its manifest entry. A stage reads the results of the
stages it `needs` (never others); when one of those was rebuilt in this run, it is rebuilt too.

    name          what `--only` selects and the results are keyed by: "target/fp32", "draft/int4",
                  "draft/vocab", "medusa", "eagle", "tokenizer"
    needs         names of the stages whose results it reads
    fingerprint   a hash of everything its output depends on (inputs, options, tool versions, the code
                  that makes it); stored in its manifest entry
    run(ctx)      makes the output, raises ParityError when its gate fails, returns its manifest entry
    previous(ctx) its entry in the build being replaced, if any
    place(m, e)   puts entry e where it belongs in the new manifest m

Kinds (builder/stages/): ExportStage (fp32 graph + parity against PyTorch), QuantizeStage (a quantized
graph made from fp32 + quality gate), VocabStage (a draft's measured output vocabulary), MedusaStage,
EagleStage (heads' graphs + parity + tree: auto), TokenizerStage. A new kind is a subclass with these
members and a line in `plan.stages()`.
"""
from __future__ import annotations

from dataclasses import dataclass

from specexport.manifest import files_intact


@dataclass(frozen=True)
class Stage:
    name: str
    fingerprint: str
    needs: tuple[str, ...] = ()
    forceable = True             # (not a field) --force and a rebuilt `needs` stage redo it; False: reused
                                 #   whenever its fingerprint and files match (content-addressed stages)

    @property
    def role(self) -> str:
        return self.name.split("/")[0]

    @property
    def precision(self) -> str | None:
        """The precision of a model's graph stage (None for stages that make no graph of a precision)."""
        return None

    def selected_by(self, only: str) -> bool:
        """`--only ROLE` selects every stage of ROLE; `--only ROLE/PRECISION` one."""
        return only == self.name or only == self.role

    def previous(self, ctx) -> dict | None:
        raise NotImplementedError

    def reusable(self, ctx, entry: dict) -> bool:
        """The previous entry may stand for this stage: same fingerprint, every file intact."""
        return entry.get("stage_fingerprint") == self.fingerprint and files_intact(ctx.out, entry.get("files", {}))

    def current(self, ctx, entry: dict) -> bool:
        """The previous entry is up to date (said of stages `--only` keeps as they are)."""
        return self.reusable(ctx, entry)

    def run(self, ctx) -> dict:
        raise NotImplementedError

    def place(self, manifest: dict, entry: dict) -> None:
        raise NotImplementedError

    def describe(self, entry: dict) -> str:
        """How a reused or carried entry is named in progress lines."""
        return entry.get("dir", self.name)


@dataclass(frozen=True)
class ModelStage(Stage):
    """A graph of one model in one precision: models.<role>.precisions.<precision> in the manifest."""

    @property
    def precision(self) -> str:
        return self.name.split("/")[1]

    def previous(self, ctx) -> dict | None:
        return ((ctx.previous.get("models", {}).get(self.role) or {}).get("precisions") or {}).get(self.precision)

    def place(self, manifest: dict, entry: dict) -> None:
        manifest["models"][self.role]["precisions"][self.precision] = entry
