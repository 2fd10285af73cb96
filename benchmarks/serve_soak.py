"""Soak and fuzz `specexport serve` (issue: the server as vLLM's and llama-server's users expect it).

    python benchmarks/serve_soak.py BUILD [--requests 2000] [--clients 16] [--seed 0] [--fuzz 3000]

Starts `specexport serve BUILD` on a free loopback port (with an API key, so every request carries
one) and, in this order:

  --fuzz N      schemathesis against the server's own OpenAPI schema (/openapi.json): about N generated
                requests, schema-conforming and schema-violating, spread over the operations; checks:
                no 5xx, status codes, content types and bodies as documented. Bounded by --fuzz-seconds.
  --requests N  the soak: N requests from --clients concurrent clients, a seeded mix of greedy and seeded
                sampled completions (the openai client, plain and streamed, chat streamed when the build
                has a chat template, methods vanilla/draft/lookup when built), clients that disconnect
                mid-stream or before the answer, malformed bodies (not UTF-8, not JSON, wrong types,
                refused parameters), prompts longer than max_seq_len, bodies over --max-body-bytes.
                Every answered valid request must equal `Pipeline.generate` on the same build (a second
                Pipeline in this process), every refusal must be the expected status in OpenAI's error
                shape, the server must never answer 500 (its own /metrics count is read at the end too),
                and its RSS must not grow more than 10% from the 200th request to the last.

then SIGTERMs the server and checks that it exits 0. Prints the figures; exits 1 when a check failed.
Only loopback is ever contacted; request counts and times are bounded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

PROMPTS = ["def fib(n):", "import json\n", "class Stack:\n    def push(self, x):", "for i in range(10):",
           "# sort a list\n", "return self.", "x = [", "while True:", "def parse(text: str) -> dict:\n",
           "with open(path) as f:\n", "try:\n    import numpy as np\nexcept ImportError:", "if __name__ == '__main__':"]
CHAT = [[{"role": "user", "content": "write a loop"}],
        [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "sort a list"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]]
TOKENS = (1, 4, 8, 16, 32, 48)
KEY = "sk-soak-0123456789"
MALFORMED = [
    (b'{"prompt": "\xff\xfe bad bytes", "max_tokens": 4}', "not valid UTF-8"),
    (b'{"prompt": "x", "max_tokens": 4', "not valid JSON"),
    (b'{"prompt": "x",, }', "not valid JSON"),
    (b"[]", "must be a JSON object"),
    (b"", "empty"),
    (b"[" * 50_000, "not valid JSON"),
    (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "n": 2}).encode(), "n:"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"prompt": "x", "method": "nope"}).encode(), "method"),
    (json.dumps({"prompt": "x", "seed": -5}).encode(), "seed"),
    (json.dumps({"prompt": [1, 2, 10 ** 9]}).encode(), "prompt"),
    (json.dumps({"max_tokens": 3}).encode(), "prompt"),
]


# ------------------------------------------------------------------ the server

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class ServerProcess:
    """`specexport serve` in a subprocess on loopback, with an API key from the environment."""

    def __init__(self, build, *, api_key: str | None = KEY, extra: list[str] = (), ready_s: float = 120):
        self.port, self.api_key = free_port(), api_key
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SPECEXPORT_API_KEY", None)
        if api_key:
            env["SPECEXPORT_API_KEY"] = api_key
        self.proc = subprocess.Popen([sys.executable, "-m", "specexport", "serve", str(build), "--port", str(self.port),
                                      "--log-level", "warning", *extra], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + ready_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("specexport serve did not come up:\n" + "".join(self.lines))
            time.sleep(0.1)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def terminate(self, timeout: float = 60) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds to exit)."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return code, time.monotonic() - start


def server_counts(url: str, headers: dict) -> dict[str, float]:
    """specexport_requests_total summed by status, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "specexport_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    status = sample.labels["status"]
                    counts[status] = counts.get(status, 0) + sample.value
    return counts


