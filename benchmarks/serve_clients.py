"""Issue 35's benchmark: the client curve. Aggregate tokens/s, per-request TPOT (p50, p90) and TTFT for
1, 2, 4, 8 concurrent clients through `specexport serve` one request at a time (--max-batch 1) and
batched (--max-batch N), next to llama-server with N parallel slots (-np N) on the same GGUF file,
plain and with its draft-model speculation, in one interleaved run.

    python benchmarks/serve_clients.py engines/qwen --llama-cpp ~/.cache/specexport/llama.cpp-0.3.36/bin \
        [--clients 1,2,4,8] [--methods vanilla,suffix] [--max-batch auto] [--requests 2] [--tokens 64]

Every server is its own process, started once; the clients are threads of this one, each streaming
`--requests` requests one after another (chat-templated code prompts as token ids, greedy). Per round,
every (clients, server, method) configuration runs once, in that order, so the machine's drift spreads
over all of them; figures are medians over rounds. TPOT is a request's (last piece - first piece) /
(tokens - 1), TTFT arrival to first piece, aggregate tokens/s all requests' tokens over the wall time.
The batched server's answers are checked against the one-at-a-time server's (greedy: equal text).
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

import specexport

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}) before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{what} did not start within {timeout:.0f} s")


class Ours:
    def __init__(self, build: str, max_batch: str, threads: int):
        self.port = free_port()
        self.name = f"specexport --max-batch {max_batch}"
        self.proc = subprocess.Popen([sys.executable, "-m", "specexport", "serve", build, "--port", str(self.port),
                                      "--method", "vanilla", "--max-batch", max_batch, "--threads", str(threads),
                                      "--max-queue", "64", "--log-level", "warning"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.banner = self.proc.stdout.readline().strip()
        wait_ready(self.proc, self.port, self.name)
        self.model = httpx.get(f"http://127.0.0.1:{self.port}/v1/models").json()["data"][0]["id"]

    def request(self, ids: list[int], method: str, tokens: int):
        body = {"model": self.model, "prompt": ids, "max_tokens": tokens, "temperature": 0, "stream": True,
                "method": method, "suffix_cache": False}
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=900) as r:
            if r.status_code != 200:
                raise SystemExit(f"{self.name}: {r.status_code} {r.read().decode()[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                text = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                yield text, (chunk.get("usage") or {}).get("completion_tokens")

    def rows(self) -> tuple[float, float]:
        """(real, padded) target rows the server's passes ran so far (/metrics)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics").text
        got = {x.labels["kind"]: x.value for f in text_string_to_metric_families(text) if f.name == "specexport_batch_rows"
               for x in f.samples if x.name.endswith("_total") and x.labels.get("model") == "target"}
        return got.get("real", 0.0), got.get("padded", 0.0)

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


