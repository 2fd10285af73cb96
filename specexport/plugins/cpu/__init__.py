"""specexport's CPU kernels on GGUF blocks (the C++ beside this file), compiled on first use.

    Y[M, N] = X[M, K] . W^T   with W the file's blocks verbatim: ONNX Runtime custom ops in the domain
    "specexport.cpu" (GgufMatMul, GgufGather; sx_ort.cc) and a C interface for tests and benchmarks.

Compiled by the system's C++ compiler into $SPECEXPORT_CACHE/kernels/<key>/ (default ~/.cache/specexport;
$SPECEXPORT_KERNELS_CACHE names the kernels' folder alone),
the key a digest of every source and header here, ONNX Runtime's headers, the compiler's version and the
flags, so an edit or another compiler builds anew and concurrent first uses build once (a file lock, an
atomic rename). Why not a build backend at install: pip's wheel of ONNX Runtime has no C headers, and a
missing compiler would fail the install; here a missing piece leaves the stock route (MatMulNBits) running
and `status()` says why. An optional unit the toolchain cannot compile (the VNNI paths on an assembler older
than binutils 2.36) is left out, and said, instead of failing the library. ONNX Runtime's headers: headers.py.

Environment: SPECEXPORT_KERNELS=off hides the library (the stock route runs); SPECEXPORT_KERNEL_PATH
(ref, avx2, avx2lanes, avxvnni, avx512vnni, avx512, amx, neon, i8mm, tiers) forces a kernel path; SPECEXPORT_KERNEL_SELFCHECK=off lets a SIMD
path run without first checking its bits against the reference's (planted-bug tests; `inspect` says so);
CXX names the compiler (arguments allowed: "ccache g++").
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


from specexport.config import cache_base
from specexport.errors import KernelsUnavailable
from specexport.plugins.cpu import headers, tiers
from specexport.plugins.cpu.capi import LAYOUTS, PATHS, TYPES, Kernels

__all__ = ["KernelsUnavailable", "Kernels", "Status", "status", "build", "register", "describe", "on_ours", "uses_kernels",
           "expected_paths", "LAYOUTS", "layout_of"]

DOMAIN = "specexport.cpu"
HERE = Path(__file__).parent
KERNEL_SOURCES = ("sx_ref.cc", "sx_dispatch.cc", "sx_selfcheck.cc", "sx_avx2.cc", "sx_avx2l.cc", "sx_vnni.cc", "sx_avx512.cc",
                  "sx_amx.cc", "sx_neon.cc", "sx_i8mm.cc")
# unit -> the paths it holds: left out (and said) where the toolchain cannot compile it
OPTIONAL = {"sx_vnni.cc": ("avxvnni", "avx512vnni"), "sx_avx512.cc": ("avx512",), "sx_amx.cc": ("amx",),
            "sx_i8mm.cc": ("i8mm",)}
ORT_SOURCE = "sx_ort.cc"
BLOCK = {t: 256 if t.endswith("_K") else 32 for t in TYPES}   # weights per (super-)block along K
ORT_FLOOR = (1, headers.API_VERSION)                           # the C API the ops' headers ask for


def flags(source: str, defines: list[str] = ()) -> list[str]:
    """The compiler flags of one source file. -ffp-contract=off: the float steps are the reference's,
    never fused differently by one translation unit (bit-identical paths). Test libraries (a planted bug, an
    emulated instruction set) compile at -O1: their bits are the same (no fast-math), they build in half the
    time, and they are never timed."""
    test = any(d.startswith(("-DSX_PLANT_", "-DSX_EMULATE_")) for d in defines)
    out = ["-O1" if test else "-O2", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fvisibility=hidden"]
    if source in ("sx_avx2.cc", "sx_avx2l.cc", "sx_vnni.cc", "sx_avx512.cc", "sx_amx.cc"):
        out += ["-mavx2", "-mfma", "-mf16c"]
    avx512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
    if source == "sx_avx512.cc" and "-DSX_EMULATE_AVX512" not in defines:   # runs only where the CPU has them
        out += avx512
    if source == "sx_amx.cc" and "-DSX_EMULATE_AMX" not in defines:   # runs only where the CPU has them
        out += [*avx512, "-mavx512vbmi", "-mamx-tile", "-mamx-int8"]
    if source == "sx_neon.cc":
        out += ["-march=armv8.2-a+dotprod"]
    if source == "sx_i8mm.cc":     # runs only where the CPU has it (sx_dispatch.cc's cpu_has)
        out += ["-march=armv8.2-a+dotprod+i8mm"]
    return out


def sources(arch: str | None = None) -> list[str]:
    """The kernel sources this architecture compiles (the x86 files on x86-64, the NEON one on AArch64)."""
    arch = arch or platform.machine()
    x86, arm = ("x86_64", "AMD64"), ("aarch64", "arm64")
    only = {"sx_avx2.cc": x86, "sx_avx2l.cc": x86, "sx_vnni.cc": x86, "sx_avx512.cc": x86, "sx_amx.cc": x86, "sx_neon.cc": arm,
            "sx_i8mm.cc": arm}
    return [s for s in KERNEL_SOURCES if arch in only.get(s, (arch,))]


def compiler() -> list[str]:
    """The C++ compiler's command: $CXX split as a shell would ("ccache g++"), else g++, c++ or clang++."""
    env = os.environ.get("CXX", "").strip()
    if env:
        cmd = shlex.split(env)
        if not shutil.which(cmd[0]):
            raise KernelsUnavailable(f"CXX={env}: {cmd[0]} is not a command here")
        return cmd
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise KernelsUnavailable("no C++ compiler found (set CXX, or install g++)")
    return [cxx]


