"""`specexport export-triton`: the repository it writes, served by a real tritonserver (triton_server.py
says where the binary comes from) and queried with tritonclient over gRPC streaming.

Greedy answers must equal `Pipeline.generate`; two instances answer concurrent requests; a bad request
gets an error response and the server keeps serving.
"""
from __future__ import annotations

import json
import queue
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import specexport
from specexport.cli import main
from specexport.errors import SpecexportError
from specexport.serve.triton import write_repository
from triton_server import Unavailable, tritonserver

grpcclient = pytest.importorskip("tritonclient.grpc")

PROMPTS = ["def fib(n):", "import json\n", "for i in range(10):", "class Stack:", "x = [", "while True:"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def repo(built_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "repo"
    assert main(["export-triton", str(built_llama), "--out", str(out), "--instances", "2", "--method", "draft"]) == 0
    return out


@pytest.fixture(scope="module")
def server(repo):
    try:
        command, env = tritonserver()
    except Unavailable as err:
        pytest.skip(f"no tritonserver here: {err}")
    grpc_port = _port()
    log = repo.parent / "tritonserver.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([*command, f"--model-repository={repo}", f"--grpc-port={grpc_port}",
                                 f"--http-port={_port()}", "--allow-metrics=false"], stdout=sink,
                                stderr=subprocess.STDOUT, env=env)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    deadline = time.monotonic() + 120
    while True:
        try:
            if client.is_model_ready("tiny-llama"):
                break
        except Exception:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"tritonserver did not load the model:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    yield f"127.0.0.1:{grpc_port}"
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def infer(url: str, prompt: str, **inputs) -> dict:
    """One streamed request: {"text", "finish_reason", "stats", "pieces"} or {"error"}."""
    client = grpcclient.InferenceServerClient(url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    tensors = [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")]
    kinds = {"max_tokens": (np.int32, "INT32"), "temperature": (np.float32, "FP32"), "seed": (np.int64, "INT64")}
    for name, value in inputs.items():
        if name in kinds:
            dtype, kind = kinds[name]
            tensors.append((name, np.array([value], dtype), kind))
        else:
            tensors.append((name, np.array([str(value).encode()], dtype=np.object_), "BYTES"))
    request = []
    for name, arr, kind in tensors:
        t = grpcclient.InferInput(name, list(arr.shape), kind)
        t.set_data_from_numpy(arr)
        request.append(t)
    client.async_stream_infer("tiny-llama", request, enable_empty_final_response=True)
    out = {"text": "", "pieces": 0}
    try:
        while True:
            result, error = events.get(timeout=60)
            if error is not None:
                return {"error": str(error)}
            text = result.as_numpy("text_output")
            if text is not None:
                out["text"] += "".join(t.decode() for t in text)
                out["pieces"] += 1
            if result.as_numpy("finish_reason") is not None:
                out["finish_reason"] = result.as_numpy("finish_reason")[0].decode()
                out["stats"] = json.loads(result.as_numpy("stats")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


def test_repository_layout(repo, built_llama):
    model = repo / "tiny-llama"
    config = (model / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "decoupled: true" in config and "count: 2" in config
    assert (model / "1" / "model.py").read_text().startswith('"""A Triton Inference Server Python-backend model')
    copied = specexport.load(model / "1" / "build", verify=True)      # every listed file, hashes checked
    copied.close()
    assert not list(repo.glob(".*partial"))


def test_export_refuses_to_overwrite_and_bad_names(repo, built_llama):
    with pytest.raises(SpecexportError, match="exists"):
        write_repository(built_llama, repo)
    with pytest.raises(SpecexportError, match="--name"):
        write_repository(built_llama, repo, name="a/b")
    with pytest.raises(SpecexportError, match="--precision"):
        write_repository(built_llama, repo, name="other", precision="int3")
    ref = write_repository(built_llama, repo, name="by-reference", copy=False)
    assert f'string_value: "{built_llama.resolve()}"' in (ref / "config.pbtxt").read_text()
    assert not (ref / "1" / "build").exists()


def test_greedy_answers_equal_generate(server, built_llama):
    with specexport.load(built_llama) as pipe:
        for prompt in PROMPTS[:3]:
            want = pipe.generate(prompt, max_new_tokens=24, method="draft", temperature=0)
            got = infer(server, prompt, max_tokens=24)
            assert got["text"] == want.text and got["finish_reason"] == want.finish_reason
            assert got["stats"]["completion_tokens"] == len(want.token_ids) and got["stats"]["method"] == "draft"
            assert got["pieces"] > 1                                    # streamed, not one blob
        lookup = infer(server, PROMPTS[0], max_tokens=16, method="lookup")
        assert lookup["text"] == pipe.generate(PROMPTS[0], max_new_tokens=16, method="lookup").text


def test_concurrent_requests_and_errors(server, built_llama):
    with specexport.load(built_llama) as pipe:
        want = {p: pipe.generate(p, max_new_tokens=20, method="draft").text for p in PROMPTS}
    bad = infer(server, PROMPTS[0], method="eagle")
    assert "method" in bad["error"]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: infer(server, p, max_tokens=20)["text"], PROMPTS * 2))
    assert got == [want[p] for p in PROMPTS * 2]
    assert infer(server, PROMPTS[1], max_tokens=4)["finish_reason"] == "length"
