"""A prompt's prefill: ours (the runtime's 64-row chunks on a gguf build) against llama.cpp's `llama-bench -p N
-n 0` on the same GGUF file, alternated over rounds; tokens per second, medians and their ratio.

    python benchmarks/prefill.py engines/qwen examples/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --llama-cpp ~/.cache/specexport/llama.cpp-0.3.36/bin --tokens 512 --rounds 3
"""
import argparse
import csv
import io
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("gguf", type=Path, help="the GGUF file the build's target came from")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="folder with llama-bench")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import specexport
    from specexport.runtime.backends.base import prefill
    from specexport.runtime.pipeline import PREFILL_CHUNK

    ours, theirs = [], []
    with specexport.load(args.build, precision="gguf", threads=args.threads) as pipe:
        target = pipe.target
        ids = (np.arange(args.tokens) * 7919 + 13) % target.vocab_size      # any tokens: the cost is the same
        prefill(target, ids[:PREFILL_CHUNK], PREFILL_CHUNK)                 # warm
        for r in range(args.rounds):
            target.reset()
            start = time.perf_counter()
            prefill(target, ids, PREFILL_CHUNK)
            ours.append(args.tokens / (time.perf_counter() - start))
            out = subprocess.run([str(args.llama_cpp / "llama-bench"), "-m", str(args.gguf), "-p", str(args.tokens),
                                  "-n", "0", "-t", str(args.threads), "-r", "1", "-o", "csv"],
                                 capture_output=True, text=True, check=True).stdout
            theirs.append(float(list(csv.DictReader(io.StringIO(out)))[-1]["avg_ts"]))
            print(f"round {r + 1}: ours {ours[-1]:.1f} tok/s, llama-bench pp{args.tokens} {theirs[-1]:.1f}", flush=True)
    mine, peer = statistics.median(ours), statistics.median(theirs)
    print(f"prefill of {args.tokens} tokens, {args.threads} threads: ours {mine:.1f} tok/s (chunks of {PREFILL_CHUNK}), "
          f"llama.cpp {peer:.1f}: {mine / peer:.2f}x")


if __name__ == "__main__":
    main()
