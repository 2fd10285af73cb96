"""EAGLE / Medusa heads as Q8_0 blocks on our kernels against the same heads in fp32, interleaved in one
process beside vanilla (medians, ratios; every greedy output checked equal to vanilla's).

    python benchmarks/head_blocks.py ENGINE [--precision gguf] [--method eagle] [--trees auto,dynamic:1/5/5]
        [--prompts FILE --chat] [--rounds 2] [--tokens 128]

e.g. SmolLM2-135M-Instruct with its EAGLE-3 head (examples/smollm2-eagle-gguf.yaml):
    python benchmarks/head_blocks.py engines/smollm2-eagle --prompts examples/smollm2/heldout.jsonl --chat
The fp32 row is the same build opened with its heads' q8_0 stage left out of the manifest it read (what a
build without it would run): for this measurement only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import specexport

PROMPTS = ("def quicksort(xs):", "The three laws of motion are", "import numpy as np\n\ndef softmax(x):",
           "Write a haiku about the sea.")


def tree_option(text: str):
    if text.startswith("dynamic:"):
        k, d, t = (int(x) for x in text.split(":", 1)[1].split("/"))
        return {"top_k": k, "depth": d, "total_tokens": t}
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("--precision", default="gguf")
    ap.add_argument("--method", default="eagle", choices=("eagle", "medusa"))
    ap.add_argument("--trees", default="auto")
    ap.add_argument("--prompts", default=None, help="JSON lines of prompt strings")
    ap.add_argument("--count", type=int, default=12, help="the first COUNT prompts of --prompts")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    texts = PROMPTS if args.prompts is None else \
        [json.loads(line) for line in open(args.prompts) if line.strip()][:args.count]
    blocks = specexport.load(args.engine, precision=args.precision)
    fp32 = specexport.load(args.engine, precision=args.precision)
    removed = fp32.manifest["heads"][args.method]["precisions"].pop("q8_0", None)
    if removed is None:
        raise SystemExit(f"{args.engine}: its {args.method} heads have no q8_0 stage (the target is not on our kernels)")
    prompts = [{"prompt_ids": blocks.chat_ids(t)} if args.chat else {"prompt": t} for t in texts]
    rows = {"vanilla": (blocks, {"method": "vanilla"})}
    for tree in args.trees.split(","):
        for name, pipe in (("q8_0", blocks), ("fp32", fp32)):
            rows[f"{args.method} {tree}, heads {name}"] = (pipe, {"method": args.method, "tree": tree_option(tree)})
    for pipe, options in rows.values():                              # warm-up: sessions opened
        pipe.generate(**prompts[0], max_new_tokens=8, **options)
    rates = {k: [] for k in rows}
    want = {}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name, (pipe, options) in rows.items():               # interleaved: each prompt on every row
                start = time.perf_counter()
                out = pipe.generate(**prompt, max_new_tokens=args.tokens, **options)
                rates[name].append(len(out.token_ids) / (time.perf_counter() - start))
                ids = list(out.token_ids)
                if want.setdefault(i, ids) != ids:
                    raise SystemExit(f"{name}: prompt {i} differs from vanilla's greedy output")
    base = statistics.median(rates["vanilla"])
    print(f"{args.engine} {args.precision}, {len(prompts)} prompts x {args.rounds} rounds, {args.tokens} tokens, "
          f"greedy; every output equal to vanilla's")
    for name, r in rates.items():
        med = statistics.median(r)
        lo, hi = np.percentile(r, [25, 75])
        print(f"{name:42s} {med:7.1f} tok/s (median of {len(r)}, IQR {lo:.1f}-{hi:.1f})  {med / base:5.2f}x vanilla")


if __name__ == "__main__":
    main()
