"""Heads on our kernels (quant/graph_blocks.py, builder/stages/head_blocks.py): an fp32 graph's weights as
Q8_0 blocks (GgufMatMul / GgufGather, our attention).

- An EAGLE-3 head: the exact twin equals the published head in PyTorch run on the blocks' dequantized
  weights (float noise), and is measurably off the fp32 head (the blocks are real); every weight moved
  to blocks; the deployed head (int8 activations) proposes the fp32 head's top-1 almost everywhere.
- A weight whose rows are not whole blocks stays fp32 and is named.
- Medusa heads (own projections and the target's lm_head): the twin equals Medusa's own structure on
  the dequantized weights.
- A planted quantizer bug (blocks of another scale) fails the twin's parity.
The build and the runtime (a target on the kernels gets its heads' q8_0 stage; batched EAGLE requests
equal their lone answers on it) are in test_batch.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def kernels():
    from specexport.plugins import cpu

    if not cpu.status().available:
        from machine import kernels_missing

        kernels_missing(cpu.status().line())
    return cpu


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory, kernels):
    """An EAGLE-3 head (test_eagle's, H 32, draft vocabulary 40) exported, and its two block graphs."""
    from specexport.quant.graph_blocks import to_blocks
    from test_eagle import V, export_eagle3

    root = tmp_path_factory.mktemp("head-blocks")
    w, embed, io, _ = export_eagle3(root)
    made = to_blocks(root / "model.onnx", root / "q8.onnx")
    to_blocks(root / "model.onnx", root / "twin.onnx", exact=True)
    rng = np.random.default_rng(1)
    case = {"seq": rng.integers(0, V, 20), "target_states": rng.normal(size=(19, io.feature_width)).astype(np.float32)}
    case["sequences"] = [(rng.integers(0, V, 65), rng.normal(size=(64, io.feature_width)).astype(np.float32))
                         for _ in range(3)]
    return {"w": w, "io": io, "embed": embed, "root": root, "made": made, "case": case}


def _ops(path):
    import onnx

    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_eagle_twin_equals_the_head_on_its_dequantized_weights(eagle3):
    from types import SimpleNamespace

    from specexport.builder.stages.head_blocks import eagle_checks
    from specexport.heads.eagle_graph import head_parity
    from specexport.quant.quality import runtime_session

    e, root = eagle3, eagle3["root"]
    assert e["made"]["kept_fp32"] == [] and len(e["made"]["replaced"]) >= 9
    ops = _ops(root / "q8.onnx")
    assert "MatMul" not in ops and "GgufGather" in ops and ops.count("GgufMatMul") + ops.count("GgufMatMulN") >= 4
    checks = eagle_checks(SimpleNamespace(weights=e["w"], io=e["io"]), e["embed"], None, case=e["case"])
    twin = root / "twin.onnx"
    good = checks["parity"](twin, runtime_session(twin))
    assert good["max_rel_error"] < 1e-4 and set(good["per_phase"]) == {"prefill", "catch_up", "tree"}
    fp32 = head_parity(e["w"], e["embed"], None, io=e["io"], onnx_path=twin, tokens=e["case"]["seq"],
                       features=e["case"]["target_states"], session=runtime_session(twin))
    assert fp32["max_rel_error"] > 1e-3                  # the blocks are not the fp32 weights
    want = checks["proposals"](runtime_session(root / "model.onnx"))
    got = checks["proposals"](runtime_session(root / "q8.onnx"))
    assert want.shape == got.shape == (3 * 64,) and np.mean(want == got) >= 0.9


def test_a_planted_quantizer_bug_fails_the_twins_parity(eagle3, monkeypatch, tmp_path):
    """Blocks whose scales are 3% off (every fp16 d scaled): the twin no longer equals the dequantized head."""
    from types import SimpleNamespace

    from specexport.builder.stages.head_blocks import eagle_checks
    from specexport.quant import graph_blocks
    from specexport.quant.quality import runtime_session

    real = graph_blocks.quantized

    def off_scales(w, qtype):
        raw = real(w, qtype)
        blocks = raw.raw.reshape(raw.raw.shape[0], -1, 34).copy()        # Q8_0: fp16 d + 32 int8
        d = blocks[..., :2].copy().view(np.float16) * np.float16(1.03)
        blocks[..., :2] = d.view(np.uint8)
        return dataclasses.replace(raw, raw=blocks.reshape(raw.raw.shape))

    monkeypatch.setattr(graph_blocks, "quantized", off_scales)
    graph_blocks.to_blocks(eagle3["root"] / "model.onnx", tmp_path / "twin.onnx", exact=True)
    monkeypatch.undo()
    checks = eagle_checks(SimpleNamespace(weights=eagle3["w"], io=eagle3["io"]), eagle3["embed"], None,
                          case=eagle3["case"])
    assert checks["parity"](tmp_path / "twin.onnx", runtime_session(tmp_path / "twin.onnx"))["max_rel_error"] > 1e-3


def test_rows_that_are_not_whole_blocks_stay_fp32(kernels, tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from specexport.quant.graph_blocks import fits, to_blocks
    from specexport.quant.quality import runtime_session

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(64, 48)).astype(np.float32), rng.normal(size=(48, 16)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "a"], ["y"]), helper.make_node("MatMul", ["y", "b"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 2, 16])],
        [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / "g.onnx"))
    made = to_blocks(tmp_path / "g.onnx", tmp_path / "q.onnx", exact=True)
    assert made == {"replaced": {"a": "Q8_0"}, "kept_fp32": ["b"]} and not fits((16, 48), "Q8_0")
    x = rng.normal(size=(1, 2, 64)).astype(np.float32)
    from specexport.quant.graph_blocks import dequantized

    want = x @ dequantized(a.T, "Q8_0").T @ b
    got, = runtime_session(tmp_path / "q.onnx").run(None, {"x": x})
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("own", [True, False])
def test_medusa_twin_equals_medusa_on_its_dequantized_weights(kernels, tmp_path, own):
    from specexport.builder.stages.head_blocks import dequantized
    from specexport.heads.medusa import MedusaWeights, export_heads, heads_parity
    from specexport.io_spec import HeadsIO
    from specexport.quant.graph_blocks import to_blocks
    from specexport.quant.quality import runtime_session
    from test_medusa import random_heads

    rng = np.random.default_rng(3)
    H, V, N = 64, 96, 3
    blocks, projections = random_heads(rng, H, V, N, L=2, own=own)
    w = MedusaWeights(tmp_path / "x", "medusa-1", tuple(tuple(b) for b in blocks), tuple(projections), None)
    lm_head = None if own else rng.normal(size=(V, H)).astype(np.float32)
    io = HeadsIO(hidden_size=H, num_heads=N, top_k=4)
    export_heads(w, lm_head, io, onnx_path=tmp_path / "model.onnx")
    made = to_blocks(tmp_path / "model.onnx", tmp_path / "twin.onnx", exact=True)
    assert len(made["replaced"]) == N * 2 + (N if own else 1) and "MatMul" not in _ops(tmp_path / "twin.onnx")
    deq = dataclasses.replace(w, blocks=tuple(tuple((dequantized(a), b) for a, b in bl) for bl in w.blocks),
                              projections=tuple(None if p is None else dequantized(p) for p in w.projections))
    hidden = rng.normal(size=(10, H)).astype(np.float32)
    twin = runtime_session(tmp_path / "twin.onnx")
    lm = None if lm_head is None else dequantized(lm_head)
    assert heads_parity(deq, lm, io, onnx_path=tmp_path / "twin.onnx", hidden=hidden,
                        session=twin)["max_rel_error"] < 1e-4
    assert heads_parity(w, lm_head, io, onnx_path=tmp_path / "twin.onnx", hidden=hidden,
                        session=twin)["max_rel_error"] > 1e-4
