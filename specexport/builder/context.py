"""What every build stage shares while the build runs: the plan, the output folder and its stage folders,
the previous build's manifest, the results of the stages run so far, progress lines, and the helpers
several stages call (the quality gate's token sequences, a stage's manifest file record).

Stages read from the context and return their manifest entry; only the build loop (build/run.py)
records results, so a stage cannot see one that has not run before it (`needs`).
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from specexport._console import console as make_console, progress
from specexport.manifest import describe_files


class Reporter:
    """Progress lines per stage (rich console). Tests pass `quiet=True`."""

    def __init__(self, *, quiet: bool = False):
        self.quiet = quiet
        if not quiet:
            self.console = make_console(stderr=True)

    @contextmanager
    def stage(self, label: str):
        """While a step runs: a live line with the time spent (and, once the step gives the yielded Steps a
        total, its progress and the time left); then one line with the time it took."""
        start = time.perf_counter()
        with progress(None if self.quiet else self.console, f"{label} ...") as steps:
            yield steps
        if not self.quiet:
            self.console.print(f"[green]✓[/] {label} [dim]({time.perf_counter() - start:.1f} s)[/]")

    def note(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text)


@dataclass
class StageResult:
    stage: object        # the Stage value (build/stage.py)
    entry: dict          # its manifest entry
    rebuilt: bool        # made in this run (False: reused from, or carried over with, the previous build)


@dataclass
class BuildContext:
    plan: object                       # builder.plan.Plan
    folders: object                    # builder.outdir.StageFolders
    reporter: Reporter
    previous: dict                     # the manifest of the build in the output folder ({} if none)
    force: bool = False
    results: dict = field(default_factory=dict)     # stage name -> StageResult, in run order
    samples: dict = field(default_factory=dict)     # role -> cache of the quality gate's sampled sequences

    @property
    def out(self) -> Path:
        return self.plan.config.output

    @property
    def config(self):
        return self.plan.config

    def result(self, name: str) -> StageResult:
        return self.results[name]

    def stage_dir(self, name: str) -> Path:
        """The folder of a stage that has run (e.g. "target/fp32")."""
        return self.out / self.results[name].entry["dir"]

    def model(self, role: str):
        """The model's plan, with its draft vocabulary once `<role>/vocab` measured it."""
        mp = next(m for m in self.plan.models if m.role == role)
        vocab = self.results.get(f"{role}/vocab")
        if vocab is not None and mp.vocab_ids is None:
            mp = dataclasses.replace(mp, vocab_ids=tuple(vocab.entry["vocab_ids"]))
        return mp


def files_entry(out: Path, final: Path, names: list[str]) -> dict:
    """A stage folder's manifest record: where it is, its files (sha256, size) and their total size."""
    files = [final / name for name in names]
    return {"dir": str(final.relative_to(out)), "backend": "onnxruntime", "files": describe_files(out, files),
            "size_bytes": sum(f.stat().st_size for f in files)}


def eval_sequences(ctx: BuildContext, mp, fp32_session, *, graph: str = "fp32 graph"):
    """The quality gate's token sequences for model `mp` and a record of where they came from (for the
    manifest): eval_text's tokens, else sequences sampled from its fp32 graph (cached per model; a lean
    build, which has none, samples from the graph `graph` names)."""
    from specexport.quant.quality import EVAL_LENGTH, SAMPLE_SEED, SAMPLE_TEMPERATURE, sampled_sequences, text_sequences

    plan = ctx.plan
    length = min(EVAL_LENGTH, plan.config.max_seq_len)
    bos = mp.arch.bos_token_id
    if plan.eval_ids is not None:
        text = {"source": "eval_text", "path": str(plan.config.eval_text), "tokens": len(plan.eval_ids),
                "description": f"eval_text {plan.config.eval_text}", "label": f"eval_text {plan.config.eval_text.name}"}
        return text_sequences(plan.eval_ids, bos=bos, length=length), text
    samples = ctx.samples.setdefault(mp.role, {})
    if "sequences" not in samples:
        with ctx.reporter.stage(f"sample eval sequences from the {mp.role} {graph}") as steps:
            samples["sequences"] = sampled_sequences(fp32_session, mp.io, start=bos, length=length,
                                                     ids=mp.vocab_ids, steps=steps)
    text = {"source": "sampled", "seed": SAMPLE_SEED, "temperature": SAMPLE_TEMPERATURE,
            "description": f"sequences sampled from the {mp.role} {graph} (no eval_text; seed {SAMPLE_SEED}, "
                           f"temperature {SAMPLE_TEMPERATURE})", "label": "sampled sequences"}
    return samples["sequences"], text


def peak_rss() -> dict:
    """The build's peak resident memory so far, bytes: this process's and its finished child processes'
    largest (the export child of a large checkpoint: builder/stages/export.py). Linux reports KiB."""
    import resource

    return {"process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}
