"""The configurations a bench runs: `Config` (one row of the report), `BenchConfig` (what was asked
for), the default prompts, and the grid itself (`bench_configs`: per target precision, the methods, γ and
trees asked for, with the drafts each precision pair can run), after `check_request` has checked the
request against the build's manifest. `accuracy_only` says which rows run on a GPU precision's graphs,
which report acceptance and no time.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from specexport.config import GPU_PRECISIONS
from specexport.errors import SpecexportError
from specexport.runtime.methods import DRAFT_TREES, HEAD_METHODS, METHODS, MethodOptions
from specexport.runtime.proposer_table import Facts, plan_proposer

DEFAULT_PROMPTS = ("def fibonacci(n):", "import os\n\ndef main():", "class Stack:\n    def __init__(self):")


def accuracy_only(precision: str, draft_precision: str | None) -> bool:
    return precision in GPU_PRECISIONS or draft_precision in GPU_PRECISIONS


class Config(NamedTuple):
    """One row of the report."""
    method: str
    precision: str                  # the target's
    draft_precision: str | None
    gamma: int                      # chain length, or lookup's longest proposal; 0 for vanilla
    draft_stop: float = 0.0
    tree: str | None = None         # a DRAFT_TREES name (draft), a MEDUSA_TREES name (medusa), or auto / dynamic /
                                    #   a DRAFT_TREES name (eagle)

    @property
    def proposer(self) -> str | None:
        """What proposes besides the target: the draft's precision, "medusa" or "eagle", or None."""
        return self.draft_precision or (self.method if self.method in HEAD_METHODS else None)


VANILLA = "vanilla"


@dataclass(frozen=True)
class BenchConfig:
    output_dir: Path
    prompts: tuple[str, ...]
    precisions: tuple[str, ...] | None = None      # default: every precision built for the target
    methods: tuple[str, ...] = ("vanilla", "draft")
    gammas: tuple[int, ...] = (2, 3, 4, 5, 6)
    lookup_gammas: tuple[int, ...] | None = None    # lookup rows' γ (None: `gammas`)
    draft_stops: tuple[float, ...] = ()             # adaptive-γ rows, at the largest γ, per value
    trees: tuple[str, ...] = ()                     # draft-tree rows (DRAFT_TREES names), per precision
    medusa_trees: tuple[str, ...] = ("auto",)       # Medusa rows ("auto" or MEDUSA_TREES names) with method medusa
    eagle_trees: tuple[str, ...] = ("auto",)        # EAGLE rows ("auto", "dynamic" or DRAFT_TREES names) with eagle
    max_new_tokens: int = 128
    chat: bool = False                              # each prompt is a user message of the build's chat template
    temperature: float = 0.0                        # > 0: every row samples (seeded per prompt and round), lossless
    rounds: int = 3
    out: Path | None = None                         # default: <output_dir>/bench
    threads: int | None = None                      # the target's intra-op threads; None: the fastest for vanilla
    peers: bool = True
    plots: bool = True
    peer_families: tuple[str, ...] | None = None    # None: every family that can run here
    llama_cpp: Path | None = None                   # llama.cpp's binaries (None: llama-server on PATH)
    llama_cpp_n_max: int = 5                        # its (and ik_llama.cpp's) speculative row's draft n-max
    ik_llama_cpp: Path | None = None                # ik_llama.cpp's binaries (None: that peer not run)
    workload: tuple | None = None                   # requests replayed in order (workload.py); prompts then come
                                                    #   from it, and suffix rows share one cache per round


def check_request(cfg: BenchConfig, manifest: dict) -> tuple[list[str], bool]:
    models = manifest["models"]
    built = list(models["target"]["precisions"])
    for m in cfg.methods:
        if m not in METHODS:
            raise SpecexportError(f"--methods: {m!r} is not a method; methods: {', '.join(METHODS)}")
    precisions = list(cfg.precisions or built)
    for p in precisions:
        if p not in built:
            raise SpecexportError(f"--precisions: {p!r} was not built for the target of {cfg.output_dir}; "
                                  f"built: {', '.join(built)}")
    if not cfg.prompts:
        raise SpecexportError("--prompts: no prompts")
    if "draft" not in models and set(cfg.methods) <= {"draft"}:
        raise SpecexportError(f"--methods: {cfg.output_dir} has no draft model; 'vanilla' and 'lookup' can run")
    if "medusa" in cfg.methods and "medusa" not in manifest.get("heads", {}):
        raise SpecexportError(f"--methods: {cfg.output_dir} has no Medusa heads (add medusa: to the model.yaml)")
    if "eagle" in cfg.methods and "eagle" not in manifest.get("heads", {}):
        raise SpecexportError(f"--methods: {cfg.output_dir} has no EAGLE head (add eagle: to the model.yaml)")
    return precisions, "draft" in models and "draft" in cfg.methods


def bench_configs(precisions, manifest, cfg, has_draft):
    """Per target precision: vanilla; the draft of the same precision at every γ (and the adaptive
    rows); with an fp32 target, every quantized draft at every γ (the edge trick: quantize the draft
    harder); with a quantized target, the fp32 draft at the first γ (acceptance cost of that side).
    Trees are planned by the method table (proposer_table): their depth is the row's γ column."""
    configs, models = [], manifest["models"]
    facts = Facts.of(manifest)
    draft_built = models.get("draft", {}).get("precisions", {}) if has_draft else {}
    for p in precisions:
        if "vanilla" in cfg.methods:
            configs.append(Config(VANILLA, p, None, 0))
        if "lookup" in cfg.methods:                 # prompt lookup: the target alone, up to γ tokens per round
            configs += [Config("lookup", p, None, g) for g in cfg.lookup_gammas or cfg.gammas]
        if "suffix" in cfg.methods:                 # suffix decoding: the target alone, a tree up to the verify width
            configs.append(Config("suffix", p, None, _planned("suffix", None, facts, flag="--methods").depth))
        for method, flag, names in (("medusa", "--medusa-trees", cfg.medusa_trees),
                                    ("eagle", "--eagle-trees", cfg.eagle_trees)):
            if method in cfg.methods:
                configs += [Config(method, p, None, _planned(method, name, facts, flag=flag).depth, tree=name)
                            for name in names]
        if p in draft_built:
            configs += [Config("draft", p, p, g) for g in cfg.gammas]
            configs += [Config("draft", p, p, max(cfg.gammas), stop) for stop in cfg.draft_stops if stop > 0]
            for name in cfg.trees:
                if name not in DRAFT_TREES:
                    raise SpecexportError(f"--trees: {name!r} is not a known tree; known: {', '.join(DRAFT_TREES)}")
                configs.append(Config("draft", p, p, _planned("draft", name, facts, flag="--trees").depth, tree=name))
    if "fp32" in draft_built:
        for p in precisions:
            if p != "fp32":
                configs.append(Config("draft", p, "fp32", cfg.gammas[0]))
    if "fp32" in precisions:
        for d in draft_built:
            if d != "fp32":
                configs += [Config("draft", "fp32", d, g) for g in cfg.gammas]
    return configs


def _planned(method: str, tree, facts: Facts, *, flag: str):
    """The method table's plan of one row (its errors named after the bench's option)."""
    try:
        return plan_proposer(MethodOptions(method, tree=tree), facts)
    except SpecexportError as err:
        raise SpecexportError(f"{flag}: {tree!r}: {err}") from None