# ------------------------------------------------------------------ the soak

def make_plan(n: int, seed: int, *, methods: list[str], chat: bool, capacity: int, vocab: int,
              max_body_bytes: int) -> list[dict]:
    """n seeded requests: dicts with kind and what to send."""
    rng = random.Random(seed)
    kinds = {"greedy": 30, "greedy_stream": 20, "chat_stream": 10 if chat else 0, "sampled": 8,
             "disconnect_stream": 8, "disconnect_wait": 6, "malformed": 10, "oversized_prompt": 6, "oversized_body": 2}
    names, weights = zip(*((k, w) for k, w in kinds.items() if w))
    plan = []
    for i in range(n):
        kind = rng.choices(names, weights)[0]
        item = {"i": i, "kind": kind, "method": rng.choice(methods), "max_tokens": rng.choice(TOKENS),
                "prompt": rng.choice(PROMPTS)}
        if kind == "chat_stream":
            item["messages"] = rng.choice(CHAT)
        elif kind == "sampled":
            item.update(seed=rng.randrange(1000), temperature=rng.choice((0.7, 1.0)), stream=rng.random() < 0.5)
        elif kind == "disconnect_wait":
            item["after_s"] = rng.choice((0.001, 0.005, 0.02, 0.05))
        elif kind == "malformed":
            item["body"], item["says"] = MALFORMED[rng.randrange(len(MALFORMED))]
        elif kind == "oversized_prompt":
            item["ids"] = rng.random() < 0.5
            item["length"] = capacity + rng.randrange(1, 64)
        elif kind == "oversized_body":
            item["size"] = max_body_bytes + rng.randrange(1, 2 ** 20)
        plan.append(item)
    return plan


def _key(item: dict) -> tuple:
    what = json.dumps(item["messages"]) if item["kind"] == "chat_stream" else item["prompt"]
    return (what, item["method"], item["max_tokens"], item.get("seed"), item.get("temperature", 0.0))


def expectations(plan: list[dict], reference, chat_ids) -> dict:
    """What Pipeline.generate answers for every valid request of the plan (by _key)."""
    want = {}
    for item in plan:
        if item["kind"] not in ("greedy", "greedy_stream", "chat_stream", "sampled"):
            continue
        key = _key(item)
        if key in want:
            continue
        options = {"max_new_tokens": item["max_tokens"], "method": item["method"],
                   "temperature": item.get("temperature", 0.0), "seed": item.get("seed")}
        if item["kind"] == "chat_stream":
            out = reference.generate(prompt_ids=chat_ids(item["messages"]), **options)
        else:
            out = reference.generate(item["prompt"], **options)
        want[key] = (out.text, out.finish_reason, len(out.token_ids))
    return want


