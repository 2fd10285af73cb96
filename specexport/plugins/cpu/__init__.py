"""specexport's CPU kernels on GGUF blocks (the C++ beside this file), compiled on first use or carried.

    Y[M, N] = X[M, K] . W^T   with W the file's blocks verbatim: ONNX Runtime custom ops in the domain
    "specexport.cpu" (GgufMatMul, GgufGather; sx_ort.cc) and a C interface for tests and benchmarks.

The library: the one an engine folder carries, where the runtime offered it (offer(); carry.py), else
compiled here into the kernels' cache (toolchain.py). Which, and why, is in status().line().

Environment: SPECEXPORT_KERNELS=off hides the library (the stock route runs); SPECEXPORT_KERNEL_PATH
(ref, avx2, avx2lanes, avxvnni, avx512vnni, avx512, amx, neon, i8mm, tiers) forces a kernel path; SPECEXPORT_KERNEL_SELFCHECK=off lets a SIMD
path run without first checking its bits against the reference's (planted-bug tests; `inspect` says so);
CXX names the compiler (arguments allowed: "ccache g++").
"""
from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from specexport.errors import KernelsUnavailable
from specexport.plugins.cpu import carry, headers, tiers
from specexport.plugins.cpu.capi import BLOCK, LAYOUTS, PATHS, TYPES, VERSION, Kernels  # noqa: F401
from specexport.plugins.cpu.toolchain import (HERE, KERNEL_SOURCES, OPTIONAL, ORT_SOURCE, UNIT_PATHS, build,  # noqa: F401
                                              cache_key, compiled, compiler, flags, kernels_dir, left_out,
                                              ort_include, sources)

__all__ = ["KernelsUnavailable", "Kernels", "Status", "status", "build", "register", "describe", "on_ours", "uses_kernels",
           "expected_paths", "LAYOUTS", "layout_of", "offer"]

DOMAIN = "specexport.cpu"
ORT_FLOOR = (1, headers.API_VERSION)                           # the C API the ops' headers ask for


def expected_paths() -> set[str] | None:
    """The kernel paths this CPU's flags say it runs (Linux's /proc/cpuinfo), or None where it cannot be read:
    what the tests hold the library to, so a path refused or left out fails them instead of hiding."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    words = set()                      # x86's "flags" lines, AArch64's "Features" lines
    for line in re.findall(r"^(?:flags|Features)\s*:(.*)$", text, re.M):
        words |= set(line.split())
    out = {"ref"}
    if {"avx2", "fma", "f16c"} <= words:
        out.add("avx2")
        out.add("avx2lanes")
        if "avx_vnni" in words:
            out.add("avxvnni")
        if {"avx512_vnni", "avx512vl"} <= words:
            out.add("avx512vnni")
            if {"avx512f", "avx512bw", "avx512dq"} <= words:
                out.add("avx512")
            if {"amx_int8", "amx_tile", "avx512bw", "avx512vbmi"} <= words:   # listed only where the OS saves tiles
                out.add("amx")
    if "asimddp" in words and platform.machine() in ("aarch64", "arm64"):
        out.add("neon")
        if "i8mm" in words:
            out.add("i8mm")
    return out


@dataclass(frozen=True)
class Status:
    """Whether the kernels run here: the ONNX Runtime library's path, or why not (once per process)."""
    library: Path | None
    paths: str = ""                # the kernel paths this CPU runs, e.g. "ref,avx2"
    path: str = ""                 # the one that runs (SPECEXPORT_KERNEL_PATH or the best)
    reason: str = ""
    refused: str = ""              # paths this CPU has that failed the self-check, each with its first difference
    selfcheck: str = ""            # what the self-check covered, or that it was off
    left_out: str = ""             # paths this library lacks because their unit did not compile, and why
    tiers: str = ""                # path "tiers": which path each type's passes of M rows run on (tiers.py)
    carried: bool = False          # the library is the one an engine folder carries (carry.py), not compiled here
    carried_why: str = ""          # why an offered engine's library was not used (then compiled here)
    built: dict = field(default_factory=dict, compare=False)   # its paths, units left out, compiler (compiled())

    @property
    def available(self) -> bool:
        return self.library is not None

    def line(self) -> str:
        if self.available:
            refused = (f"; refused: its bits differed from the reference's in the self-check: {self.refused}"
                       if self.refused else "")
            left = f"; left out: {self.left_out}" if self.left_out else ""
            off = "; self-check off: SPECEXPORT_KERNEL_SELFCHECK=off" if self.selfcheck.startswith("off") else ""
            tiers = f": {self.tiers}" if self.tiers else ""
            return (f"CPU kernels: specexport's ({self.path} path{tiers}; this CPU runs {self.paths}{refused}{left}"
                    f"{off}; {self.source})")
        return f"CPU kernels: ONNX Runtime's stock MatMulNBits ({self.reason})"

    @property
    def source(self) -> str:
        """Which library runs: the engine's, or one compiled here (and why not the engine's)."""
        if self.carried:
            return f"library: the engine's, {self.library.parent.parent.name}/{self.library.parent.name}"
        why = f"; the engine's not used: {self.carried_why}" if self.carried_why else ""
        return f"library: compiled here ({self.library.parent}){why}"


