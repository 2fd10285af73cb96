"""A workload through `specexport serve`: its requests in order, each sent once per method (vanilla,
lookup, suffix; the order rotated per request), greedy, with the official openai client, to one server
whose suffix cache sees only the suffix requests' answers (the others send `suffix_cache: false`, so no
method is answered from another method's copy of the same request).

Reports per method the decode tokens/s summed over the workload (the server's own `specexport` field:
tokens after the first over decode time), tokens per target pass, and whether every answer equals
vanilla's; the suffix cache's size and hit rate at the end.

    python benchmarks/serve_workload.py BUILD benchmarks/workloads/repeated.jsonl --precision gguf \
        --max-tokens 256 [--rounds 1] [--chat]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("vanilla", "lookup", "suffix")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("workload")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1, help="replays of the whole workload (the cache keeps growing)")
    ap.add_argument("--gamma", type=int, default=4, help="prompt lookup's γ")
    args = ap.parse_args()

    import openai
    import uvicorn

    import specexport
    from specexport.report.workload import conversation_turn, read_workload
    from specexport.serve.app import create_app

    pipe = specexport.load(args.build, precision=args.precision)
    app = create_app(pipe, method="vanilla")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=3600)

    def ask(messages_text: str, method: str):
        extra = {"method": method, "gamma": args.gamma, "suffix_cache": method == "suffix"}
        r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": messages_text}],
                                           max_tokens=args.max_tokens, temperature=0, extra_body=extra)
        return r.choices[0].message.content, r.model_extra["specexport"], r.usage.completion_tokens

    totals = {m: {"tokens": 0, "seconds": 0.0, "passes": 0, "equal": 0, "n": 0} for m in METHODS}
    per_request = []
    k = 0
    for _ in range(args.rounds):
        for item in read_workload(Path(args.workload)):
            turns = (item,) if isinstance(item, str) else item
            answers = []
            for _ in range(len(turns)):
                text = conversation_turn(turns, answers)
                order = METHODS[k % 3:] + METHODS[:k % 3]
                k += 1
                got = {m: ask(text, m) for m in order}
                answers.append(got["vanilla"][0])
                row = {}
                for m, (answer, meta, n) in got.items():
                    tot = totals[m]
                    if meta["tokens_per_second"] and n > 1:       # decode time: tokens after the first
                        tot["tokens"] += n - 1
                        tot["seconds"] += (n - 1) / meta["tokens_per_second"]
                        tot["passes"] += meta["target_passes"]
                    tot["equal"] += answer == got["vanilla"][0]
                    tot["n"] += 1
                    row[m] = meta["tokens_per_second"]
                per_request.append(row)
    server.should_exit = True
    base = totals["vanilla"]["tokens"] / totals["vanilla"]["seconds"]
    lookup = totals["lookup"]["tokens"] / totals["lookup"]["seconds"]
    print(f"{args.workload}: {totals['vanilla']['n']} requests x {len(METHODS)} methods, greedy, "
          f"max_tokens {args.max_tokens}, {args.build} ({args.precision})")
    print("| method | tok/s | vs vanilla | vs lookup | tokens/pass | median per-request speedup | answers = vanilla |")
    print("|---|---|---|---|---|---|---|")
    for m, tot in totals.items():
        tps = tot["tokens"] / tot["seconds"]
        ratios = [r[m] / r["vanilla"] for r in per_request if r[m] and r["vanilla"]]
        print(f"| {m} | {tps:.1f} | {tps / base:.2f}x | {tps / lookup:.2f}x | "
              f"{tot['tokens'] / max(tot['passes'], 1):.2f} | {statistics.median(ratios):.2f}x | "
              f"{tot['equal']}/{tot['n']} |")
    print(f"suffix cache: {pipe.suffix_cache.stats()}")


if __name__ == "__main__":
    main()
