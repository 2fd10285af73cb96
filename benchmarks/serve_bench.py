"""Issue 13's benchmark: requests/s and time to first token through `specexport serve` for 1, 4 and 16
concurrent clients (greedy, 64 tokens, streamed), against in-process `pipe.generate` on the same
build, for vanilla and a speculative method.

    python benchmarks/serve_bench.py engines/demo [--method draft] [--requests 16] [--rounds 2]

The server runs as its own process (`specexport serve`), the clients are threads of this one, each
with its own openai client. Configurations are interleaved per round (in-process, then each
concurrency for each method); figures are medians over rounds of per-configuration rates, and
per-request medians of TTFT and latency. On 2 cores the clients and the server share the CPU.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

import specexport

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int) -> list[str]:
    lines = (ROOT / "examples" / "demo" / "prompts" / "code.jsonl").read_text().splitlines()
    texts = [json.loads(line) for line in lines if line.strip()]          # one JSON string per line
    texts = [t["prompt"] if isinstance(t, dict) else t for t in texts]
    return [texts[i % len(texts)] for i in range(n)]


def start_server(build: str, port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "specexport", "serve", build, "--port", str(port),
                             "--method", "vanilla", "--log-level", "warning", *extra], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def one_request(url: str, prompt: str, method: str, tokens: int) -> dict:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    start = time.perf_counter()
    first, text = None, ""
    for chunk in client.completions.create(model="demo", prompt=prompt, max_tokens=tokens, temperature=0,
                                           stream=True, extra_body={"method": method}):
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece and first is None:
            first = time.perf_counter() - start
        text += piece
    return {"ttft": first or 0.0, "latency": time.perf_counter() - start, "text": text}


def through_server(url: str, texts: list[str], method: str, clients: int, tokens: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one_request(url, p, method, tokens), texts))
    wall = time.perf_counter() - start
    return {"rps": len(texts) / wall, "ttft": [r["ttft"] for r in results],
            "latency": [r["latency"] for r in results], "texts": [r["text"] for r in results]}


def in_process(pipe, texts: list[str], method: str, tokens: int) -> dict:
    start, ttft, latency, out = time.perf_counter(), [], [], []
    for p in texts:
        t0 = time.perf_counter()
        r = pipe.generate(p, max_new_tokens=tokens, method=method, temperature=0)
        latency.append(time.perf_counter() - t0)
        ttft.append(r.stats.ttft_s)
        out.append(r.text)
    return {"rps": len(texts) / (time.perf_counter() - start), "ttft": ttft, "latency": latency, "texts": out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--method", default="draft", help="the speculative method to compare with vanilla")
    ap.add_argument("--requests", type=int, default=16, help="requests per configuration and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--server-args", default="", help="extra `specexport serve` arguments, e.g. '--spin'")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    texts = prompts(args.requests)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = ["vanilla", args.method]
    rows: dict = {}
    server = start_server(args.build, port, args.server_args.split())
    try:
        with specexport.load(args.build) as pipe:
            for m in methods:                                      # warm both paths once
                in_process(pipe, texts[:2], m, args.tokens)
                through_server(url, texts[:2], m, 1, args.tokens)
            for _ in range(args.rounds):
                for m in methods:
                    rows.setdefault(("in-process", m, 1), []).append(in_process(pipe, texts, m, args.tokens))
                    for c in levels:
                        rows.setdefault(("server", m, c), []).append(through_server(url, texts, m, c, args.tokens))
    finally:
        server.terminate()
        server.wait(timeout=30)
    reference = {m: rows[("in-process", m, 1)][0]["texts"] for m in methods}
    mismatches = sum(r["texts"] != reference[key[1]] for key, runs in rows.items() for r in runs)
    print(f"{args.build}: greedy, {args.tokens} tokens, {args.requests} requests x {args.rounds} rounds per row; "
          f"answers differing from in-process generate: {mismatches}")
    print("where       method   clients  req/s   TTFT ms (median)  latency ms (median)")
    for (where, m, c), runs in rows.items():
        rps = statistics.median(r["rps"] for r in runs)
        ttft = statistics.median(t for r in runs for t in r["ttft"]) * 1e3
        lat = statistics.median(t for r in runs for t in r["latency"]) * 1e3
        print(f"{where:<11} {m:<8} {c:>7}  {rps:6.2f}  {ttft:10.1f}  {lat:14.1f}")
    for m in methods:
        local = statistics.median(t for r in rows[("in-process", m, 1)] for t in r["latency"])
        served = statistics.median(t for r in rows[("server", m, 1)] for t in r["latency"])
        print(f"server overhead per request ({m}, 1 client): {(served - local) * 1e3:.1f} ms "
              f"({served / local:.2f}x in-process latency)")
    for c in levels:
        v = statistics.median(r["rps"] for r in rows[("server", "vanilla", c)])
        s = statistics.median(r["rps"] for r in rows[("server", args.method, c)])
        print(f"{args.method} vs vanilla through the server, {c} clients: {s / v:.2f}x requests/s")


if __name__ == "__main__":
    main()
