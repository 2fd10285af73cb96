"""Build llama.cpp's command-line tools (the CPU peer `specexport bench --llama-cpp` runs) from the
llama-cpp-python sdist on PyPI, whose vendor/llama.cpp holds the sources, and cache them.

    python benchmarks/build_llama_cpp.py            # prints the folder with llama-server, llama-bench, ...
    specexport bench engines/qwen --llama-cpp "$(python benchmarks/build_llama_cpp.py)"

About 10 minutes on 2 cores, once: the binaries land in $SPECEXPORT_CACHE/llama.cpp-<version>/bin (default
~/.cache/specexport), a folder marked as specexport's (specexport.owned); a later run finds them there.
Built with -DGGML_NATIVE=ON for this machine's CPU (its AVX-512 / VNNI where present), as a llama.cpp user
on this machine would build it, but without AMX (NO_AMX below: it crashes here).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"           # llama-cpp-python; its vendor/llama.cpp is the llama.cpp that runs
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"   # its sdist, pinned
TARGETS = ("llama-server", "llama-completion", "llama-speculative-simple", "llama-bench",
           "llama-quantize", "llama-imatrix")     # the last two: benchmarks/imatrix_vs_llama.py
BY = "benchmarks/build_llama_cpp.py"
# -march=native turns on ggml's AMX kernels where the CPU has AMX; on these machines (Xeon with AMX, under
# a hypervisor) its first matmul segfaults in ggml_backend_amx_mul_mat, so AMX is left out: AVX-512 and
# VNNI stay (what llama.cpp's own CPU paths use here)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cache_dir() -> Path:
    base = os.environ.get("SPECEXPORT_CACHE") or Path.home() / ".cache" / "specexport"
    return Path(base).expanduser() / f"llama.cpp-{VERSION}"


def built(folder: Path) -> bool:
    return all((folder / "bin" / t).is_file() for t in TARGETS)


def build(jobs: int) -> Path:
    from specexport import owned

    folder = cache_dir()
    if built(folder):
        return folder / "bin"
    if folder.exists() and not owned.is_owned(folder, BY):
        sys.exit(f"{folder} exists and was not made by {BY}: move it away")
    if not folder.exists():
        owned.create(folder, by=BY)
    src = folder / "src"                     # kept, with the build tree: adding a target later is incremental
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            from specexport.pinned import pip_download

            # the sdist's hash is checked before pip runs any of its code (its metadata step)
            sdist = pip_download(f"llama-cpp-python=={VERSION}", SDIST_SHA256, Path(tmp), sdist=True)
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp").rename(src)
    build_dir = folder / "build"
    run(["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    run(["cmake", "--build", str(build_dir), f"-j{jobs}", "--target", *TARGETS])
    (folder / "bin").mkdir(exist_ok=True)
    for t in TARGETS:
        binary = build_dir / "bin" / t
        if binary.is_file():
            (folder / "bin" / t).write_bytes(binary.read_bytes())
            (folder / "bin" / t).chmod(0o755)
    if not built(folder):
        sys.exit(f"llama.cpp built, but {folder / 'bin'} lacks some of {', '.join(TARGETS)}")
    return folder / "bin"


def run(cmd) -> None:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    print(build(args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
