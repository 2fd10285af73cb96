"""Sampled decoding (temperature, top-p) on a build, for two checkouts interleaved round by round: what the
per-token sampling Python costs a user (warp, top-p) next to the forwards.

Each (checkout, round) runs in a fresh process with the checkout first on sys.path; it prints tok/s per method and
a hash of the tokens, so equal hashes show the two checkouts sample the same tokens for the same seeds.

    python benchmarks/sampled_decode.py OLD_CHECKOUT NEW_CHECKOUT ENGINE [--precision gguf] [--rounds 3]
        [--prompts examples/qwen/prompts.jsonl] [--top-p 0.9] [--top-k K] [--temperature 0.8]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

METHODS = (("vanilla", 1), ("draft", 3))


def child(args) -> None:
    import specexport

    prompts = [json.loads(line) for line in open(args.prompts)][:args.n_prompts]
    out, digest = {}, hashlib.sha1()
    with specexport.load(args.engine, precision=args.precision) as pipe:
        for method, gamma in METHODS:
            speeds = []
            for seed, prompt in enumerate(prompts):
                r = pipe.generate(prompt, max_new_tokens=args.tokens, method=method, gamma=gamma, seed=seed,
                                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
                speeds.append(r.stats.tokens_per_second)
                digest.update(repr(r.token_ids).encode())
            out[method] = statistics.mean(speeds)
    print(json.dumps({"tok_s": out, "tokens": digest.hexdigest()[:12]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--precision", default="gguf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", default=str(Path(__file__).parents[1] / "examples" / "qwen" / "prompts.jsonl"))
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.9, help="1 for none")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    runs: dict = {"old": [], "new": []}
    for _ in range(args.rounds):
        for side in ("old", "new"):
            line = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.path[:0] = sys.argv[1:2]; "
                                   "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                                   str(getattr(args, side).resolve()), __file__, *sys.argv[1:], "--child"],
                                  capture_output=True, text=True, check=True).stdout
            runs[side].append(json.loads(line.strip().splitlines()[-1]))
    print("| method | old tok/s (median) | new tok/s | new / old | same tokens |\n|---|---|---|---|---|")
    same = len({r["tokens"] for r in runs["old"] + runs["new"]}) == 1
    for method, _ in METHODS:
        old = statistics.median(r["tok_s"][method] for r in runs["old"])
        new = statistics.median(r["tok_s"][method] for r in runs["new"])
        print(f"| {method} | {old:.1f} | {new:.1f} | {new / old:.2f} | {same} |")


if __name__ == "__main__":
    main()
