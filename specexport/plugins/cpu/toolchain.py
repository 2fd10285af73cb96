"""Compiling the kernels' library: the sources, their flags, the compiler, the cache key, the build.

Compiled by the system's C++ compiler into $SPECEXPORT_CACHE/kernels/<key>/ (default ~/.cache/specexport;
$SPECEXPORT_KERNELS_CACHE names the kernels' folder alone), the key a digest of every source and header here,
ONNX Runtime's headers, the compiler's version and the flags, so an edit or another compiler builds anew and
concurrent first uses build once (a file lock, an atomic rename). Why not a build backend at install: pip's
wheel of ONNX Runtime has no C headers, and a missing compiler would fail the install; here a missing piece
leaves the stock route (MatMulNBits) running and `status()` says why. An optional unit the toolchain cannot
compile (the VNNI paths on an assembler older than binutils 2.36) is left out, and said, instead of failing
the library. ONNX Runtime's headers: headers.py. Another architecture's library (for an engine folder to
carry): its cross compiler (CROSS). CXX names the compiler (arguments allowed: "ccache g++").
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specexport.config import cache_base
from specexport.errors import KernelsUnavailable
from specexport.plugins.cpu import headers

HERE = Path(__file__).parent
KERNEL_SOURCES = ("sx_ref.cc", "sx_dispatch.cc", "sx_selfcheck.cc", "sx_avx2.cc", "sx_avx2l.cc", "sx_vnni.cc", "sx_avx512.cc",
                  "sx_amx.cc", "sx_neon.cc", "sx_i8mm.cc")
# unit -> the paths it holds: left out (and said) where the toolchain cannot compile it
OPTIONAL = {"sx_vnni.cc": ("avxvnni", "avx512vnni"), "sx_avx512.cc": ("avx512",), "sx_amx.cc": ("amx",),
            "sx_i8mm.cc": ("i8mm",)}
UNIT_PATHS = {"sx_avx2.cc": ("avx2",), "sx_avx2l.cc": ("avx2lanes",), "sx_neon.cc": ("neon",), **OPTIONAL}
# an architecture other than this machine's -> its cross compiler (Debian's g++-aarch64-linux-gnu);
# $SPECEXPORT_CXX_AARCH64 names another
CROSS = {"aarch64": "aarch64-linux-gnu-g++"}
ORT_SOURCE = "sx_ort.cc"


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


_ALIASES = {"AMD64": "x86_64", "amd64": "x86_64", "arm64": "aarch64"}


def machine() -> str:
    """This machine's architecture as a manifest names it (x86_64, aarch64)."""
    m = platform.machine()
    return _ALIASES.get(m, m)


def cross_compiler(arch: str) -> list[str]:
    """The command that compiles for `arch` on this machine, or KernelsUnavailable saying what to install."""
    env = os.environ.get(f"SPECEXPORT_CXX_{arch.upper()}", "").strip()
    cmd = shlex.split(env) if env else [CROSS.get(arch, "")]
    if not cmd[0] or not shutil.which(cmd[0]):
        raise KernelsUnavailable(f"no C++ compiler for {arch} here ({env or CROSS.get(arch, 'none known')}: "
                                 f"apt-get install g++-{arch.replace('_', '-')}-linux-gnu, or set "
                                 f"SPECEXPORT_CXX_{arch.upper()})")
    return cmd


def _compiler_id(cxx: list[str]) -> str:
    try:
        return subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelsUnavailable(f"the C++ compiler {' '.join(cxx)} does not run: {err}") from err


def ort_include(fetch: bool = True) -> Path:
    """A folder with ONNX Runtime's C/C++ API headers (headers.py says from where)."""
    return headers.include(fetch, os.environ.get("SPECEXPORT_ORT_INCLUDE"), kernels_dir())


def kernels_dir() -> Path:
    """Where compiled libraries (and the fetched ORT headers) live: $SPECEXPORT_KERNELS_CACHE, else
    $SPECEXPORT_CACHE/kernels (default ~/.cache/specexport/kernels)."""
    env = os.environ.get("SPECEXPORT_KERNELS_CACHE")
    return Path(env) if env else cache_base() / "kernels"


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def cache_key(cxx: list[str], srcs: list[str], include: Path | None, *, defines: list[str]) -> str:
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
          emulate_amx: bool = False, emulate_avx512: bool = False, arch: str | None = None) -> Path:
    """Compile (once per key) and return the shared library's path. with_ort: the ONNX Runtime ops too
    (needs the headers); without them: the C interface only. plant: a -DSX_PLANT_<name> build with a
    deliberate bug, for the tests that must catch it. emulate_vnni: a test library whose VNNI paths run on
    any AVX2 CPU, their dot-product instructions computed exactly with AVX2 (sx_vnni.cc's VnniDot); emulate_amx:
    its AMX path too, the tile instructions in C (sx_amx.cc); emulate_avx512: the 512-bit tier's vector
    operations on pairs of AVX2 registers (sx_v512.h). A unit in
    OPTIONAL that does not compile is left out (left_out() says which and why). arch: another architecture's
    library (CROSS names its cross compiler), for an engine folder to carry."""
    cxx = compiler() if arch in (None, machine()) else cross_compiler(arch)
    srcs = sources(arch) + ([ORT_SOURCE] if with_ort else [])
    include = ort_include() if with_ort else None
    defines = ([f"-DSX_PLANT_{plant.upper()}"] if plant else []) + (["-DSX_EMULATE_VNNI"] if emulate_vnni else []) + \
        (["-DSX_EMULATE_AMX"] if emulate_amx else []) + (["-DSX_EMULATE_AVX512"] if emulate_avx512 else [])
    name = "libspecexport_cpu.so" if with_ort else "libspecexport_kernels.so"
    folder = kernels_dir() / cache_key(cxx, srcs, include, defines=defines)
    lib = folder / name
    if lib.is_file():
        _note_compiler(lib, cxx)
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
            _note_compiler(lib, cxx)
    return lib


def _note_compiler(lib: Path, cxx: list[str]) -> None:
    """The compiler's version line beside the library (an engine's manifest names it; the key holds it)."""
    note = lib.parent / f"{lib.name}.compiler.txt"
    if not note.is_file():
        with contextlib.suppress(OSError):      # a read-only cache: the manifest says "?"
            note.write_text((_compiler_id(cxx).strip().splitlines() or ["?"])[0])


def left_out(lib: Path) -> dict:
    """The optional units a built library lacks: {unit: {"paths": [...], "why": compiler's line}}."""
    try:
        return json.loads((lib.parent / f"{lib.name}.left-out.json").read_text())
    except (OSError, ValueError):
        return {}


def compiled(lib: Path, arch: str | None = None) -> dict:
    """What a library built here holds, for an engine folder's manifest (carry.record): the kernel paths
    compiled in, the units left out and why, the compiler's version line."""
    left = left_out(lib)
    units = [u for u in sources(arch) if u not in left]
    paths = ["ref", *(p for u in units for p in UNIT_PATHS.get(u, ()))]
    try:
        cxx = (lib.parent / f"{lib.name}.compiler.txt").read_text()
    except OSError:
        cxx = ""
    return {"paths": paths, "left_out": left, "compiler": cxx}


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-12:])
        raise KernelsUnavailable(f"compiling specexport's CPU kernels failed at {what}:\n{tail}")
