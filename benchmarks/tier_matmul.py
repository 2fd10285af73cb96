"""One matmul on each kernel path, one thread, the paths interleaved: ps a weight by rows M (the table in
docs/cpu-kernels.md "Measured on a Xeon with AMX").

    python benchmarks/tier_matmul.py [--paths avx512vnni,avx512,amx] [--rows 1,2,4,8,16] [--reps 9] [--types Q4_1]

Shapes: Qwen2.5-Coder-1.5B's (Q4_K 8960 x 1536, Q6_K 1536 x 8960, Q8_0 4096 x 1536), SmolLM2-135M's MLP
(Q4_1 1536 x 576 and 576 x 1536), a Q4_0 4096 x 1536; random valid blocks;
the fastest of `reps` runs (the least disturbed); the C interface (quantize + matmul) through ctypes.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from specexport.plugins import cpu
from specexport.quant.gguf_blocks import random_blocks

SHAPES = (("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960), ("Q8_0", 4096, 1536), ("Q4_1", 1536, 576), ("Q4_1", 576, 1536),
          ("Q4_0", 4096, 1536))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="avx512vnni,avx512,amx")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--types", default="", help="only these weight types (comma-separated; default: all)")
    args = ap.parse_args()
    k = cpu.Kernels()
    paths = [p for p in args.paths.split(",") if p in k.paths()]
    rows = [int(m) for m in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"paths here: {','.join(k.paths())}; one thread; ps a weight (fastest of {args.reps})")
    print("| type, shape | path | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for qtype, N, K in SHAPES:
        if args.types and qtype not in args.types.split(","):
            continue
        w = random_blocks(rng, qtype, N, k=K)
        best = {}
        for m in rows:
            x = rng.standard_normal((m, K)).astype(np.float32)
            for _ in range(args.reps):
                for p in paths:
                    t = time.perf_counter()
                    k.matmul(qtype, x, w, path=p)
                    best[(m, p)] = min(best.get((m, p), 1e9), time.perf_counter() - t)
        for p in paths:
            cells = " | ".join(f"{best[(m, p)] * 1e12 / (N * K):.0f}" for m in rows)
            print(f"| {qtype} {N} x {K} | {p} | {cells} |")


if __name__ == "__main__":
    main()
