"""Issue-4 benchmark: the demo pair, greedy, fp32, ONNX Runtime, γ = 2..6 against vanilla on the same
build, interleaved (every round runs every configuration once per prompt), medians and ratios.

    python benchmarks/bench_demo.py [--build engines/demo] [--rounds 3] [--max-new-tokens 128]
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import specexport

ap = argparse.ArgumentParser()
ap.add_argument("--build", default="engines/demo")
ap.add_argument("--prompts", default=str(Path(__file__).parents[1] / "examples/demo/prompts/code.jsonl"))
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--threads", type=int, default=None)
args = ap.parse_args()
pipe = specexport.load(args.build, threads=args.threads)
prompts = [json.loads(line) for line in open(args.prompts)][:12]
configs = [("vanilla", 0)] + [("draft", g) for g in range(2, 7)]
times = {c: [] for c in configs}                     # seconds per generated token, per (prompt, round)
acc = {c: [0, 0, 0, 0] for c in configs}            # accepted, proposed, emitted-after-first, target passes
draft_cost, target_cost = [], []
for r in range(args.rounds):
    for p in prompts:
        for c in configs:
            out = pipe.generate(p, max_new_tokens=args.max_new_tokens, method=c[0], gamma=max(c[1], 1))
            s = out.stats
            times[c].append(s.total_s / s.emitted)
            a = acc[c]
            a[0] += s.accepted; a[1] += s.proposed; a[2] += s.emitted - 1; a[3] += s.target_passes
# step costs: one T=1 target call and one T=1 draft call at a 100-token context, interleaved
for _ in range(200):
    for b, sink in ((pipe.target, target_cost), (pipe.draft, draft_cost)):
        b.reset(); b.forward(np.arange(3, 67)); b.commit(64); b.forward(np.arange(3, 39)); b.commit(36)
        t = time.perf_counter(); b.forward(np.array([5])); sink.append(time.perf_counter() - t)
base = statistics.median(times[("vanilla", 0)])
print(f"{len(prompts)} held-out prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens, greedy fp32")
print(f"step cost (T=1, ctx 100): target {statistics.median(target_cost) * 1e3:.3f} ms, draft "
      f"{statistics.median(draft_cost) * 1e3:.3f} ms, ratio {statistics.median(draft_cost) / statistics.median(target_cost):.3f}")
print("| method | γ | acceptance | tokens/target pass | ms/token (median) | speedup |")
print("|---|---|---|---|---|---|")
for c in configs:
    a = acc[c]
    med = statistics.median(times[c])
    rate = f"{a[0] / a[1]:.3f}" if a[1] else "-"
    print(f"| {c[0]} | {c[1] or '-'} | {rate} | {a[2] / a[3]:.2f} | {med * 1e3:.2f} | {base / med:.2f}x |")