class LlamaServer:
    def __init__(self, binary: Path, target: str, slots: int, threads: int, ctx: int, draft: str | None = None,
                 n_max: int = 3):
        self.port = free_port()
        self.name = f"llama-server -np {slots}" + (f" + draft (n-max {n_max})" if draft else "")
        cmd = [str(binary), "-m", target, "--port", str(self.port), "-np", str(slots), "-c", str(ctx * slots),
               "-t", str(threads), "-tb", str(threads), "--no-webui", "--temp", "0"]
        if draft:
            cmd += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max), "-td", str(threads)]
        self.log = open(f"/tmp/llama-server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_ready(self.proc, self.port, self.name)

    def request(self, ids: list[int], method: str, tokens: int):
        body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/completion", json=body, timeout=900) as r:
            if r.status_code != 200:
                raise SystemExit(f"{self.name}: {r.status_code} {r.read().decode()[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                yield chunk.get("content", ""), chunk.get("tokens_predicted") if chunk.get("stop") else None

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def one(server, ids, method, tokens) -> dict:
    start = time.perf_counter()
    first = last = None
    text, count, pieces = "", None, 0
    for piece, n in server.request(ids, method, tokens):
        if piece:
            now = time.perf_counter()
            first = first if first is not None else now
            last, pieces = now, pieces + 1
            text += piece
        count = n if n is not None else count
    count = count or pieces
    tpot = (last - first) / (count - 1) if first is not None and count > 1 else float("nan")
    return {"ttft": (first or time.perf_counter()) - start, "tpot": tpot, "tokens": count, "text": text}


def run_clients(server, prompts, method, clients, per_client, tokens) -> dict:
    def client(k):
        return [one(server, prompts[(k * per_client + j) % len(prompts)], method, tokens) for j in range(per_client)]

    before = server.rows() if hasattr(server, "rows") else None
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    # the passes' padding: rows computed for no request (what a packed layout would save at most)
    after = server.rows() if before is not None else None
    padded = after[1] - before[1] if after else 0.0
    pad = (padded - (after[0] - before[0])) / padded if padded else float("nan")
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "results": results, "padding": pad}


def pct(values, q):
    values = sorted(v for v in values if v == v)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="folder with llama-server (skipped without it)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--methods", default="vanilla,suffix")
    ap.add_argument("--max-batch", default="auto", help="the batched server's --max-batch")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=Path, default=ROOT / "examples" / "qwen" / "prompts.jsonl")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    methods = args.methods.split(",")
    with specexport.load(args.build, precision="gguf", threads=1) as pipe:
        texts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
        prompts = [pipe.chat_ids(t if isinstance(t, str) else t["prompt"]) for t in texts]
        models = pipe.manifest["models"]
        target, draft = models["target"].get("gguf"), models.get("draft", {}).get("gguf")
        capacity = pipe.capacity
    servers = [Ours(args.build, "1", args.threads), Ours(args.build, args.max_batch, args.threads)]
    for s in servers:
        print(f"{s.name}: {s.banner}", flush=True)
    peers = []
    if args.llama_cpp is not None and target:
        binary = args.llama_cpp / "llama-server"
        peers.append(LlamaServer(binary, target, max(levels), args.threads, capacity))
        if draft:
            peers.append(LlamaServer(binary, target, max(levels), args.threads, capacity, draft=draft))
    configs = [(s, m) for s in servers for m in methods] + [(p, "vanilla") for p in peers]
    rows: dict = {}
    try:
        for s, m in configs:                                    # warm every path once
            run_clients(s, prompts, m, 1, 1, 8)
        for _ in range(args.rounds):
            for c in levels:
                for s, m in configs:
                    rows.setdefault((c, s.name, m), []).append(run_clients(s, prompts, m, c, args.requests,
                                                                           args.tokens))
                    r = rows[(c, s.name, m)][-1]
                    print(f"  {c} clients, {s.name}, {m}: {r['tok_s']:.1f} tok/s", flush=True)
    finally:
        for s in servers + peers:
            s.close()
    print(f"\n{args.build}: greedy, {args.tokens} tokens, {args.requests} requests per client, {args.rounds} "
          f"round(s), {args.threads} threads")
    print("clients  server                                   method   tok/s  vs batch-1  TPOT p50/p90 ms  TTFT p50 ms"
          "  padding")
    mismatches = 0
    for c in levels:
        for s, m in configs:
            runs = rows[(c, s.name, m)]
            res = [r for run in runs for r in run["results"]]
            tok_s = statistics.median(run["tok_s"] for run in runs)
            base = statistics.median(run["tok_s"] for run in rows[(c, servers[0].name, m if m in methods else
                                                                   "vanilla")])
            if s is servers[1]:
                ref = [r["text"] for run in rows[(c, servers[0].name, m)] for r in run["results"]]
                mismatches += sum(a != b["text"] for a, b in zip(ref, res))
            print(f"{c:>7}  {s.name:<40} {m:<8} {tok_s:6.1f}  {tok_s / base:9.2f}x  {pct([r['tpot'] for r in res], .5) * 1e3:6.0f}"
                  f" / {pct([r['tpot'] for r in res], .9) * 1e3:5.0f}  {pct([r['ttft'] for r in res], .5) * 1e3:10.0f}"
                  f"  {statistics.median(run['padding'] for run in runs):7.2f}")
    print(f"batched answers differing from the one-at-a-time server's: {mismatches}")


if __name__ == "__main__":
    main()
