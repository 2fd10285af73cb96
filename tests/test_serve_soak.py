"""The soak of benchmarks/serve_soak.py, shortened: 200 requests from 8 concurrent clients against
`specexport serve` in a subprocess (with a key from the environment), a seeded mix of greedy and
seeded sampled completions through the openai client (plain, streamed, chat streamed; methods vanilla,
draft, lookup), clients that disconnect mid-stream or before the answer, malformed bodies, prompts
longer than max_seq_len and bodies over the limit. Every answer must equal `Pipeline.generate`, every
refusal be the expected status in OpenAI's error shape, no 500 (client side or in the server's own
/metrics), the model free at the end, RSS growth under 10% from the 100th request to the last, and
SIGTERM must end the server with status 0. The full run (2,000 requests, 16 clients) is the benchmark.
"""
from __future__ import annotations

import pytest
from test_serve_limits import load_soak_module, with_chat_template

import specexport


@pytest.fixture(scope="module")
def soak_build(built_llama, tmp_path_factory):
    return with_chat_template(built_llama, tmp_path_factory.mktemp("serve-soak") / "build")


def test_a_short_soak(soak_build):
    soak = load_soak_module()
    server = soak.ServerProcess(soak_build, extra=["--max-body-bytes", "64KiB"])
    try:
        with specexport.load(soak_build) as reference:
            report = soak.soak(server.url, reference, requests=200, clients=8, seed=0, pid=server.proc.pid,
                               api_key=server.api_key, model="tiny-llama", chat=True, max_body_bytes=64 * 1024,
                               rss_mark=100)
    finally:
        code, _ = server.terminate(timeout=60)
    summary = {k: v for k, v in report.items() if k not in ("mismatches", "unexpected")}
    print(summary)
    assert not report["mismatches"], report["mismatches"][:3]
    assert not report["unexpected"], report["unexpected"][:3]
    assert report["client_500s"] == 0 and report["server_500s"] == 0, summary
    assert report["pending_after"] == 0, summary
    kinds = {k.split(":")[0] for k in report["outcomes"]}
    assert {"greedy", "greedy_stream", "chat_stream", "sampled", "disconnect_stream", "malformed",
            "oversized_prompt"} <= kinds, report["outcomes"]
    assert report["rss_growth_pct"] < 10, summary
    assert report["ok"], summary
    assert code == 0, f"specexport serve exited {code} on SIGTERM"
