"""Vanilla decode speed of graphs from different builds, interleaved in one process (medians, ratios).

    python benchmarks/blocks_vs_gguf.py ENGINE:PRECISION ENGINE:PRECISION ... [--rounds 5] [--tokens 128]

e.g. a Hugging Face checkpoint's int4 (scheme blocks) against the published Q4_1 GGUF's own graph:
    python benchmarks/blocks_vs_gguf.py engines/smollm2-blocks:int4 engines/smollm2-gguf:gguf
"""
from __future__ import annotations

import argparse
import statistics
import time

import specexport

PROMPTS = ("def quicksort(xs):", "The three laws of motion are", "import numpy as np\n\ndef softmax(x):",
           "Write a haiku about the sea.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("graphs", nargs="+", help="ENGINE_DIR:PRECISION")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    pipes = {}
    for spec in args.graphs:
        folder, precision = spec.rsplit(":", 1)
        pipes[spec] = specexport.load(folder, precision=precision, **({"threads": args.threads} if args.threads else {}))
    rates = {k: [] for k in pipes}
    for pipe in pipes.values():                      # warm-up
        pipe.generate(PROMPTS[0], max_new_tokens=16, method="vanilla")
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            for spec, pipe in pipes.items():          # interleaved: one prompt on each graph in turn
                start = time.perf_counter()
                out = pipe.generate(prompt, max_new_tokens=args.tokens, method="vanilla")
                rates[spec].append(len(out.token_ids) / (time.perf_counter() - start))
    first = next(iter(pipes))
    base = statistics.median(rates[first])
    for spec, r in rates.items():
        med = statistics.median(r)
        print(f"{spec:50s} {med:7.1f} tok/s (median of {len(r)})  {med / base:5.2f}x {first}")


if __name__ == "__main__":
    main()