@functools.cache
def status() -> Status:
    """Build and load the library once per process. Never raises: whatever stops it (no compiler, no
    headers, an unwritable cache, an old ONNX Runtime) becomes the Status's reason and the stock route runs."""
    if os.environ.get("SPECEXPORT_KERNELS", "").lower() in ("off", "0", "no", "stock"):
        return Status(None, reason="SPECEXPORT_KERNELS=off")
    try:
        return _status()
    except KernelsUnavailable as err:
        return Status(None, reason=str(err))
    except Exception as err:      # noqa: BLE001 -- documented never to raise: an OSError of the cache, ...
        return Status(None, reason=f"{type(err).__name__}: {err}")


_offered: tuple[Path, dict] | None = None     # an engine folder and its manifest's `kernels` entry (offer())


def offer(engine: Path, manifest: dict) -> None:
    """Offer the library an engine folder carries (its manifest's `kernels` entry) to this process's first
    load: status() then tries it before any compile. Ignored once the kernels are loaded (the loaded library
    serves every engine: one kernel version per specexport)."""
    global _offered
    if status.cache_info().currsize == 0 and isinstance(manifest.get("kernels"), dict):
        _offered = (Path(engine), manifest["kernels"])


def _carried() -> tuple[Path | None, str]:
    """The offered engine's library, checked (sha256, architecture, kernel version, loads), or None and why."""
    if _offered is None:
        return None, ""
    path, why = carry.pick(*_offered)
    if path is None:
        return None, why
    try:
        version = Kernels(path).c.sx_version()
    except KernelsUnavailable as err:       # another glibc, a damaged file: compiled here instead
        return None, str(err)
    if version != VERSION:
        return None, f"{path}: kernel version {version}, this specexport's is {VERSION}; not used"
    return path, ""


def _status() -> Status:
    _check_runtime()
    lib, why = _carried()
    carried = lib is not None
    if not carried:
        try:
            lib = build()
        except KernelsUnavailable as err:
            raise KernelsUnavailable(f"{err}; the engine's library not used: {why}" if why else str(err)) from None
    k = Kernels(lib)
    c = k.c
    path = c.sx_resolve(-1)
    if path < 0:
        return Status(None, reason=f"SPECEXPORT_KERNEL_PATH={os.environ.get('SPECEXPORT_KERNEL_PATH')} "
                                   f"is not a path this CPU runs ({c.sx_paths().decode()})")
    names = {v: k for k, v in PATHS.items()}
    table = ""
    if names[path] == "tiers":        # measured once per CPU and library, cached; set in the loaded library
        measured = _measured_here or tiers.load_or_measure(k, lib, kernels_dir())
        tiers.apply(c, measured)
        table = tiers.describe(measured)
    if carried:                      # what the engine's manifest says of it
        rec = _offered[1]["libraries"][carry.machine()]
        built = {"paths": rec["paths"], "left_out": rec.get("left_out", {}), "compiler": rec.get("compiler", "")}
    else:
        built = compiled(lib)
    left = "; ".join(f"{','.join(v['paths'])} ({unit}: {v['why']})" for unit, v in built["left_out"].items())
    return Status(lib, c.sx_paths().decode(), names[path], refused=c.sx_refused_why().decode(),
                  selfcheck=c.sx_selfcheck().decode(), left_out=left, tiers=table, carried=carried, carried_why=why,
                  built=built)


