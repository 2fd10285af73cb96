"""The `gguf` precision: a GGUF file's own blocks in the graph (quant/gguf_blocks.py, quant/gguf_graph.py).

Every block type's codes and scales against the gguf package's dequantization (the reference), bit for
bit; then a tiny Llama written as a GGUF file whose tensors use all eight types (K-quants as random
valid blocks: the file is the model), built with precisions [fp32, gguf]: the parity gate, every weight
from the file, the graph's size against the file's, and greedy decoding equal to the fp32 graph's."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from machine import kernels_missing  # noqa: E402
from specexport.quant.gguf_blocks import SUPPORTED, decode, random_blocks  # noqa: E402

# GGUF tensor -> block type, every supported type at least once, affine and symmetric, 4 and 8 bits
TYPES = {"token_embd": "Q4_K", "output": "Q6_K",
         "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q5_K", "blk.0.attn_v": "Q6_K", "blk.0.attn_output": "Q8_0",
         "blk.0.ffn_gate": "Q4_0", "blk.0.ffn_up": "Q4_1", "blk.0.ffn_down": "Q5_1",
         "blk.1.attn_q": "Q5_0", "blk.1.attn_k": "Q4_1", "blk.1.attn_v": "Q8_0", "blk.1.attn_output": "Q4_K",
         "blk.1.ffn_gate": "Q5_K", "blk.1.ffn_up": "Q6_K", "blk.1.ffn_down": "Q4_0"}


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_codes_and_scales_equal_the_gguf_packages_dequantization(qtype):
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    for n, k in ((3, 256), (5, 512)):
        raw = random_blocks(rng, qtype, n, k=k)
        codes = decode(qtype, raw, (n, k))
        np.testing.assert_array_equal(codes.dequantize(), dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k))
        assert codes.codes.dtype == np.uint8 and codes.codes.max() < 2 ** codes.bits
        assert codes.packed_codes().shape == (n, k // codes.block, codes.block * codes.bits // 8)


def test_an_unsupported_block_type_is_named():
    with pytest.raises(ValueError, match="GGUF block type IQ2_XS has no exact mapping"):
        decode("IQ2_XS", np.zeros((1, 66), np.uint8), (1, 256))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """GGUF conversions of this module go to a cache of its own, not the user's ~/.cache/specexport."""
    monkeypatch.setenv("SPECEXPORT_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-exact-cache"))


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    return write_mixed_gguf(tmp_path_factory.mktemp("gguf-exact") / "tiny-mixed.gguf")


def lean_builds(gguf_path, tmp_path_factory, write_yaml, run_build, folder: str, builds: dict):
    """Lean `gguf` builds of the file on our kernels (skipped, or failed when they are required, where they do
    not load), each {name: extra model.yaml fields} into <fresh folder>/<name>, converted through this
    module's cache; returns the folder."""
    from machine import kernels_missing

    from specexport.plugins import cpu

    if not cpu.status().available:
        kernels_missing(cpu.status().line())
    base = tmp_path_factory.mktemp(folder)
    with pytest.MonkeyPatch.context() as mp:        # conversions to this module's cache, not the user's
        mp.setenv("SPECEXPORT_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-exact-cache"))
        for name, extra in builds.items():
            yaml = write_yaml(base / f"{name}.yaml", name=name, target={"path": gguf_path}, max_seq_len=96,
                              precisions=["gguf"], output=base / name,
                              quality_gates={"gguf": {"min_top1": 0.0, "max_kl": 100.0}}, **extra)
            assert run_build(yaml, "--no-bench") == 0
    return base


