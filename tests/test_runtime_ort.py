"""The runtime on real exported tiny models: greedy equals Hugging Face greedy, draft = target accepts
everything, tree commits compact the KV correctly, bad input gets clear errors, and speculative
sampling matches vanilla sampling in distribution (two-sample test)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as sps

import specexport
from specexport.cli import main
from specexport.errors import SpecexportError
from specexport.io_spec import ModelIO
from specexport.runtime.backends.ort import OrtBackend
from specexport.runtime.loop import DecodeStats, decode
from specexport.runtime.proposers import DraftChain
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.tree import Tree
from close import assert_close

CAPACITY = 320


@pytest.fixture(scope="session")
def built_long(tiny_root, tiny_checkpoints, write_yaml, run_build):
    """llama target + 1-layer draft, room for 20-token prompts + 200 new tokens, verify up to 8."""
    out = tiny_root / "build" / "llama-long"
    cfg = write_yaml(tiny_root / "yaml" / "llama-long.yaml", name="llama-long",
                     target={"path": tiny_checkpoints["llama"]}, draft={"path": tiny_checkpoints["llama-draft"]},
                     max_seq_len=CAPACITY, max_verify_tokens=8, output=out)
    assert run_build(cfg) == 0
    return out


@pytest.fixture(scope="session")
def pipe(built_long):
    with specexport.load(built_long, threads=1) as p:
        yield p


@pytest.fixture(scope="session")
def hf_target(tiny_checkpoints):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval()


def _hf_greedy(model, prompt, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(prompt)[None], max_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].numpy() for s in out.scores]


def _assert_same_greedy(ours, ref, scores, label):
    """Token-for-token equality; a divergence is tolerated only at a genuine near-tie (fp32 noise)."""
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(scores[j])[-2:]
            assert top2[1] - top2[0] < 1e-5, f"{label}: token {j} is {a}, HF greedy {b} (gap {top2[1] - top2[0]:.2e})"
            return
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens, HF greedy {len(ref)}"


def test_greedy_equals_hf_for_every_gamma(pipe, hf_target):
    rng = np.random.default_rng(0)
    vocab = pipe.manifest["models"]["target"]["vocab_size"]
    for p in range(20):
        prompt = [1, *rng.integers(3, vocab, int(rng.integers(2, 20))).tolist()]
        ref, scores = _hf_greedy(hf_target, prompt, 200)
        out = pipe.generate(prompt_ids=prompt, max_new_tokens=200, method="vanilla")
        _assert_same_greedy(out.token_ids, ref, scores, f"prompt {p} vanilla")
        for gamma in range(1, 7):
            out = pipe.generate(prompt_ids=prompt, max_new_tokens=200, method="draft", gamma=gamma)
            _assert_same_greedy(out.token_ids, ref, scores, f"prompt {p} gamma {gamma}")
            assert out.stats.proposed > 0


def test_specexport_threads_sizes_the_sessions_opened_without_a_count(built_long, monkeypatch):
    """$SPECEXPORT_THREADS is the pool of every CPU session opened without a thread count (a suite's or a
    server's processes sharing the cores); a count given wins; junk is refused naming the variable."""
    from specexport.runtime.backends import ort as ort_backend

    monkeypatch.setenv(ort_backend.THREADS_ENV, "3")
    assert ort_backend.base_options().intra_op_num_threads == 3
    assert ort_backend.default_pool() == "3 ($SPECEXPORT_THREADS)"
    backend = _backend(built_long, "target", threads=None)
    assert backend.session.get_session_options().intra_op_num_threads == 3
    assert _backend(built_long, "target").session.get_session_options().intra_op_num_threads == 1   # given: 1
    monkeypatch.delenv(ort_backend.THREADS_ENV)
    assert ort_backend.base_options().intra_op_num_threads == 0 and ort_backend.default_threads() is None
    for junk in ("0", "two", "-1"):
        monkeypatch.setenv(ort_backend.THREADS_ENV, junk)
        with pytest.raises(SpecexportError, match=r"\$SPECEXPORT_THREADS: expected a whole number"):
            ort_backend.base_options()


def _backend(build, role, capacity=CAPACITY, max_tokens=64, **options):
    m = json.loads((build / "manifest.json").read_text())
    io = ModelIO.from_dict(m["models"][role]["io"])
    options = {"threads": 1, **options}
    return OrtBackend(build / m["models"][role]["precisions"]["fp32"]["dir"], io=io, capacity=capacity,
                      max_tokens=max_tokens, **options)


def test_draft_equal_to_target_accepts_everything(built_long):
    target, draft = _backend(built_long, "target"), _backend(built_long, "target")
    for gamma in (1, 3, 7):
        st = DecodeStats()
        ids = list(decode(target, DraftChain(draft, gamma), np.array([1, 40, 41, 42]), max_new_tokens=60,
                          params=SamplingParams(), rng=np.random.default_rng(0), stats=st))
        assert st.proposed > 0 and st.accepted == st.proposed, (gamma, st.accepted, st.proposed)
        assert sum(map(len, ids)) == 60


def test_public_binding_fallback_gives_the_same_logits(built_long):
    """The backend binds through onnxruntime's C-level IOBinding when it can; the public-API path
    it falls back to must compute the same thing (a chain of forwards with commits)."""
    import onnxruntime

    from specexport.runtime.backends import ort as ort_backend

    fast, public = _backend(built_long, "target"), _backend(built_long, "target")
    no_c_level = type("NoCLevel", (), {})()          # an onnxruntime without OrtDevice.make
    public._bind_in, public._bind_out, public._run = ort_backend.binding_calls(no_c_level, public.session,
                                                                                public.binding)
    assert fast._run.__code__ is not public._run.__code__ and hasattr(onnxruntime, "OrtDevice")
    for step in (np.array([1, 40, 41, 42, 43]), np.array([44]), np.array([45, 46, 47])):
        a, b = np.array(fast.forward(step).logits), np.array(public.forward(step).logits)
        np.testing.assert_array_equal(a, b)
        fast.commit(len(step)), public.commit(len(step))


def test_min_tokens_pads_small_calls_and_changes_no_result(built_long, tmp_path):
    """A graph whose one-row kernels compute differently (MatMulNBits accuracy_level 4) runs with at least
    2 rows a call: the padding must be invisible (same logits, KV, commits, trees, capacity end)."""
    import shutil

    plain, padded = _backend(built_long, "target"), _backend(built_long, "target", min_tokens=2)
    seen = []
    rows = padded._rows
    padded._rows = lambda tokens, *a, **k: (seen.append(len(tokens)), rows(tokens, *a, **k))[1]
    for step, phase in ((np.array([1, 40, 41]), "prefill"), (np.array([42]), "prefill"), (np.array([43]), "decode"),
                        (np.array([44, 45]), "decode"), (np.array([46]), "decode")):
        a, b = plain.forward(step, phase=phase), padded.forward(step, phase=phase)
        assert a.logits.shape == b.logits.shape and a.hidden.shape == b.hidden.shape
        assert_close(b.logits, a.logits, rel=1e-5, why=f"{phase} padded to 2 rows vs not: other kernels, fp32")
        plain.commit(len(step)), padded.commit(len(step))
    assert min(seen) == 2 and len(seen) == 5
    tree = Tree(np.array([-1]))                                    # a one-node "tree" (root only) pads too
    a = plain.forward(np.array([47]), depths=tree.depths, tree_mask=tree.mask)
    b = padded.forward(np.array([47]), depths=tree.depths, tree_mask=tree.mask)
    assert_close(b.logits, a.logits, rel=1e-5, why="a padded one-node tree vs not: other kernels, fp32")
    # the pipeline reads min_tokens from the manifest; greedy output is unchanged, up to the capacity
    copy = tmp_path / "build"
    shutil.copytree(built_long, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["target"]["precisions"]["fp32"]["min_tokens"] = 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with specexport.load(copy) as p, specexport.load(built_long) as q:
        assert p.target.min_tokens == 2 and q.target.min_tokens == 1
        prompt = list(range(3, 3 + CAPACITY - 12))
        for method in ("vanilla", "draft", "lookup"):
            want = q.generate(prompt_ids=prompt, max_new_tokens=40, method=method)
            got = p.generate(prompt_ids=prompt, max_new_tokens=40, method=method)
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"


def test_tree_commit_compacts_the_accepted_path(built_long):
    """Verify a tree, commit one root-to-leaf path, then decode: logits equal a plain chain's."""
    a, b = _backend(built_long, "target"), _backend(built_long, "target")
    prompt = np.array([1, 50, 60, 70, 80, 90])
    tree = Tree(np.array([-1, 0, 0, 1, 2, 2, 4]))          # root, 2 children, ...
    tokens = np.array([prompt[-1], 11, 12, 13, 14, 15, 16])
    a.forward(prompt[:-1])
    a.commit(len(prompt) - 1)
    a.forward(tokens, depths=tree.depths, tree_mask=tree.mask)
    path = tree.path_to(6)                                    # [0, 2, 4, 6]
    a.commit(path)
    chain = np.concatenate([prompt, tokens[path[1:]]])
    b.forward(chain)
    b.commit(len(chain))
    assert a.length == b.length == len(chain)
    nxt = np.array([33, 34])
    la, lb = np.array(a.forward(nxt).logits), np.array(b.forward(nxt).logits)
    assert_close(la, lb, rel=1e-5, why="after a compacted tree commit vs a chain: the same KV rows, fp32")
    # and a wrong compaction (committing the path's rows without moving them) differs
    c = _backend(built_long, "target")
    c.forward(prompt[:-1])
    c.commit(len(prompt) - 1)
    c.forward(tokens, depths=tree.depths, tree_mask=tree.mask)
    c.commit(len(path))
    assert np.abs(np.array(c.forward(nxt).logits) - lb).max() > 1e-3


def test_capacity_stops_cleanly_with_length(pipe):
    prompt = list(range(3, 3 + CAPACITY - 10))
    for method in ("vanilla", "draft"):
        out = pipe.generate(prompt_ids=prompt, max_new_tokens=100, method=method, gamma=5)
        assert out.finish_reason == "length"
        eos = pipe.eos_ids
        if not eos.intersection(out.token_ids):
            assert len(prompt) + len(out.token_ids) == CAPACITY


def test_eos_and_stop_strings(pipe):
    prompt = [1, 100, 101, 102]
    base = pipe.generate(prompt_ids=prompt, max_new_tokens=40, method="vanilla")
    stop_token = base.token_ids[7]
    first = base.token_ids.index(stop_token)
    saved = set(pipe.eos_ids)
    try:
        pipe.eos_ids = {stop_token}
        for gamma in (1, 4):
            out = pipe.generate(prompt_ids=prompt, max_new_tokens=40, method="draft", gamma=gamma)
            assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    finally:
        pipe.eos_ids = saved
    text = base.text
    needle = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip())
    cut = text.find(needle)
    outs = [pipe.generate(prompt_ids=prompt, max_new_tokens=40, method="draft", gamma=g, stop=[needle])
            for g in (1, 4)]
    for out in outs:
        assert out.text == text[:cut] and out.finish_reason == "stop"
    assert outs[0].token_ids == outs[1].token_ids          # the trimmed ids do not depend on γ


def test_stream_pieces_add_up_to_the_text(pipe):
    stream = pipe.stream("def fib(n):", max_new_tokens=50, gamma=3, temperature=0.9, seed=3)
    assert stream.output is None                          # until its pieces end
    pieces = list(stream)
    out = stream.output
    assert "".join(pieces) == out.text and len(out.token_ids) == 50
    assert not hasattr(pipe, "last_output")               # the result is the stream's, not the pipeline's


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="hydra"), r"method: 'hydra' is not supported"),
    (dict(method="eagle"), r"method: 'eagle' was not built \(no EAGLE head in this build\)"),
    (dict(method="medusa"), r"method: 'medusa' was not built \(no Medusa heads in this build\)"),
    (dict(gamma=0), r"gamma: expected an integer in 1\.\.7"),
    (dict(gamma=8), r"gamma: expected an integer in 1\.\.7"),
    (dict(temperature=-1.0), r"temperature: expected a number >= 0"),
    (dict(top_p=0.0), r"top_p: expected a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p: expected a number in \(0, 1\]"),
    (dict(top_k=0), r"top_k: expected an integer >= 1"),
    (dict(max_new_tokens=0), r"max_new_tokens: expected an integer >= 1"),
    (dict(prompt_ids=list(range(3, 3 + CAPACITY))), r"prompt: 320 tokens leave no room"),
])
def test_bad_generation_arguments(pipe, kwargs, match):
    kwargs.setdefault("prompt_ids", [1, 5, 6])
    with pytest.raises(SpecexportError, match=match):
        pipe.generate(**kwargs)