def _compiler_id(cxx: list[str]) -> str:
    try:
        return subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelsUnavailable(f"the C++ compiler {' '.join(cxx)} does not run: {err}") from err


def ort_include(fetch: bool = True) -> Path:
    """A folder with ONNX Runtime's C/C++ API headers (headers.py says from where)."""
    return headers.include(fetch, os.environ.get("SPECEXPORT_ORT_INCLUDE"))


def kernels_dir() -> Path:
    """Where compiled libraries (and the fetched ORT headers) live: $SPECEXPORT_KERNELS_CACHE, else
    $SPECEXPORT_CACHE/kernels (default ~/.cache/specexport/kernels)."""
    env = os.environ.get("SPECEXPORT_KERNELS_CACHE")
    return Path(env) if env else cache_base() / "kernels"


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def cache_key(cxx: list[str], srcs: list[str], include: Path | None, defines: list[str]) -> str:
    """Every file here the compiler may read (all sources and headers, not only the listed ones), the ORT
    headers, the compiler's version and every unit's flags."""
    h = hashlib.sha256(_compiler_id(cxx).encode() + " ".join(cxx).encode())
    for f in sorted(p for p in HERE.iterdir() if p.suffix in (".cc", ".h")):
        h.update(f.name.encode() + f.read_bytes())
    for s in srcs:
        h.update(s.encode() + " ".join(flags(s, defines) + defines).encode())
    h.update(headers.digest(include).encode() if include else b"no ORT")
    return h.hexdigest()[:16]


