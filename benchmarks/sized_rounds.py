"""Draft-free rounds sized from the pass curve (runtime/budget.py) against the fixed rules, on a real build:
suffix decoding with the α·m cut alone and cut by c(M) too, prompt lookup at γ 4 and at "auto"; the
configurations interleaved per prompt and round, every output checked against vanilla's.

    python benchmarks/sized_rounds.py engines/qwen --precision gguf --threads 2 --rounds 2 \\
        --prompts benchmarks/workloads/code_edit.jsonl --chat

The curve is measured here first (report/timing.py's _pass_curve: what `specexport bench` stores with the
build), printed with the CPU. Suffix reads the request's own text only (suffix_share=False), so no
configuration learns from another's outputs. Per configuration: median decode tok/s over the runs, tokens
per target pass, rows per pass, and the ratio to vanilla's median.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

CONFIGS = (("vanilla", {}, False), ("suffix α·m", {"method": "suffix"}, False),
           ("suffix sized", {"method": "suffix"}, True), ("lookup γ 4", {"method": "lookup", "gamma": 4}, False),
           ("lookup γ 8", {"method": "lookup", "gamma": 8}, False),
           ("lookup auto", {"method": "lookup", "gamma": "auto"}, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS), help="a subset, comma-separated")
    args = ap.parse_args()
    configs = [c for c in CONFIGS if c[0] in args.configs.split(",") or c[0] == "vanilla"]

    import specexport
    from specexport.prompts import read_prompts
    from specexport.report.timing import pass_curve
    from specexport.runtime.budget import relative_costs

    cpu = re.search(r"^model name\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    prompts = read_prompts(args.prompts)
    threads = {} if args.threads is None else {"threads": args.threads}
    with specexport.load(args.build, precision=args.precision, **threads) as pipe:
        curve = pass_curve(pipe, time.perf_counter)
        costs = relative_costs(curve, pipe.max_verify_tokens)
        print(f"CPU: {cpu.group(1).strip() if cpu else 'unknown'}; threads {args.threads}; pass curve "
              + ", ".join(f"c({m}) {t * 1e3:.1f} ms ({t / curve[1]:.2f}x)" for m, t in curve.items()))
        ids = [pipe.chat_ids(p) if args.chat else pipe.tokenizer.encode(p) for p in prompts]
        tps = {name: [] for name, _, _ in configs}
        per_pass = {name: [0, 0, 0] for name, _, _ in configs}      # tokens, passes, rows
        unequal = 0
        for r in range(args.rounds):
            for i, p in enumerate(ids):
                order = configs[(i + r) % len(configs):] + configs[:(i + r) % len(configs)]
                outs = {}
                for name, options, sized in order:
                    pipe._verify_costs = costs if sized else None          # what verify_costs() returns
                    out = pipe.generate(prompt_ids=p, max_new_tokens=args.max_new_tokens, suffix_share=False,
                                        **{"method": "vanilla", **options})
                    s = out.stats
                    tps[name].append(s.delivered / (s.total_s - s.ttft_s))
                    per_pass[name][0] += s.emitted
                    per_pass[name][1] += s.target_passes
                    per_pass[name][2] += sum(k + 1 for k, _ in s.rounds)
                    outs[name] = out.token_ids
                unequal += sum(v != outs["vanilla"] for v in outs.values())
        base = statistics.median(tps["vanilla"])
        print(f"| configuration | tok/s (median of {len(tps['vanilla'])}) | vs vanilla | tokens / pass | rows / pass |")
        print("|---|---|---|---|---|")
        for name, _, _ in configs:
            med = statistics.median(tps[name])
            tok, passes, rows = per_pass[name]
            print(f"| {name} | {med:.1f} | {med / base:.2f}x | {tok / passes:.2f} | {rows / passes:.2f} |")
        print(f"outputs unequal to vanilla: {unequal}")


if __name__ == "__main__":
    main()
