"""`specexport serve`: a real server on loopback (uvicorn in a thread, and once as the CLI in a
subprocess), driven by the official `openai` client.

Greedy answers must equal `Pipeline.generate` token for token (a second Pipeline on the same build
computes the expectations), streamed text must equal the unstreamed text, bad requests get 400s in
OpenAI's error shape and the server stays up, a client that disconnects mid-stream frees the model,
and 16 concurrent clients x 5 requests all get complete, correct answers.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import uvicorn

import specexport
from specexport.errors import SpecexportError
from specexport.serve.app import create_app

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["def fib(n):", "import json\n", "class Stack:\n    def push(self, x):", "for i in range(10):",
           "# sort a list\n", "return self.", "x = [", "while True:"]


class Server:
    """uvicorn on an ephemeral loopback port, in a daemon thread."""

    def __init__(self, app):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def chat_build(tmp_path_factory, tiny_checkpoints, write_yaml, run_build):
    """The tiny llama target + draft, built from a checkpoint whose tokenizer has a chat template."""
    root = tmp_path_factory.mktemp("serve")
    ckpt = root / "target"
    shutil.copytree(tiny_checkpoints["llama"], ckpt)
    (ckpt / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = json.loads((ckpt / "tokenizer_config.json").read_text()) if (ckpt / "tokenizer_config.json").is_file() else {}
    config["bos_token"] = "<s>"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = write_yaml(root / "serve.yaml", name="tiny-chat", target={"path": ckpt},
                     draft={"path": tiny_checkpoints["llama-draft"]}, max_seq_len=128, output=root / "out")
    assert run_build(cfg) == 0
    return root / "out"


@pytest.fixture(scope="module")
def server(chat_build):
    s = Server(create_app(specexport.load(chat_build), method="draft"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(chat_build):
    """A second Pipeline on the same build: what the server's answers must equal."""
    with specexport.load(chat_build) as pipe:
        yield pipe


def test_build_copies_the_chat_template(chat_build):
    manifest = json.loads((chat_build / "manifest.json").read_text())
    assert "chat_template.jinja" in manifest["tokenizer"]["files"]
    assert (chat_build / manifest["tokenizer"]["dir"] / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_eagle_prompts_are_encoded_at_build_time_as_the_runtime_encodes_chat_prompts(chat_build, reference, tmp_path):
    """tree: auto decodes eagle.prompts; the build must render them as Pipeline.chat_ids does."""
    from specexport.builder.plan import _prompt_ids

    texts = ["What is 2 + 2?", "Say hi"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    source = Path(json.loads((chat_build / "manifest.json").read_text())["models"]["target"]["source"])
    assert _prompt_ids(tmp_path / "p.jsonl", source) == tuple(tuple(reference.chat_ids(t)) for t in texts)


def test_models_and_health(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny-chat"]
    assert models[0].model_extra["specexport"]["default_method"] == "draft"
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["pending"] == 0


def test_greedy_completion_equals_generate(server, reference):
    for prompt in PROMPTS[:4]:
        got = server.client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=24, temperature=0)
        want = reference.generate(prompt, max_new_tokens=24, method="draft", temperature=0)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(reference.encode(prompt))
        assert got.usage.completion_tokens == len(want.token_ids)
        stats = got.model_extra["specexport"]
        assert stats["method"] == "draft" and stats["target_passes"] == want.stats.target_passes


def test_streamed_completion_equals_unstreamed(server):
    plain = server.client.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=30, temperature=0)
    chunks = list(server.client.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=30,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_uses_the_template_and_streams(server, reference):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a loop"}]
    rendered = "<s><|system|>You write Python.\n<|user|>a loop\n<|assistant|>"
    ids = reference.tokenizer.encode(rendered, add_special_tokens=False).ids
    want = reference.generate(prompt_ids=ids, max_new_tokens=20, method="lookup", temperature=0)
    got = server.client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0,
                                                extra_body={"method": "lookup"})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids)
    assert got.model_extra["specexport"]["method"] == "lookup"
    stream = server.client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20,
                                                   temperature=0, stream=True, extra_body={"method": "lookup"},
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_sampling_with_a_seed_equals_generate(server, reference):
    got = server.client.completions.create(model="tiny-chat", prompt=PROMPTS[1], max_tokens=20, temperature=0.9,
                                           top_p=0.95, seed=7, extra_body={"top_k": 20})
    want = reference.generate(PROMPTS[1], max_new_tokens=20, method="draft", temperature=0.9, top_p=0.95, top_k=20,
                              seed=7)
    assert got.choices[0].text == want.text