_measured_here: dict | None = None    # a tier table this process measured for itself (remeasure_tiers)


def remeasure_tiers() -> str | None:
    """Measure the tier table anew for this process and set it (the bench: its figures run on a table measured
    where and when they are, not on one cached by whatever loaded the library first, perhaps beside other
    work); the cached file is left as it was. The table's description, or None where the tiers path does
    not run."""
    global _measured_here
    st = status()
    if not st.available or st.path != "tiers":
        return None
    _measured_here = tiers.measure(Kernels(st.library))
    status.cache_clear()
    return status().tiers


def _check_runtime() -> None:
    """The installed ONNX Runtime has the C API our ops are built for (else it would register nothing)."""
    import onnxruntime

    found = tuple(int(x) for x in re.findall(r"\d+", onnxruntime.__version__)[:2])
    if found < ORT_FLOOR:
        raise KernelsUnavailable(f"onnxruntime {onnxruntime.__version__} is older than "
                                 f"{'.'.join(map(str, ORT_FLOOR))}, whose C API the kernels' ops need")


def layout_of(entry: dict) -> str:
    """A built precision's weight layout (its manifest entry; "file" for builds before layouts: layout.py)."""
    return ((entry.get("quantization") or {}).get("kernels") or {}).get("layout", "file")


def on_ours(entry: dict) -> bool:
    """A built precision (`entry`: the manifest's) whose graph runs our kernels' ops (gguf, blocks)."""
    return ((entry.get("quantization") or {}).get("kernels") or {}).get("ops") == DOMAIN


def describe(entry: dict) -> str | None:
    """What a built precision's matmuls run on here, in one line (None: not a gguf graph). `entry`: the
    manifest's precision entry."""
    built = (entry.get("quantization") or {}).get("kernels")
    if built is None:
        return None
    if on_ours(entry):
        return status().line() + f"; weights in the {layout_of(entry)} layout"
    return f"CPU kernels: ONNX Runtime's stock MatMulNBits (at build: {built.get('why', 'not recorded')})"


def tiers_by_rows(entry: dict, rows) -> dict[int, str] | None:
    """For a built gguf precision on our kernels (`entry`: the manifest's), which path each of its block types
    runs on at each M of `rows` here: {M: "amx (Q4_K), avx512vnni (Q6_K)"}; None where the graph is not ours
    or the kernels do not load."""
    st = status()
    if not on_ours(entry) or not st.available:
        return None
    c = Kernels(st.library).c
    names = {v: k for k, v in PATHS.items()}
    types = sorted(entry["quantization"].get("block_types") or {})
    kind = layout_of(entry)
    out = {}
    for m in rows:
        by_path: dict[str, list[str]] = {}
        for t in types:
            if t in TYPES and kind in LAYOUTS:
                by_path.setdefault(names.get(c.sx_tier(TYPES[t] | LAYOUTS[kind], min(m, tiers.MAX_ROWS)), "?"), []).append(t)
        out[m] = ", ".join(f"{p} ({'/'.join(ts)})" for p, ts in by_path.items())
    return out


def uses_kernels(graph: Path) -> bool:
    """Whether an ONNX file calls our ops (its opset imports name the domain; weights live in the data
    file, so the graph file is small)."""
    try:
        return DOMAIN.encode() in Path(graph).read_bytes()
    except OSError:
        return False


def register(opts, graph: Path) -> None:
    """Register the library with ONNX Runtime SessionOptions `opts` when `graph` needs it; raise
    KernelsUnavailable (saying why, and what to do) when it needs it and it cannot load here."""
    if not uses_kernels(graph):
        return
    st = status()
    if not st.available:
        raise KernelsUnavailable(f"{graph}: this graph runs specexport's CPU kernels, which do not load here "
                                 f"({st.reason}); build it again with SPECEXPORT_KERNELS=off for ONNX Runtime's "
                                 "stock ops")
    opts.register_custom_ops_library(str(st.library))