def build(with_ort: bool = True, *, plant: str | None = None, emulate_vnni: bool = False,
          emulate_amx: bool = False, emulate_avx512: bool = False) -> Path:
    """Compile (once per key) and return the shared library's path. with_ort: the ONNX Runtime ops too
    (needs the headers); without them: the C interface only. plant: a -DSX_PLANT_<name> build with a
    deliberate bug, for the tests that must catch it. emulate_vnni: a test library whose VNNI paths run on
    any AVX2 CPU, their dot-product instructions computed exactly with AVX2 (sx_vnni.cc's VnniDot); emulate_amx:
    its AMX path too, the tile instructions in C (sx_amx.cc); emulate_avx512: the 512-bit tier's vector
    operations on pairs of AVX2 registers (sx_v512.h). A unit in
    OPTIONAL that does not compile is left out (left_out() says which and why)."""
    cxx = compiler()
    srcs = sources() + ([ORT_SOURCE] if with_ort else [])
    include = ort_include() if with_ort else None
    defines = ([f"-DSX_PLANT_{plant.upper()}"] if plant else []) + (["-DSX_EMULATE_VNNI"] if emulate_vnni else []) + \
        (["-DSX_EMULATE_AMX"] if emulate_amx else []) + (["-DSX_EMULATE_AVX512"] if emulate_avx512 else [])
    name = "libspecexport_cpu.so" if with_ort else "libspecexport_kernels.so"
    folder = kernels_dir() / cache_key(cxx, srcs, include, defines)
    lib = folder / name
    if lib.is_file():
        return lib
    from filelock import FileLock

    with FileLock(str(_mkdir(folder) / ".lock")):
        if lib.is_file():
            return lib
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            def compile_unit(s: str) -> KernelsUnavailable | None:
                cmd = [*cxx, *flags(s, defines), *defines, "-I", str(HERE), *(["-I", str(include)] if include else []),
                       "-c", str(HERE / s), "-o", str(Path(tmp) / (s + ".o"))]
                try:
                    _run(cmd, s)
                except KernelsUnavailable as err:
                    return err
                return None

            # the units side by side (one compiler a core): the first use waits on the slowest unit, not the sum
            with ThreadPoolExecutor(max_workers=max(1, min(len(srcs), os.cpu_count() or 1))) as pool:
                failed = dict(zip(srcs, pool.map(compile_unit, srcs)))
            objs, left = [], {}
            for s in srcs:
                err = failed[s]
                if err is None:
                    objs.append(str(Path(tmp) / (s + ".o")))
                    continue
                if s not in OPTIONAL:
                    raise err
                lines = str(err).splitlines()[1:] or [str(err)]
                first = next((x for x in lines if "error" in x.lower()), lines[-1])
                left[s] = {"paths": list(OPTIONAL[s]), "why": first.strip()[:300]}
            out = Path(tmp) / name
            _run([*cxx, "-shared", "-o", str(out), *objs], "linking")
            (folder / f"{name}.left-out.json").write_text(json.dumps(left))
            out.rename(lib)                          # atomic: a half-written library is never seen
    return lib


def left_out(lib: Path) -> dict:
    """The optional units a built library lacks: {unit: {"paths": [...], "why": compiler's line}}."""
    try:
        return json.loads((lib.parent / f"{lib.name}.left-out.json").read_text())
    except (OSError, ValueError):
        return {}


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-12:])
        raise KernelsUnavailable(f"compiling specexport's CPU kernels failed at {what}:\n{tail}")


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
                    f"{off})")
        return f"CPU kernels: ONNX Runtime's stock MatMulNBits ({self.reason})"


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


def _status() -> Status:
    _check_runtime()
    lib = build()
    k = Kernels(lib)
    c = k.c
    path = c.sx_resolve(-1)
    if path < 0:
        return Status(None, reason=f"SPECEXPORT_KERNEL_PATH={os.environ.get('SPECEXPORT_KERNEL_PATH')} "
                                   f"is not a path this CPU runs ({c.sx_paths().decode()})")
    names = {v: k for k, v in PATHS.items()}
    table = ""
    if names[path] == "tiers":        # measured once per CPU and library, cached; set in the loaded library
        measured = _measured_here or tiers.load_or_measure(k, lib)
        tiers.apply(c, measured)
        table = tiers.describe(measured)
    left = "; ".join(f"{','.join(v['paths'])} ({unit}: {v['why']})" for unit, v in left_out(lib).items())
    return Status(lib, c.sx_paths().decode(), names[path], refused=c.sx_refused_why().decode(),
                  selfcheck=c.sx_selfcheck().decode(), left_out=left, tiers=table)


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