def test_finish_reasons_stop_and_capacity(server, reference):
    full = reference.generate(PROMPTS[0], max_new_tokens=30, method="draft", temperature=0).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    if stop.strip():
        got = server.client.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                               stop=[stop])
        assert got.choices[0].finish_reason == "stop" and stop not in got.choices[0].text
    ids = [int(t) for t in np.resize(reference.encode(PROMPTS[2]), 120)]     # 8 tokens of room in max_seq_len 128
    got = server.client.completions.create(model="tiny-chat", prompt=ids, max_tokens=100, temperature=0)
    want = reference.generate(prompt_ids=ids, max_new_tokens=100, method="draft", temperature=0)
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    if want.finish_reason == "length":
        assert got.usage.completion_tokens == 128 - 120


@pytest.mark.parametrize("kwargs, param", [
    ({"prompt": "x " * 400}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "extra_body": {"method": "eagle"}}, "method"),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ({"prompt": "x", "extra_body": {"gamma": 99}}, None),
])
def test_bad_requests_get_400_and_the_server_stays_up(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(model="tiny-chat", max_tokens=4, **kwargs)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    if param:
        assert body["param"] == param and body["message"].startswith(param)
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_unknown_model_and_malformed_bodies(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    for raw in (b"{not json", b"[]", json.dumps({"prompt": "x", "max_tokens": "many"}).encode()):
        r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    assert server.client.completions.create(model="tiny-chat", prompt="x", max_tokens=2).choices[0].text is not None


def test_chat_without_a_template_is_a_400(built_llama):
    s = Server(create_app(specexport.load(built_llama), method="vanilla"))
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            s.client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}])
    finally:
        s.stop()


def test_a_disconnected_stream_frees_the_model(chat_build):
    pipe = specexport.load(chat_build)
    forward = pipe.target.forward
    calls = []

    def slow_forward(*args, **kwargs):              # ~5 ms a pass, so 100 tokens outlast the client
        calls.append(1)
        time.sleep(0.005)
        return forward(*args, **kwargs)

    pipe.target.forward = slow_forward
    s = Server(create_app(pipe, method="vanilla"))
    try:
        with httpx.stream("POST", f"{s.url}/v1/completions",
                          json={"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "stream": True}) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
        deadline = time.monotonic() + 5
        while s.app.state.worker.pending:
            assert time.monotonic() < deadline, "the cancelled request still holds the model"
            time.sleep(0.01)
        assert len(calls) < 60, f"the decode ran on after the client left ({len(calls)} passes)"
        after = s.client.completions.create(model="tiny-chat", prompt="x", max_tokens=3, temperature=0)
        assert after.usage.completion_tokens >= 1
    finally:
        s.stop()


def test_sixteen_concurrent_clients(server, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16 * 5)]
    want = {p: reference.generate(p, max_new_tokens=32, method="draft", temperature=0).text for p in set(prompts)}

    def client(k: int) -> list[bool]:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        results = []
        for j in range(5):
            p = prompts[5 * k + j]
            if j % 2:
                text = "".join(ch.choices[0].text for ch in c.completions.create(
                    model="tiny-chat", prompt=p, max_tokens=32, temperature=0, stream=True))
            else:
                text = c.completions.create(model="tiny-chat", prompt=p, max_tokens=32, temperature=0).choices[0].text
            results.append(text == want[p])
        return results

    with ThreadPoolExecutor(16) as pool:
        results = [ok for oks in pool.map(client, range(16)) for ok in oks]
    assert len(results) == 80 and all(results)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "model": "tiny-chat", "pending": 0}


def test_the_cli_serves(chat_build):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specexport", "serve", str(chat_build), "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        banner = proc.stdout.readline()
        stored = json.loads((chat_build / "manifest.json").read_text())["method_auto"]["fp32/fp32"]["method"]
        assert f"method auto: {stored}" in banner   # what the build's quick bench measured fastest
        assert "(the build's bench measured this fastest)" in banner        # and its thread setting
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "specexport serve did not come up"
            time.sleep(0.1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        got = c.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert got.model_extra["specexport"]["method"] == stored and got.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_auto_without_a_measured_choice_serves_vanilla(built_llama):
    from specexport.runtime.methods import default_note

    with specexport.load(built_llama) as pipe:
        pipe.manifest = {k: v for k, v in pipe.manifest.items() if k != "method_auto"}
        note = default_note(pipe.view(), "auto")
        assert "decoding vanilla" in note and "specexport bench" in note, note
        out = pipe.generate(prompt_ids=[1, 5], max_new_tokens=4, method="auto")   # the request: the same rule
        assert out.method == "vanilla" and out.note in note
        with pytest.raises(SpecexportError, match="method: 'medusa' was not built"):
            default_note(pipe.view(), "medusa")