def write_mixed_gguf(path):
    """A tiny Llama (hidden 256: K-quant rows) as a GGUF file at `path` with the TYPES above."""
    import test_gguf as tg

    tok = tg._tokenizer(split_digits=False)
    model = tg._model(tok, tied=False)
    import transformers

    cfg = transformers.LlamaConfig(**{**model.config.to_dict(), "hidden_size": 256, "intermediate_size": 512,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(1)
    tg.write_gguf(path, model, tok, pre="gpt-2", quantize=lambda name, arr: _quantize(rng, name, arr))
    return path


def _quantize(rng, name: str, arr: np.ndarray):
    """(raw blocks, type) for the tensors in TYPES, else None (written as float32)."""
    qtype = TYPES.get(name.removesuffix(".weight"))
    if qtype is None:
        return None
    n, k = arr.shape
    return random_blocks(rng, qtype, n, k=k), gguf.GGMLQuantizationType[qtype]


@pytest.fixture
def kernels_route(request, monkeypatch):
    """"ours": specexport's CPU kernels (where they build here); "stock": hidden, ONNX Runtime's ops."""
    from specexport.plugins import cpu

    if request.param == "stock":
        monkeypatch.setenv("SPECEXPORT_KERNELS", "off")
    cpu.status.cache_clear()
    if request.param == "ours" and not cpu.status().available:
        kernels_missing(cpu.status().line())
    yield request.param
    monkeypatch.undo()
    cpu.status.cache_clear()


@pytest.mark.parametrize(("level", "kernels_route"), [(0, "ours"), (4, "ours"), (4, "stock")], indirect=["kernels_route"])
def test_gguf_precision_builds_from_the_files_blocks(quantized_gguf, tmp_path, write_yaml, run_build, level,
                                                     kernels_route):
    import onnx

    import specexport
    from specexport.manifest import read_manifest

    out = tmp_path / "out"
    yaml = write_yaml(tmp_path / "m.yaml", name="g", target={"path": quantized_gguf}, max_seq_len=96,
                      precisions=["fp32", "gguf"], quantization={"gguf": {"accuracy_level": level}},
                      quality_gates={"gguf": {"min_top1": 0.0, "max_kl": 100.0}}, output=out)
    assert run_build(yaml, "--no-bench") == 0
    entry = read_manifest(out)["models"]["target"]["precisions"]["gguf"]
    assert set(entry["quantization"]["block_types"]) == set(SUPPORTED)
    assert entry["quantization"]["unmapped_tensors"] == {}
    assert entry["parity_max_rel_error"] <= 1e-4
    # a tree's sibling rows: ~1e-6 at level 0 (fp32 arithmetic); int8 activations at level 4 may move them
    from specexport.quant.quality import ROW_TOLERANCE

    assert entry["trees"] == ("exact" if entry["row_dependence"]["siblings"] <= ROW_TOLERANCE else "chains")
    if level == 0:
        assert entry["trees"] == "exact"
    weights = entry["files"][f"{entry['dir']}/model.onnx.data"]["size"]      # the graph proto aside (90 KB here)
    file_weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(quantized_gguf)).tensors)
    ops = {n.op_type for n in onnx.load(str(out / entry["dir"] / "model.onnx"), load_external_data=False).graph.node}
    if kernels_route == "ours":
        assert entry["quantization"]["kernels"]["ops"] == "specexport.cpu"
        assert {"GgufMatMul", "GgufMatMulN", "GgufGather"} <= ops and "MatMulNBits" not in ops
        assert weights <= 1.02 * file_weights, (weights, file_weights)     # the file's bytes, nothing widened
        assert entry["min_tokens"] == 1 and entry["row_dependence"]["one_token"] <= (1e-6 if level == 0 else 0.0)
    else:
        assert entry["quantization"]["kernels"] == {"ops": "onnxruntime", "why": "SPECEXPORT_KERNELS=off"}
        assert "MatMulNBits" in ops and "GgufMatMul" not in ops
        assert weights <= 1.10 * file_weights, (weights, file_weights)  # 5/6-bit codes packed but for the largest (WIDE_BUDGET)
    with specexport.load(out, precision="fp32") as ref, specexport.load(out, precision="gguf") as got:
        for prompt in ([1, 40, 41, 42], [1, 7, 300, 5, 9]):
            want = ref.generate(prompt_ids=prompt, max_new_tokens=40, method="vanilla").token_ids
            plain = got.generate(prompt_ids=prompt, max_new_tokens=40, method="vanilla").token_ids
            spec = got.generate(prompt_ids=prompt, max_new_tokens=40, method="lookup", gamma=4).token_ids
            assert spec == plain                        # speculation on the gguf graph: its own vanilla output
            trees = got.generate(prompt_ids=prompt, max_new_tokens=40, method="suffix").token_ids
            assert trees == plain                       # trees too (as chains where sibling rows differ)
            if level == 0:
                assert plain == want                    # the file's weights in fp32: the fp32 graph's output
    if kernels_route == "ours" and level == 4:
        _sampling_through_the_loop_is_the_targets(out)


