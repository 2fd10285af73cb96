"""The draft's threads and the pools' spinning, on a build with a draft model: one process per setting
(ONNX Runtime's pools are per process), settings interleaved over rounds, vanilla timed in each process
so a ratio compares like with like on a noisy machine.

    python benchmarks/draft_threads.py engines/qwen --precision gguf --prompts examples/qwen/prompts.jsonl \
        --chat --rounds 2

Settings: `one` (the draft on one thread; spinning pools), `two-spin` (the draft on the target's threads,
pools spinning on after each run), `two-stop` (the same, pools stopped at each run's end: what
specexport.load does where a build has a draft).
"""
import argparse
import json
import subprocess
import sys

SETTINGS = {"one": {"draft_threads": 1, "stop_spin": False}, "two-spin": {"stop_spin": False},
            "two-stop": {"stop_spin": True}}


def child(args) -> None:
    import specexport

    kw = SETTINGS[args.setting]
    pipe = specexport.load(args.build, precision=args.precision, threads=args.threads, **kw)
    prompts = [json.loads(line) for line in open(args.prompts)][:args.n_prompts]
    ids = [pipe.chat_ids(p) if args.chat else pipe.encode(p) for p in prompts]
    pipe.generate(prompt_ids=ids[0], max_new_tokens=8, method="draft")               # warm-up
    out = {}
    for method, gamma in [("vanilla", None)] + [("draft", g) for g in args.gammas]:
        tokens = seconds = 0.0
        for i in ids:
            o = pipe.generate(prompt_ids=i, max_new_tokens=args.max_new_tokens, method=method, gamma=gamma)
            tokens, seconds = tokens + len(o.token_ids), seconds + o.stats.total_s
        out[f"{method}{gamma or ''}"] = tokens / seconds
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gammas", type=lambda s: [int(g) for g in s.split(",")], default=[2, 3])
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--setting", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.setting:
        return child(args)
    ratios: dict = {}
    for r in range(args.rounds):
        for name in SETTINGS:
            res = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--setting", name], capture_output=True,
                                 text=True, check=True)
            speeds = json.loads(res.stdout.strip().splitlines()[-1])
            line = ", ".join(f"{k} {v:.1f}" for k, v in speeds.items())
            print(f"round {r + 1} {name:9s} tok/s: {line}", flush=True)
            for k, v in speeds.items():
                if k != "vanilla":
                    ratios.setdefault((name, k), []).append(v / speeds["vanilla"])
    print("over vanilla in the same process (each round):")
    for (name, k), v in ratios.items():
        print(f"  {name:9s} {k}: {' '.join(f'{x:.2f}' for x in v)}")


if __name__ == "__main__":
    main()
