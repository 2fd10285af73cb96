"""`specexport serve` as vLLM's and llama-server's users expect it: the API key, the limits (body size,
queue, deadline), malformed bodies, /metrics, graceful shutdown, and schemathesis over the server's own
OpenAPI schema. Real servers on loopback (uvicorn in a thread, and the CLI in a subprocess), driven by
the official `openai` client; every error must be one response in OpenAI's shape naming what was wrong.

The build is the session's tiny llama pair (`built_llama`) copied with a chat template added.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import specexport
from specexport.serve import bind_warning, is_loopback, make_server
from specexport.serve.app import create_app
from specexport.serve.guard import Limits

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-5e3c1f"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SHAPE = {"message", "type", "param", "code"}


def load_soak_module():
    """benchmarks/serve_soak.py (the soak and fuzz drivers), imported by path."""
    spec = importlib.util.spec_from_file_location("serve_soak", ROOT / "benchmarks" / "serve_soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_chat_template(build: Path, out: Path) -> Path:
    """A copy of a build whose tokenizer has a chat template (the server reads it from the tokenizer folder)."""
    shutil.copytree(build, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / manifest["tokenizer"]["dir"] / "chat_template.jinja").write_text(TEMPLATE)
    return out


class LiveServer:
    """specexport.serve.make_server (the graceful uvicorn server) on an ephemeral loopback port, in a thread."""

    def __init__(self, app, *, api_key: str | None = None):
        self.app, self.api_key = app, api_key
        self.server = make_server(app, host="127.0.0.1", port=0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = self.openai()

    def openai(self, api_key: str | None = None, **kwargs) -> openai.OpenAI:
        kwargs = {"max_retries": 0, "timeout": 60, **kwargs}
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused", **kwargs)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def worker(self):
        return self.app.state.worker

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def slowed(pipe, seconds: float):
    """The pipeline with every target forward `seconds` slower (so requests overlap and queue)."""
    forward = pipe.target.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    pipe.target.forward = slow
    return pipe


def gated(pipe) -> threading.Event:
    """Every target forward waits for the returned event (set it to let decoding go on): a test holds the
    decode thread where it wants it instead of racing a sleep."""
    forward, gate = pipe.target.forward, threading.Event()

    def held(*args, **kwargs):
        assert gate.wait(timeout=60), "the test never opened the gate"
        return forward(*args, **kwargs)

    pipe.target.forward = held
    return gate


def wait_for(condition, what: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def metric_values(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of a Prometheus text page."""
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


@pytest.fixture(scope="module")
def build(built_llama, tmp_path_factory) -> Path:
    return with_chat_template(built_llama, tmp_path_factory.mktemp("serve-limits") / "build")


@pytest.fixture(scope="module")
def reference(build):
    with specexport.load(build) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def keyed(build):
    """The build behind a key, method draft by default."""
    s = LiveServer(create_app(specexport.load(build), method="draft", api_key=KEY), api_key=KEY)
    yield s
    s.stop()


# ------------------------------------------------------------------ the key