def run_one(item: dict, url: str, headers: dict, model: str, want: dict, client: openai.OpenAI,
            http: httpx.Client) -> dict:
    """Send one planned request; {"outcome": ok | mismatch | unexpected | disconnected | ..., "status", "s"}."""
    kind, start = item["kind"], time.monotonic()
    extra = {"method": item["method"]}
    result = {"kind": kind, "outcome": "ok", "status": 200}
    try:
        if kind in ("greedy", "sampled") and not item.get("stream"):
            r = client.completions.create(model=model, prompt=item["prompt"], max_tokens=item["max_tokens"],
                                          temperature=item.get("temperature", 0), seed=item.get("seed"), extra_body=extra)
            got = (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens)
            if got != want[_key(item)]:
                result.update(outcome="mismatch", detail=f"{got!r} != {want[_key(item)]!r}")
        elif kind in ("greedy_stream", "sampled"):
            text, finish = "", None
            for chunk in client.completions.create(model=model, prompt=item["prompt"], max_tokens=item["max_tokens"],
                                                   temperature=item.get("temperature", 0), seed=item.get("seed"),
                                                   stream=True, extra_body=extra):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if (text, finish) != want[_key(item)][:2]:
                result.update(outcome="mismatch", detail=f"{(text, finish)!r} != {want[_key(item)][:2]!r}")
        elif kind == "chat_stream":
            text, finish, usage = "", None, None
            for chunk in client.chat.completions.create(model=model, messages=item["messages"], temperature=0,
                                                        max_tokens=item["max_tokens"], stream=True, extra_body=extra,
                                                        stream_options={"include_usage": True}):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            if (text, finish, usage) != want[_key(item)]:
                result.update(outcome="mismatch", detail=f"{(text, finish, usage)!r} != {want[_key(item)]!r}")
        elif kind == "disconnect_stream":
            stream = client.completions.create(model=model, prompt=item["prompt"], max_tokens=48, temperature=0,
                                               stream=True, extra_body=extra)
            next(iter(stream), None)
            stream.close()
            result["outcome"] = "disconnected"
        elif kind == "disconnect_wait":
            try:
                http.post(f"{url}/v1/completions", headers=headers, timeout=item["after_s"],
                          json={"prompt": item["prompt"], "max_tokens": 48, "temperature": 0, **extra})
                result["outcome"] = "answered before the disconnect"
            except httpx.TimeoutException:
                result["outcome"] = "disconnected"
        elif kind == "malformed":
            r = http.post(f"{url}/v1/completions", content=item["body"],
                          headers={**headers, "content-type": "application/json"}, timeout=60)
            result["status"] = r.status_code
            error = _error_of(r)
            if r.status_code != 400 or error is None or item["says"] not in error["message"]:
                result.update(outcome="unexpected", detail=f"{r.status_code} {r.text[:200]}")
        elif kind == "oversized_prompt":
            prompt = [7] * item["length"] if item["ids"] else "x " * item["length"]
            try:
                client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
                result.update(outcome="unexpected", detail="answered")
            except openai.BadRequestError as err:
                result["status"] = 400
                if (err.body or {}).get("code") != "context_length_exceeded":
                    result.update(outcome="unexpected", detail=str(err.body))
        elif kind == "oversized_body":
            body = json.dumps({"prompt": "y" * item["size"], "max_tokens": 4}).encode()
            r = http.post(f"{url}/v1/completions", content=body, headers={**headers, "content-type": "application/json"},
                          timeout=60)
            result["status"] = r.status_code
            error = _error_of(r)
            if r.status_code != 413 or error is None or error.get("code") != "request_too_large":
                result.update(outcome="unexpected", detail=f"{r.status_code} {r.text[:200]}")
    except openai.APIStatusError as err:
        result.update(outcome="unexpected", status=err.status_code, detail=str(err)[:300])
    except (openai.APIError, httpx.HTTPError) as err:
        result.update(outcome="unexpected", status=None, detail=f"{type(err).__name__}: {err}"[:300])
    result["s"] = time.monotonic() - start
    return result


def _error_of(r: httpx.Response) -> dict | None:
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error if isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} else None


