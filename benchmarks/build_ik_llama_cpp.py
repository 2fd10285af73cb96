"""Build ik_llama.cpp's server and llama-bench (the CPU peer `specexport bench --ik-llama-cpp` runs) from a
checkout of its sources, and cache them.

    python benchmarks/build_ik_llama_cpp.py --source ~/src/ik_llama.cpp     # prints the folder with llama-server
    specexport bench engines/qwen --ik-llama-cpp "$(python benchmarks/build_ik_llama_cpp.py --source ...)"

ik_llama.cpp is not on a package registry: give a checkout (git clone of ikawrakow/ik_llama.cpp). Built with
-DGGML_NATIVE=ON for this machine's CPU, as its README builds it, with its FlashAttention kernels for the
common KV types only (GGML_IQK_FA_ALL_QUANTS off: the full set takes over an hour on 2 cores and serves
quantized KV caches, which the bench does not use). The binaries land in
$SPECEXPORT_CACHE/ik_llama.cpp-<commit>/bin (a folder marked as specexport's); a later run finds them there.
About 40 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from build_llama_cpp import run         # benchmarks/ is this script's folder: its neighbour's command runner

TARGETS = ("llama-server", "llama-bench")
BY = "benchmarks/build_ik_llama_cpp.py"


def commit_of(source: Path) -> str:
    out = subprocess.run(["git", "-C", str(source), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{source}: not a git checkout of ik_llama.cpp ({out.stderr.strip()[:200]})")
    return out.stdout.strip()


def build(source: Path, jobs: int) -> Path:
    from specexport import owned

    if not (source / "ggml" / "src" / "iqk").is_dir():
        sys.exit(f"{source}: no ggml/src/iqk (not an ik_llama.cpp checkout)")
    base = Path(os.environ.get("SPECEXPORT_CACHE") or Path.home() / ".cache" / "specexport").expanduser()
    folder = base / f"ik_llama.cpp-{commit_of(source)}"
    if all((folder / "bin" / t).is_file() for t in TARGETS):
        return folder / "bin"
    if folder.exists() and not owned.is_owned(folder, BY):
        sys.exit(f"{folder} exists and was not made by {BY}: move it away")
    if not folder.exists():
        owned.create(folder, by=BY)
    build_dir = folder / "build"
    run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DGGML_IQK_FA_ALL_QUANTS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    run(["cmake", "--build", str(build_dir), f"-j{jobs}", "--target", *TARGETS])
    (folder / "bin").mkdir(exist_ok=True)
    for t in TARGETS:
        binary = build_dir / "bin" / t
        if not binary.is_file():
            sys.exit(f"ik_llama.cpp built, but {binary} is missing")
        (folder / "bin" / t).write_bytes(binary.read_bytes())
        (folder / "bin" / t).chmod(0o755)
    return folder / "bin"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, required=True, help="a checkout of ik_llama.cpp")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    print(build(args.source.expanduser().resolve(), args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
