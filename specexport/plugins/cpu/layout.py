"""The weights' layout in a graph on our kernels (sx_layout.h defines it; the C library writes it): "file", the
GGUF blocks verbatim, or "r8", the same bytes with eight rows interleaved so a kernel loads eight rows' codes
with plain loads. Which one a build writes (quantization.<p>.layout); what a manifest says was written:
plugins.cpu.layout_of."""
from __future__ import annotations

import functools
from pathlib import Path

from specexport.plugins.cpu.capi import PATHS, TYPES, Kernels


@functools.cache
def _c(lib: Path | None) -> Kernels:
    return Kernels(lib)


def repack(qtype: str, raw, K: int, to: str, lib: Path | None = None):
    """A weight's blocks [N, row bytes] (the file's layout) in layout `to` ("file": as they are), by the kernels'
    own function (library `lib`, else the C interface built alone): the layout is defined once, in C++."""
    return raw if to == "file" else _c(lib).repack(qtype, raw, K, to=to)


def choose(choice: str, kernels) -> tuple[str, str]:
    """The layout for a graph on `kernels` (plugins.cpu.Status), and why: "file" or "r8" as asked; "auto": r8
    where it was measured faster at every row count, the AVX2 CPUs' one-row path (avx2: docs/cpu-kernels.md),
    else the file's (the VNNI, AVX-512 and AMX paths run r8 on the AVX2 lanes, the Arm paths through their
    file kernels: neither measured faster yet)."""
    if choice != "auto":
        return choice, f"layout: {choice}"
    if not kernels.available:
        return "file", "layout: auto (the stock ops read the file's blocks)"
    k = _c(kernels.library)
    names = {v: n for n, v in PATHS.items()}
    path = k.c.sx_resolve(-1)
    one_row = names.get(k.c.sx_tier(TYPES["Q4_K"], 1) if names.get(path) == "tiers" else path, "ref")
    if one_row == "avx2" and k.r8_kernel(one_row):
        return "r8", f"layout: auto (r8: this CPU's one-row path, {one_row}, runs r8 on its lanes kernel)"
    return "file", (f"layout: auto (file: this CPU's one-row path, {one_row}, has no r8 kernel measured faster than "
                    "its file kernels)")


def settled(settings: dict, kernels) -> dict:
    """A precision's quantization settings with layout "auto" replaced by what it chooses on `kernels()` (a
    callable: the status is built only when asked): a stage's fingerprint, so a graph built where auto chose
    otherwise is not reused."""
    if settings.get("layout") != "auto":
        return settings
    return {**settings, "layout": choose("auto", kernels())[0]}