def test_bad_output_folders(built_long, tmp_path):
    with pytest.raises(SpecexportError, match="no manifest.json"):
        specexport.load(tmp_path)
    m = json.loads((built_long / "manifest.json").read_text())
    m["schema_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecexportError, match="schema_version 99 is not supported; this specexport reads 2, 3, 4"):
        specexport.load(tmp_path)
    from specexport.manifest import read_manifest

    m["schema_version"] = 2                      # a build from before the CPU kernels: read as it is
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert read_manifest(tmp_path)["schema_version"] == 2
    with pytest.raises(SpecexportError, match=r"precision: 'int8' was not built for the target; built: fp32"):
        specexport.load(built_long, precision="int8")


def test_vanilla_only_build_refuses_draft(built_long, tmp_path, pipe):
    import shutil

    shutil.copytree(built_long, tmp_path / "b")
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    del m["models"]["draft"]
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(m))
    p = specexport.load(tmp_path / "b")
    with pytest.raises(SpecexportError, match=r"method: 'draft' was not built"):
        p.generate(prompt_ids=[1, 2], method="draft")
    assert len(p.generate(prompt_ids=[1, 5], method="vanilla", max_new_tokens=5).token_ids) == 5


def test_cli_generate(built_long, capsys):
    assert main(["generate", str(built_long), "def fib(n):", "--max-new-tokens", "12", "--method", "draft", "--gamma",
                 "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def fib(n):") and "acceptance" in captured.err
    # without --method, a γ is refused with a line saying why (the default, auto, takes the build's settings)
    assert main(["generate", str(built_long), "x", "--gamma", "3"]) == 1
    assert "--gamma: name the method it is for" in capsys.readouterr().err
    # the default method: the build's bench choice (built_long was built without --no-bench)
    assert main(["generate", str(built_long), "def fib(n):", "--max-new-tokens", "12"]) == 0
    err = capsys.readouterr().err
    assert "--method auto: " in err and ("[vanilla (auto)]" in err or "[auto]" in err), err
    assert main(["generate", str(built_long), "x", "--top-p", "2"]) == 1
    assert "top_p" in capsys.readouterr().err


def _first_tokens(pipe, method, n_runs, temperature, seed0=0):
    """Counts of the (first, second, third) generated tokens over seeded runs."""
    counts = {}
    for s in range(n_runs):
        out = pipe.generate(prompt_ids=[1, 200, 201], max_new_tokens=3, method=method, gamma=2,
                            temperature=temperature, top_k=3, seed=seed0 + s)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _two_sample_p(a: dict, b: dict) -> float:
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]])
    # pool categories with small expected counts into one, so the chi-square approximation holds
    small = table.sum(0) < 10
    if small.any():
        table = np.column_stack([table[:, ~small], table[:, small].sum(1)])
    return sps.chi2_contingency(table)[1]


def test_speculative_sampling_matches_vanilla_two_sample(pipe):
    spec = _first_tokens(pipe, "draft", 1500, 1.0, seed0=0)
    vanilla = _first_tokens(pipe, "vanilla", 1500, 1.0, seed0=10_000)
    assert _two_sample_p(spec, vanilla) > 1e-3
    # the same test has teeth: a different temperature is detected
    cooler = _first_tokens(pipe, "vanilla", 1500, 0.5, seed0=20_000)
    assert _two_sample_p(cooler, vanilla) < 1e-6


def test_runtime_imports_without_torch():
    code = ("import sys, specexport, specexport.runtime.pipeline, specexport.runtime.backends.ort, specexport.cli;"
            "specexport.cli._register();"
            "bad = {'torch', 'transformers', 'onnx', 'tensorrt'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
