"""`specexport serve` with method suffix: one cache per model shared by every request (the decode
thread writes, scrapes and requests read), scoped by OpenAI's `user` field, reported in the answers'
`specexport` field and in /metrics, and kept in a file across restarts (--suffix-cache)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import specexport
from specexport.serve import open_suffix_cache, save_suffix_cache
from specexport.serve.app import create_app
from test_serve import Server

PROMPTS = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class A:\n    pass\n",
           "for i in range(3):\n    print(i)\n"]


@pytest.fixture(scope="module")
def reference(built_llama):
    with specexport.load(built_llama) as pipe:
        yield {p: pipe.generate(p, method="vanilla", max_new_tokens=24).text for p in PROMPTS}


def test_sixteen_clients_on_one_cache_get_generates_answers(built_llama, reference):
    server = Server(create_app(specexport.load(built_llama), method="suffix"))
    try:
        def ask(i):
            prompt = PROMPTS[i % len(PROMPTS)]
            r = server.client.completions.create(model=None, prompt=prompt, max_tokens=24, temperature=0,
                                                 extra_body={"user": f"u{i % 2}"})
            return prompt, r.choices[0].text, r.model_extra["specexport"]

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, range(64)))
        assert all(text == reference[prompt] for prompt, text, _ in answers)
        assert all(meta["method"] == "suffix" and "hit_rate" in meta["suffix"] for _, _, meta in answers)
        assert sum(meta["suffix"]["from_shared"] for _, _, meta in answers) > 0      # later answers used earlier ones
        cache = server.app.state.worker.pipe.suffix_cache
        assert cache.sequences == 64 and cache.stats()["scopes"] == 2
        metrics = httpx.get(f"{server.url}/metrics").text
        tokens = next(line for line in metrics.splitlines() if line.startswith("specexport_suffix_cache_tokens "))
        assert float(tokens.split()[1]) == cache.tokens > 0
        assert "specexport_suffix_cache_hits_total" in metrics
        private = server.client.completions.create(model=None, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                                   extra_body={"suffix_cache": False})
        assert private.choices[0].text == reference[PROMPTS[0]]
        assert private.model_extra["specexport"]["suffix"]["from_shared"] == 0 and cache.sequences == 64
    finally:
        server.stop()


def test_the_cache_file_round_trips_and_a_damaged_one_starts_empty(built_llama, tmp_path):
    path = tmp_path / "suffix.cache"
    with specexport.load(built_llama) as pipe:
        assert "does not exist yet" in open_suffix_cache(pipe, path)
        for p in PROMPTS:
            pipe.generate(p, method="suffix", max_new_tokens=24, suffix_scope="team")
        before = pipe.suffix_cache.stats()
        assert "saved" in save_suffix_cache(pipe, path) and path.is_file()
    with specexport.load(built_llama) as pipe:
        line = open_suffix_cache(pipe, path)
        assert f"{before['tokens']:,} tokens of 4 answers" in line
        again = pipe.generate(PROMPTS[0], method="suffix", max_new_tokens=24, suffix_scope="team")
        assert again.stats.proposer["from_shared"] > 0                   # the saved answers are there
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])     # truncated
    with specexport.load(built_llama) as pipe:
        line = open_suffix_cache(pipe, path)
        assert line.startswith("warning:") and str(path) in line and "\n" not in line
        assert pipe.suffix_cache.tokens == 0
        assert pipe.generate(PROMPTS[0], method="suffix", max_new_tokens=8).token_ids


def test_a_file_the_server_did_not_write_is_never_overwritten(built_llama, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    with specexport.load(built_llama) as pipe:
        assert open_suffix_cache(pipe, path).startswith("warning:")
        pipe.generate(PROMPTS[0], method="suffix", max_new_tokens=8)
        line = save_suffix_cache(pipe, path)
    assert line.startswith("warning: the suffix cache was not saved") and str(path) in line
    assert path.read_text() == "mine\n"