def soak(url: str, reference, *, requests: int, clients: int, seed: int = 0, pid: int | None = None,
         api_key: str | None = None, model: str, methods: list[str] | None = None, chat: bool = False,
         max_body_bytes: int = 4 * 2 ** 20, rss_mark: int = 200, log=None) -> dict:
    """Run the soak against a server already up at `url`; the figures as a dict."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    methods = methods or ["vanilla", *(m for m in ("draft", "lookup") if m in reference.methods)]
    vocab = reference.manifest["models"]["target"]["vocab_size"]
    plan = make_plan(requests, seed, methods=methods, chat=chat, capacity=reference.capacity, vocab=vocab,
                     max_body_bytes=max_body_bytes)

    def chat_ids(messages):
        from specexport.chat import load_chat_template

        template = load_chat_template(reference.dir / reference.manifest["tokenizer"]["dir"])
        return reference.tokenizer.encode(template.render(messages), add_special_tokens=False).ids

    t0 = time.monotonic()
    want = expectations(plan, reference, chat_ids)
    expect_s = time.monotonic() - t0
    results: list[dict] = []
    lock, rss = threading.Lock(), {}
    done = [0]
    next_item = iter(plan)

    def client_loop(k: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "unused", max_retries=0, timeout=120)
        with httpx.Client() as http:
            while True:
                with lock:
                    item = next(next_item, None)
                if item is None:
                    return
                result = run_one(item, url, headers, model, want, client, http)
                with lock:
                    results.append(result)
                    done[0] += 1
                    if done[0] == rss_mark and pid is not None:
                        rss["mark"] = rss_bytes(pid)
                    if log and done[0] % 250 == 0:
                        log(f"  {done[0]} requests, {time.monotonic() - start:.0f} s")

    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            peak[0] = max(peak[0], rss_bytes(pid))

    if pid is not None:
        rss["start"] = rss_bytes(pid)
        threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    wall = time.monotonic() - start
    idle_deadline = time.monotonic() + 30                # the cancelled requests leave the model
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["pending"] == 0 or time.monotonic() > idle_deadline:
            break
        time.sleep(0.05)
    stop.set()
    if pid is not None:
        rss["end"] = rss_bytes(pid)
        peak[0] = max(peak[0], rss["end"])
    server = server_counts(url, headers)

    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[f"{r['kind']}: {r['outcome']}"] = outcomes.get(f"{r['kind']}: {r['outcome']}", 0) + 1
    valid = sorted(r["s"] for r in results if r["kind"] in ("greedy", "greedy_stream", "chat_stream", "sampled")
                   and r["outcome"] == "ok")
    report = {
        "requests": len(results), "clients": clients, "seed": seed, "wall_s": round(wall, 1),
        "requests_per_s": round(len(results) / wall, 1), "expectations_s": round(expect_s, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "mismatches": [r for r in results if r["outcome"] == "mismatch"],
        "unexpected": [r for r in results if r["outcome"] == "unexpected"],
        "client_500s": sum(1 for r in results if r.get("status") == 500),
        "server_statuses": dict(sorted(server.items())),
        "server_500s": int(server.get("500", 0)),
        "pending_after": health["pending"],
        "latency_p50_s": round(statistics.median(valid), 4) if valid else None,
        "latency_p95_s": round(valid[max(0, int(0.95 * len(valid)) - 1)], 4) if valid else None,
    }
    if pid is not None:
        mark = rss.get("mark", rss["start"])
        report.update(rss_start_mib=round(rss["start"] / 2 ** 20, 1), rss_mark_request=rss_mark,
                      rss_mark_mib=round(mark / 2 ** 20, 1), rss_end_mib=round(rss["end"] / 2 ** 20, 1),
                      rss_peak_mib=round(peak[0] / 2 ** 20, 1),
                      rss_growth_pct=round(100 * (rss["end"] - mark) / mark, 2))
    report["ok"] = bool(not report["mismatches"] and not report["unexpected"] and not report["client_500s"]
                        and not report["server_500s"] and report["pending_after"] == 0
                        and report.get("rss_growth_pct", 0) < 10)
    return report


# ------------------------------------------------------------------ the fuzz

def fuzz(url: str, *, examples: int, seed: int = 0, api_key: str | None = None, max_seconds: float = 600,
         log=None) -> dict:
    """schemathesis over the server's OpenAPI schema: about `examples` requests in all (positive and
    negative data), checked for 5xx and for conformance to the documented statuses, types and bodies."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers, timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    gets = [op for op in operations if op.method.upper() != "POST"]
    per_get = 5                                   # no parameters: hypothesis runs out of distinct cases at once
    per_post = max(1, (examples - 2 * per_get * len(gets)) // (2 * max(1, len(posts))))
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    statuses: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    refusals: dict[str, int] = {}                    # 4xx by status and what the message names first
    sent = [0]
    stop_at = time.monotonic() + max_seconds
    start = time.monotonic()
    session = __import__("requests").Session()

    def run(op, mode, n: int) -> None:
        """Up to n generated requests for one operation in one generation mode."""
        label = f"{op.method.upper()} {op.path} ({mode.value})"

        @hypothesis_seed(seed)
        @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case):
            if time.monotonic() > stop_at:
                return
            response = case.call(base_url=url, session=session, headers=headers, timeout=120)
            sent[0] += 1
            by = statuses.setdefault(label, {})
            by[str(response.status_code)] = by.get(str(response.status_code), 0) + 1
            if 400 <= response.status_code < 500:
                try:
                    message = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = "(not OpenAI's error shape)"
                what = f"{response.status_code} {message.split(':')[0][:40]}"
                refusals[what] = refusals.get(what, 0) + 1
            try:
                case.validate_response(response, checks=checks, headers=headers)
            except Exception as err:            # noqa: BLE001  a failed check: recorded, the run goes on
                failures.append(f"{label} -> {response.status_code}: {str(err).strip().splitlines()[0][:200]}\n"
                                f"    {case.as_curl_command(headers=headers)[:400]}")

        try:
            one()
        except Unsatisfiable:                   # no parameters: no schema-violating request exists
            pass
        if log:
            log(f"  {label}: {sum(statuses.get(label, {}).values())} requests")

    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            run(op, mode, per_post if op in posts else per_get)
    all_statuses: dict[str, int] = {}
    for by in statuses.values():
        for status, count in by.items():
            all_statuses[status] = all_statuses.get(status, 0) + count
    alive = httpx.get(f"{url}/health", timeout=10).status_code == 200
    report = {"requests": sent[0], "seconds": round(time.monotonic() - start, 1),
              "statuses": dict(sorted(all_statuses.items())), "by_operation": statuses,
              "refusals": dict(sorted(refusals.items(), key=lambda kv: -kv[1])),
              "server_errors": sum(c for s, c in all_statuses.items() if s.startswith("5")),
              "failures": failures, "alive_after": alive}
    report["ok"] = bool(alive and not report["server_errors"] and not failures)
    return report