def test_a_key_is_required_except_on_health(keyed, reference):
    for wrong in ("sk-wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as err:
            keyed.openai(api_key=wrong).completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        assert err.value.status_code == 401
        assert set(err.value.body) == SHAPE and err.value.body["code"] == "invalid_api_key"
        assert KEY not in err.value.body["message"] and wrong not in err.value.body["message"]
        assert err.value.response.headers["www-authenticate"].startswith("Bearer")
    for headers, says in (({}, "missing API key"), ({"Authorization": f"Basic {KEY}"}, "Bearer KEY"),
                          ({"Authorization": "Bearer"}, "Bearer KEY")):
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            r = httpx.get(f"{keyed.url}{path}", headers=headers)
            assert r.status_code == 401 and says in r.json()["error"]["message"], (path, r.text)
        r = httpx.post(f"{keyed.url}/v1/completions", headers=headers, json={"prompt": "x"})
        assert r.status_code == 401 and set(r.json()["error"]) == SHAPE
    assert httpx.get(f"{keyed.url}/health").json()["status"] == "ok"           # open: probes carry no key
    assert httpx.get(f"{keyed.url}/metrics", headers=keyed.headers).status_code == 200

    client = keyed.openai()
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    want = reference.generate("def fib(n):", max_new_tokens=12, method="draft", temperature=0)
    got = client.completions.create(model="tiny-llama", prompt="def fib(n):", max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-llama", prompt="def fib(n):", max_tokens=12, temperature=0, stream=True))
    assert streamed == want.text
    messages = [{"role": "user", "content": "hi"}]
    ids = reference.tokenizer.encode("<|user|>hi\n<|assistant|>", add_special_tokens=False).ids
    chat_want = reference.generate(prompt_ids=ids, max_new_tokens=10, method="draft", temperature=0)
    chat = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert chat == chat_want.text


def test_binding_beyond_loopback_without_a_key_warns():
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example.internal")
    assert bind_warning("127.0.0.1", 8000, None) is None
    assert bind_warning("0.0.0.0", 8000, KEY) is None
    warning = bind_warning("0.0.0.0", 8000, None)
    assert "without an API key" in warning and "SPECEXPORT_API_KEY" in warning and "--api-key" in warning


# ------------------------------------------------------------------ limits and malformed bodies

@pytest.fixture(scope="module")
def small(build):
    """A server with a 16 KiB body limit, no key."""
    s = LiveServer(create_app(specexport.load(build), method="vanilla", limits=Limits(max_body_bytes=16384)))
    yield s
    s.stop()


def test_a_body_over_the_limit_is_a_413(small):
    with pytest.raises(openai.APIStatusError) as err:                    # what the openai client sends
        small.client.completions.create(model="tiny-llama", prompt="x" * 20_000, max_tokens=2)
    assert err.value.status_code == 413
    assert set(err.value.body) == SHAPE and err.value.body["code"] == "request_too_large"
    assert "16384" in err.value.body["message"] and "--max-body-bytes" in err.value.body["message"]
    big = json.dumps({"prompt": "y" * 30_000_000}).encode()                # the 30 MB body
    r = httpx.post(f"{small.url}/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():                                                          # no Content-Length: counted as it comes
        for _ in range(40):
            yield b"z" * 1024

    r = httpx.post(f"{small.url}/v1/completions", content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as err:                     # under the limit, over max_seq_len
        small.client.completions.create(model="tiny-llama", prompt="x " * 2000, max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "prompt"
    assert small.client.completions.create(model="tiny-llama", prompt="x", max_tokens=2).usage.completion_tokens


@pytest.mark.parametrize("raw, content_type, status, says, param", [
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "application/json", 400, "not valid UTF-8 (byte 12", None),
    (b'{"prompt": "x",, }', "application/json", 400, "not valid JSON: Expecting property name", None),
    (b'{"prompt": "x", "max_tokens": 4', "application/json", 400, "not valid JSON", None),
    (b'[1, 2]', "application/json", 400, "must be a JSON object, got an array", None),
    (b'"prompt"', "application/json", 400, "must be a JSON object, got a string", None),
    (b"", "application/json", 400, "the request body is empty", None),
    (b"[" * 10_000, "application/json", 400, "not valid JSON", None),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json", 400, "not valid JSON", None),
    (b'{"prompt": "x", "max_tokens": "many"}', "application/json", 400, "max_tokens: Input should be a valid integer",
     "max_tokens"),
    (b'{"prompt": "x", "stop": 5}', "application/json", 400, "stop: expected one of: str, list[str]", "stop"),
    (b'{"prompt": "x", "seed": -1}', "application/json", 400, "seed: Input should be greater than or equal to 0",
     "seed"),
    (b'{"prompt": "x", "method": "fast"}', "application/json", 400, "method: Input should be", "method"),
    (b'{"max_tokens": 2}', "application/json", 400, "prompt: Field required", "prompt"),
    (b'{"prompt": "ab\\ud800", "max_tokens": 2}', "application/json", 400, "prompt: a lone surrogate", None),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "application/json", 400,
     "messages.0.content: a lone surrogate", None),
    (b'{"prompt": "x", "temperature": NaN}', "application/json", 400, "NaN is not JSON", None),
    (b'{"prompt": "x", "method": "draft", "tree": [[0], [123456789]]}', "application/json", 400,
     "tree: rank 123456789 is beyond the draft's vocabulary", None),
    (b'{"prompt": "x", "method": "draft", "tree": [[0], [1' + b"0" * 30 + b']]}', "application/json", 400,
     "tree: rank paths must be distinct, non-empty and made of ranks in 0..2^31-1", None),
    (b'{"prompt": "x", "max_tokens": 2}', "text/plain", 200, None, None),        # curl -d: JSON whatever the label
    (b'{"prompt": "x", "max_tokens": 2}', None, 200, None, None),
])
def test_a_malformed_body_gets_one_clear_error(small, raw, content_type, status, says, param):
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{small.url}/v1/completions", content=raw, headers=headers)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["usage"]["completion_tokens"] >= 1
        return
    error = r.json()["error"]
    assert set(error) == SHAPE and error["type"] == "invalid_request_error"
    assert says in error["message"] and error["param"] == param, error


def test_a_keyless_loopback_server_refuses_other_sites_hosts_and_origins(small):
    """DNS rebinding (a page's own name resolving to 127.0.0.1: its Host) and cross-site posts (a page's
    text/plain form: its Origin) get 403; loopback names and clients without an Origin (curl, openai) pass."""
    body = b'{"prompt": "x", "max_tokens": 2}'
    for headers in ({"host": "attacker.example"}, {"origin": "https://attacker.example"}, {"origin": "null"},
                    {"host": f"attacker.example:{small.port}", "origin": f"http://attacker.example:{small.port}"}):
        r = httpx.post(f"{small.url}/v1/completions", content=body, headers={"content-type": "text/plain", **headers})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (headers, r.text)
    for headers in ({"host": f"localhost:{small.port}"}, {"origin": f"http://127.0.0.1:{small.port}"},
                    {"host": f"[::1]:{small.port}", "origin": "http://localhost:3000"}):
        r = httpx.post(f"{small.url}/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, (headers, r.text)


def test_unknown_paths_and_methods_use_the_error_shape(small):
    r = httpx.get(f"{small.url}/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "/v1/engines" in r.json()["error"]["message"]
    r = httpx.get(f"{small.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as err:
        small.client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_a_full_queue_is_a_429_with_retry_after(build):
    pipe = specexport.load(build)
    gate = gated(pipe)                                                    # decoding stops until the test says
    s = LiveServer(create_app(pipe, method="vanilla", limits=Limits(max_queue=1)))
    try:
        def rejected() -> float:
            page = metric_values(httpx.get(f"{s.url}/metrics").text)
            return page.get(("specexport_requests_total",
                             frozenset({("endpoint", "/v1/completions"), ("status", "429")})), 0)

        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(s.openai().completions.create, model="tiny-llama", prompt="def f():",
                                  max_tokens=25, temperature=0)
            wait_for(lambda: s.worker.pending == 1 and s.worker.waiting == 0, "the first request to run")
            queued = pool.submit(s.openai().completions.create, model="tiny-llama", prompt="x = [", max_tokens=5,
                                 temperature=0)
            wait_for(lambda: s.worker.waiting == 1, "the second request to queue")
            with pytest.raises(openai.RateLimitError) as err:
                s.client.completions.create(model="tiny-llama", prompt="y", max_tokens=2)
            assert err.value.status_code == 429 and set(err.value.body) == SHAPE
            assert err.value.body["code"] == "queue_full" and "--max-queue 1" in err.value.body["message"]
            assert int(err.value.response.headers["retry-after"]) >= 1
            # the openai client's own retry honours Retry-After and gets through once there is room: its first
            # try is refused while the gate holds both requests, then the gate opens
            patient = pool.submit(s.openai(max_retries=3).completions.create, model="tiny-llama", prompt="y",
                                  max_tokens=2)
            wait_for(lambda: rejected() == 2, "the patient client's first try to be refused")
            gate.set()
            assert running.result(timeout=60).usage.completion_tokens >= 1
            assert queued.result(timeout=60).usage.completion_tokens >= 1
            assert patient.result(timeout=60).usage.completion_tokens >= 1
        assert rejected() == 2
    finally:
        gate.set()
        s.stop()


def test_a_request_past_its_deadline_is_a_504_and_frees_the_model(build):
    s = LiveServer(create_app(slowed(specexport.load(build), 0.02), method="vanilla",
                              limits=Limits(request_timeout_s=0.4)))
    try:
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as err:            # ~100 passes of 20 ms: 2 s
            s.client.completions.create(model="tiny-llama", prompt="def f():", max_tokens=100, temperature=0)
        assert err.value.status_code == 504 and set(err.value.body) == SHAPE and err.value.body["code"] == "timeout"
        assert "--request-timeout" in err.value.body["message"] and time.monotonic() - start < 1.5
        wait_for(lambda: s.worker.pending == 0, "the decode to stop", timeout=2)
        text = ""
        with pytest.raises(openai.APIError, match="deadline"):               # mid-stream: an error event
            for chunk in s.client.completions.create(model="tiny-llama", prompt="def f():", max_tokens=100,
                                                     temperature=0, stream=True):
                text += chunk.choices[0].text
        assert text                                                          # it had started
        wait_for(lambda: s.worker.pending == 0, "the model to be free", timeout=2)
        assert s.client.completions.create(model="tiny-llama", prompt="a", max_tokens=3).usage.completion_tokens >= 1
        page = metric_values(httpx.get(f"{s.url}/metrics").text)
        assert page[("specexport_decodes_total", frozenset({("outcome", "timeout")}))] == 2
    finally:
        s.stop()


def test_the_deadline_counts_the_time_in_the_queue(build):
    s = LiveServer(create_app(slowed(specexport.load(build), 0.3), method="vanilla",
                              limits=Limits(request_timeout_s=0.45)))
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(s.client.completions.create, model="tiny-llama", prompt="a", max_tokens=50)
            wait_for(lambda: s.worker.running == 1, "the first request to run")
            start = time.monotonic()
            with pytest.raises(openai.InternalServerError) as err:          # never left the queue
                s.client.completions.create(model="tiny-llama", prompt="b", max_tokens=2)
            assert err.value.status_code == 504 and err.value.body["code"] == "timeout"
            assert time.monotonic() - start < 0.6 and s.worker.running == 1  # the first still decodes
            with pytest.raises(openai.InternalServerError):
                first.result(timeout=10)
        wait_for(lambda: s.worker.pending == 0, "the model to be free", timeout=2)
    finally:
        s.stop()


# ------------------------------------------------------------------ metrics

def test_metrics_count_what_the_clients_saw(build):
    s = LiveServer(create_app(specexport.load(build), method="draft"))
    try:
        outs = [s.client.completions.create(model="tiny-llama", prompt=p, max_tokens=20, temperature=0)
                for p in ("def fib(n):", "import json\n")]
        for p in ("for i in range(10):", "x = ["):
            chunks = list(s.client.completions.create(model="tiny-llama", prompt=p, max_tokens=20, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
            outs.append(chunks[-1])
        with pytest.raises(openai.BadRequestError):
            s.client.completions.create(model="tiny-llama", prompt="x", n=2)
        r = httpx.get(f"{s.url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
        page = metric_values(r.text)

        def value(name, **labels):
            return page.get((name, frozenset(labels.items())), 0)

        assert value("specexport_requests_total", endpoint="/v1/completions", status="200") == 4
        assert value("specexport_requests_total", endpoint="/v1/completions", status="400") == 1
        assert value("specexport_decodes_total", outcome="done") == 4
        assert value("specexport_generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
        assert value("specexport_prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
        passes = [o.model_extra["specexport"]["target_passes"] for o in outs[:2]]
        assert value("specexport_target_passes_total") >= sum(passes) > 0
        assert value("specexport_draft_tokens_proposed_total") >= value("specexport_draft_tokens_accepted_total") > 0
        for histogram in ("specexport_time_to_first_token_seconds", "specexport_request_latency_seconds",
                          "specexport_queue_time_seconds", "specexport_tokens_per_target_pass",
                          "specexport_acceptance_rate"):
            assert value(f"{histogram}_count") == 4, histogram
        assert value("specexport_time_per_output_token_seconds_count") == 4
        assert value("specexport_tokens_per_target_pass_sum") / 4 >= 1.0
        assert value("specexport_queue_depth") == 0 and value("specexport_requests_running") == 0
    finally:
        s.stop()


# ------------------------------------------------------------------ graceful shutdown

def test_shutdown_finishes_queued_and_running_work(build, reference):
    pipe = specexport.load(build)
    gate = gated(pipe)                   # nothing finishes before all have arrived (a loaded machine is slow to send)
    s = LiveServer(create_app(pipe, method="vanilla", limits=Limits(shutdown_grace_s=30)))
    prompts = ["def fib(n):", "import json\n", "x = [", "while True:", "return self.", "for i in range(10):"]
    want = {p: reference.generate(p, max_new_tokens=40, method="vanilla", temperature=0).text for p in prompts}

    def ask(i: int) -> str:
        c = s.openai()
        if i % 2:
            return "".join(ch.choices[0].text for ch in c.completions.create(
                model="tiny-llama", prompt=prompts[i], max_tokens=40, temperature=0, stream=True))
        return c.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=40, temperature=0).choices[0].text

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(ask, i) for i in range(len(prompts))]
            wait_for(lambda: s.worker.pending == len(prompts), "every request to arrive")
            s.server.handle_exit(signal.SIGTERM, None)                       # what the signal handler calls
            assert s.worker.draining
            gate.set()                                                       # the running one and the queued go on
            answers = [f.result(timeout=30) for f in futures]
        assert answers == [want[p] for p in prompts]                         # every one finished, correctly
        s.thread.join(timeout=10)
        assert not s.thread.is_alive()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{s.url}/health")
    finally:
        s.stop()


def test_shutdown_stops_what_outlasts_the_grace_period(build):
    s = LiveServer(create_app(slowed(specexport.load(build), 0.02), method="vanilla",
                              limits=Limits(shutdown_grace_s=0.3)))
    try:
        stream = s.client.completions.create(model="tiny-llama", prompt="def f():", max_tokens=100, temperature=0,
                                             stream=True)
        chunks = iter(stream)
        next(chunks)
        with ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(s.openai().completions.create, model="tiny-llama", prompt=p, max_tokens=50)
                      for p in ("a", "b")]
            wait_for(lambda: s.worker.waiting == 2, "two requests to queue")
            start = time.monotonic()
            s.server.handle_exit(signal.SIGTERM, None)
            with pytest.raises(openai.APIError, match="shutting down"):      # the running stream: an error event
                for _ in chunks:
                    pass
            for f in queued:                                                 # the queued: 503 in OpenAI's shape
                with pytest.raises(openai.InternalServerError) as err:
                    f.result(timeout=10)
                assert err.value.status_code == 503 and err.value.body["code"] == "shutting_down"
        s.thread.join(timeout=10)
        assert not s.thread.is_alive() and time.monotonic() - start < 5
    finally:
        s.stop()


def test_the_cli_takes_the_key_from_the_environment_and_exits_0_on_sigterm(build, reference):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECEXPORT_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "specexport", "serve", str(build), "--port", str(port),
                             "--method", "vanilla", "--log-level", "warning", "--max-queue", "32",
                             "--request-timeout", "60", "--shutdown-grace", "30", "--max-body-bytes", "1MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        banner = proc.stdout.readline()
        assert "API key required" in banner, banner
        wait_for(lambda: _up(url), "specexport serve to come up", timeout=60)
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        prompts = ["def fib(n):", "import json\n", "x = [", "while True:"] * 3
        want = {p: reference.generate(p, max_new_tokens=100, method="vanilla", temperature=0) for p in set(prompts)}

        def ask(p: str):
            c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
            return "".join(ch.choices[0].text for ch in c.completions.create(
                model="tiny-llama", prompt=p, max_tokens=100, temperature=0, stream=True))

        headers = {"Authorization": f"Bearer {KEY}"}
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(ask, p) for p in prompts]
            wait_for(lambda: metric_values(httpx.get(f"{url}/metrics", headers=headers).text)
                     .get(("specexport_queue_depth", frozenset()), 0) >= 3, "requests to queue")
            proc.send_signal(signal.SIGTERM)
            finished = 0
            for p, f in zip(prompts, futures):
                try:
                    assert f.result(timeout=60) == want[p].text               # served in full, or ...
                    finished += 1
                except openai.APIConnectionError:                            # ... sent after it stopped listening
                    pass
        assert finished >= 4, finished                                       # 3 queued + 1 running at SIGTERM
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


# ------------------------------------------------------------------ fuzzing

def test_schemathesis_finds_no_server_error(keyed):
    """Schema-conforming and schema-violating requests generated from the server's own /openapi.json (a
    few hundred, through the key): no 5xx, statuses, content types and error bodies as documented."""
    report = load_soak_module().fuzz(keyed.url, examples=300, seed=0, api_key=KEY, max_seconds=60)
    assert report["requests"] >= 200, report
    assert report["server_errors"] == 0 and not report["failures"], report["failures"]
    assert report["alive_after"]
    assert set(report["statuses"]) <= {"200", "400", "404"}, report["statuses"]


def test_junk_in_any_field_is_a_400_never_a_500(small):
    """Hypothesis bodies: the requests' fields given junk (lone surrogates, huge and negative numbers, wrong
    types, nested lists and objects), at top level and inside messages: every answer a 2xx or a 4xx in
    OpenAI's error shape, none a 500."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    lone = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)            # unpaired surrogates
    text = st.one_of(st.text(alphabet=st.characters(codec=None, categories=("L", "N", "P", "Zs")), max_size=12),
                     st.lists(st.one_of(st.characters(codec=None, categories=("L", "N")), lone), min_size=1,
                              max_size=6).map("".join))
    scalar = st.one_of(st.none(), st.booleans(), text, st.integers(-2 ** 70, 2 ** 70),
                       st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 63, -2 ** 63, 1e308, -1e-308, 0.5]),
                       st.floats(allow_nan=False, allow_infinity=False))
    junk = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(text, inner, max_size=3)), max_leaves=8)
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "method", "gamma", "tree",
              "stream", "stream_options", "user", "suffix_cache", "n", "logprobs", "model", "max_completion_tokens"]
    message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), junk),
                                     "content": st.one_of(text, junk)})
    chat = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, min_size=1, max_size=2), junk)},
                                 optional={f: junk for f in fields if f != "prompt"})
    completion = st.fixed_dictionaries({"prompt": st.one_of(text, junk), "max_tokens": st.integers(1, 3)},
                                       optional={f: junk for f in fields if f not in ("prompt", "max_tokens")})
    seen = {}

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.one_of(st.tuples(st.just("/v1/completions"), completion), st.tuples(st.just("/v1/chat/completions"), chat)))
    def one(case):
        path, body = case
        raw = json.dumps(body, ensure_ascii=True).encode()       # lone surrogates as \\udXXX escapes, as JSON allows
        r = httpx.post(f"{small.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == SHAPE, r.text

    one()
    assert seen.get(400, 0) > 50 and set(seen) <= {200, 400, 404, 413}, seen