class _Sharpened:
    """A draft at eight times the target's logit scale: q piles onto p's first choice, so rejections are common
    and the residual max(p - q, 0) is far from p."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, tokens, **kw):
        from specexport.runtime.backends.base import StepOutput

        out = self.inner.forward(tokens, **kw)
        return StepOutput(out.logits * 8.0, out.hidden)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _resample_from_p(proposal, draft_probs, target_probs, uniforms, draws=None):
    """accept_chain with a planted bug: a rejected token is replaced by a draw from p, not from max(p - q, 0)."""
    from specexport.runtime.accept import Verdict
    from specexport.runtime.sampling import sample

    gamma = len(proposal)
    for i in range(gamma):
        x, p, q = proposal[i], target_probs[i], draft_probs[i]
        if uniforms[i] * q[x] >= p[x]:
            token = sample(p, draws[i])                                             # BUG
            return Verdict(np.arange(i + 1), np.append(proposal[:i], token).astype(np.int64))
    return Verdict(np.arange(gamma + 1), np.append(proposal, sample(target_probs[gamma], draws[gamma])).astype(np.int64))


def _sampling_through_the_loop_is_the_targets(out):
    """A G-test through the whole loop, sampling (top-k 3) on the kernels graph: the first three tokens
    of a draft-chain decode follow the target's own distribution, computed from its logits context by context
    (rows independent of the pass, so a context's logits are the same in prefill and in verification); a
    planted bug in the rejection step fails the same test."""
    from fakes import decode_many

    import specexport
    from specexport.runtime import loop
    from specexport.runtime.proposers import DraftChain

    prompt, k = [1, 40, 41, 42], 3
    with specexport.load(out, precision="gguf") as tgt, specexport.load(out, precision="gguf") as drf:
        target = tgt.target
        params, fit = three_token_fit(target, prompt)
        chain = DraftChain(_Sharpened(drf.target), 3)
        tokens, proposed, accepted = decode_many(target, chain, prompt, params, 1500, max_new=k, seed=3)
        assert fit(tokens).pvalue > 1e-4, fit(tokens)
        assert 0 < accepted < proposed                              # both the accept and the reject paths ran
        original = loop.accept_chain
        loop.accept_chain = _resample_from_p
        try:
            bad, _, _ = decode_many(target, chain, prompt, params, 1500, max_new=k, seed=4)
        finally:
            loop.accept_chain = original
        assert fit(bad).pvalue < 1e-6, f"the planted bug was not detected: {fit(bad)}"


def test_gguf_precision_needs_a_gguf_model(tiny_checkpoints, tmp_path, write_yaml, run_build, capsys):
    yaml = write_yaml(tmp_path / "m.yaml", name="g", target={"path": tiny_checkpoints["llama"]}, max_seq_len=64,
                      precisions=["fp32", "gguf"], output=tmp_path / "out")
    assert run_build(yaml) == 1
    assert "target.precisions: gguf is made from a GGUF file's own blocks" in capsys.readouterr().err


def test_a_reduced_vocabulary_gguf_draft_keeps_the_files_rows(quantized_gguf, tmp_path, write_yaml, run_build):
    """draft: {vocab: N} on a GGUF draft: its lm_head is N rows of the file's output tensor, as blocks."""
    import specexport
    from specexport.manifest import read_manifest

    out = tmp_path / "out"
    yaml = write_yaml(tmp_path / "m.yaml", name="v", target={"path": quantized_gguf},
                      draft={"path": quantized_gguf, "vocab": 64}, max_seq_len=96, precisions=["fp32", "gguf"],
                      quality_gates={"gguf": {"min_top1": 0.0, "max_kl": 100.0}}, output=out)
    assert run_build(yaml, "--no-bench") == 0
    draft = read_manifest(out)["models"]["draft"]["precisions"]["gguf"]
    assert draft["quantization"]["unmapped_tensors"] == {} and draft["parity_max_rel_error"] <= 1e-4
    with specexport.load(out, precision="gguf") as pipe:
        plain = pipe.generate(prompt_ids=[1, 40, 41], max_new_tokens=30, method="vanilla").token_ids
        spec = pipe.generate(prompt_ids=[1, 40, 41], max_new_tokens=30, method="draft", gamma=3).token_ids
        assert spec == plain


def test_the_largest_five_and_six_bit_tensors_go_eight_bit_within_the_budget(quantized_gguf):
    """wide_tensors: largest growth first, the total within WIDE_BUDGET of the file; the fixture's file
    has both kinds, so the builds above check the packed and the 8-bit forms against the parity gate."""
    from specexport.quant.gguf_blocks import INFO_BITS
    from specexport.quant.gguf_graph import WIDE_BUDGET, wide_tensors

    tensors = gguf.GGUFReader(str(quantized_gguf)).tensors
    wide = wide_tensors(tensors)
    narrow = {t.name: int(np.prod(t.shape)) * (8 - INFO_BITS[t.tensor_type.name]) // 8
              for t in tensors if t.tensor_type.name in INFO_BITS}
    assert wide and set(narrow) - wide                        # both forms occur
    assert sum(narrow[n] for n in wide) <= WIDE_BUDGET * sum(int(t.n_bytes) for t in tensors)
    assert min(narrow[n] for n in wide) >= max(narrow[n] for n in set(narrow) - wide) or \
        all(narrow[n] + sum(narrow[w] for w in wide) > WIDE_BUDGET * sum(int(t.n_bytes) for t in tensors)
            for n in set(narrow) - wide)                      # a skipped one did not fit


def three_token_fit(target, prompt):
    """(sampling params, fit): the target's exact distribution of the next three tokens, context by context
    from its own logits (top-k 3; random blocks make peaky logits, so a temperature of the top three's spread
    keeps three live outcomes), and fit(tokens [runs, 3]) -> the G-test of sampled rows against it (a last
    cell, probability 0, for anything else)."""
    from fakes import goodness_of_fit

    from specexport.runtime.backends.base import prefill
    from specexport.runtime.sampling import SamplingParams, warp

    target.reset()
    top = np.sort(prefill(target, np.asarray(prompt), 64))[-3:]
    params = SamplingParams(temperature=max(1.0, float(top[-1] - top[0])), top_k=3)

    def probs(ids):
        target.reset()
        return warp(prefill(target, np.asarray(ids), 64), params)

    exact = {}                                                      # (t1, t2, t3) -> probability: 27 cells
    p1 = probs(prompt)
    for a in np.flatnonzero(p1):
        p2 = probs(prompt + [a])
        for b in np.flatnonzero(p2):
            p3 = probs(prompt + [a, b])
            exact.update({(a, b, c): p1[a] * p2[b] * p3[c] for c in np.flatnonzero(p3)})
    cells = list(exact)

    def fit(tokens):
        counts = np.zeros(len(cells) + 1)
        for row in map(tuple, tokens.tolist()):
            counts[cells.index(row) if row in exact else -1] += 1
        return goodness_of_fit(counts, np.array([*exact.values(), 0.0]))

    fit.cells = cells
    return params, fit
