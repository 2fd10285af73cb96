"""Blocks ggml's own C quantizers write, for tests/test_kquant.py to hold specexport/quant/kquant.py to.

    python benchmarks/build_llama_cpp.py          # once: llama.cpp's sources and ggml-base, built
    python benchmarks/kquant_reference.py         # writes tests/data/kquant_reference.npz (~60 KB)

A 20-line C program linked with the llama.cpp build's libggml-base.a calls ggml_quantize_chunk (what
llama-quantize calls per tensor) on seeded rows with the edge cases a quantizer meets (all zero,
constant, one outlier, one sign, heavy tails, tiny values, zeros interleaved), without and (the types
that take one) with a seeded importance matrix.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from build_llama_cpp import cache_dir  # noqa: E402

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}   # ggml_type ids
WEIGHED = ("Q5_0", "Q4_K", "Q6_K", "Q4_0", "Q4_1")      # also with an importance matrix (quant/kquant.py's _impl ports)
OUT = Path(__file__).parent.parent / "tests" / "data" / "kquant_reference.npz"
HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
int main(int argc, char ** argv) {
    int type = atoi(argv[1]); long n = atol(argv[2]), k = atol(argv[3]);
    float * x = malloc(n * k * sizeof(float)), * im = NULL;
    if (fread(x, sizeof(float), n * k, stdin) != (size_t)(n * k)) return 2;
    if (argc > 4) {                      /* an importance matrix: k floats */
        FILE * f = fopen(argv[4], "rb");
        im = malloc(k * sizeof(float));
        if (!f || fread(im, sizeof(float), k, f) != (size_t)k) return 3;
        fclose(f);
    }
    void * y = malloc(ggml_row_size(type, k) * n);
    size_t got = ggml_quantize_chunk(type, x, y, 0, n, k, im);
    fwrite(y, 1, got, stdout);
    return 0;
}
"""


def rows(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((24, 512)) * 0.02).astype(np.float32)
    x[1] = 0
    x[2] = 0.5
    x[3, 7] = 3.0
    x[4] = np.abs(x[4])
    x[5] = -np.abs(x[5])
    x[6] = rng.standard_t(2, 512) * 0.01
    x[7, :256] = 0
    x[8] *= 1e-3
    x[9, ::3] = 0
    x[10] = rng.uniform(-1, 1, 512) * np.exp(rng.uniform(-8, 2, 512))
    return x


def main() -> None:
    root = cache_dir()
    lib = root / "build" / "ggml" / "src" / "libggml-base.a"
    if not lib.is_file():
        sys.exit(f"{lib} not found: run python benchmarks/build_llama_cpp.py first")
    x = rows()
    with tempfile.TemporaryDirectory() as tmp:
        src, obj, exe = Path(tmp) / "h.c", Path(tmp) / "h.o", Path(tmp) / "h"
        src.write_text(HARNESS)
        subprocess.run(["gcc", "-O2", "-c", str(src), "-o", str(obj), f"-I{root / 'src' / 'ggml' / 'include'}"], check=True)
        subprocess.run(["g++", str(obj), str(lib), "-lm", "-fopenmp", "-lpthread", "-o", str(exe)], check=True)
        importance = (np.random.default_rng(1).gamma(0.5, 1.0, x.shape[1]) + 1e-3).astype(np.float32)
        importance.tofile(Path(tmp) / "imatrix.f32")
        out = {"x": x, "importance": importance}
        runs = [(name, name, []) for name in TYPES] + [(f"{n}_imatrix", n, [str(Path(tmp) / "imatrix.f32")])
                                                       for n in WEIGHED]
        for key, name, extra in runs:
            raw = subprocess.run([str(exe), str(TYPES[name]), *map(str, x.shape), *extra], input=x.tobytes(),
                                 capture_output=True, check=True).stdout
            out[key] = np.frombuffer(raw, np.uint8).reshape(x.shape[0], -1)
    np.savez_compressed(OUT, **out, llama_cpp=np.array(root.name))
    print(f"{OUT}: {', '.join(TYPES)} (and {', '.join(WEIGHED)} with an imatrix) of {x.shape[0]} rows x "
          f"{x.shape[1]} ({OUT.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