# ------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", help="a build output folder (e.g. engines/demo)")
    parser.add_argument("--requests", type=int, default=2000, help="soak requests (0: no soak)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuzz", type=int, default=0, help="about this many schemathesis requests first (0: none)")
    parser.add_argument("--fuzz-seconds", type=float, default=900, help="stop fuzzing after this long")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 2 ** 20)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    import specexport
    from specexport.chat import load_chat_template

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    server = ServerProcess(args.build, extra=["--max-body-bytes", str(args.max_body_bytes)])
    figures: dict = {"build": str(Path(args.build).resolve()), "server": server.lines[:1]}
    ok = True
    try:
        model = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["id"]
        if args.fuzz:
            log(f"fuzz: about {args.fuzz} requests")
            figures["fuzz"] = fuzz(server.url, examples=args.fuzz, seed=args.seed, api_key=server.api_key,
                                   max_seconds=args.fuzz_seconds, log=log)
            ok &= figures["fuzz"]["ok"]
        if args.requests:
            log(f"soak: {args.requests} requests from {args.clients} clients")
            with specexport.load(args.build) as reference:
                chat = load_chat_template(reference.dir / reference.manifest["tokenizer"]["dir"]) is not None
                figures["soak"] = soak(server.url, reference, requests=args.requests, clients=args.clients,
                                       seed=args.seed, pid=server.proc.pid, api_key=server.api_key, model=model,
                                       chat=chat, max_body_bytes=args.max_body_bytes, log=log)
            ok &= figures["soak"]["ok"]
    finally:
        code, seconds = server.terminate()
        figures["shutdown"] = {"exit_code": code, "seconds": round(seconds, 2)}
        ok &= code == 0
    figures["ok"] = bool(ok)
    print(json.dumps(figures, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
