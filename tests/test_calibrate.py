"""GPU precisions made here (calibrate/): fp16 cast graphs, FP8 and SmoothQuant INT8 Q/DQ graphs from
NVIDIA ModelOpt, calibrated with the runtime's shapes and real past KV, gated against fp32 in ONNX
Runtime CPU, decoded losslessly, and benched as accuracy-only rows.

One build per module: the session's tiny llama build (target + draft, fp32) copied, with the GPU
precisions added, so only the new stages run. Random tiny weights give nearly flat distributions where
argmax flips easily: the gates here are loose on purpose; the real-model figures are in the notes.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

import specexport
from specexport.quant import fp16 as fp16_pass
from specexport.quant.feeds import PHASES, runtime_feeds, split_point
from specexport.quant.quality import runtime_session, sampled_sequences
from specexport.export.to_onnx import check_graph_io
from specexport.io_spec import ModelIO
from specexport.manifest import read_manifest

pytest.importorskip("modelopt.onnx.quantization")

GPU = ["fp16", "fp8", "int8_sq"]
GATES = {"fp16": {"min_top1": 0.95, "max_kl": 0.001}, "fp8": {"min_top1": 0.5, "max_kl": 0.1},
         "int8_sq": {"min_top1": 0.5, "max_kl": 0.1}}
PROMPTS = ["def fib(n):", "import os\nclass A:"]


def _fp32(out: Path, role: str = "target") -> tuple[Path, ModelIO]:
    entry = read_manifest(out)["models"][role]
    return out / entry["precisions"]["fp32"]["dir"] / "model.onnx", ModelIO.from_dict(entry["io"])


@pytest.fixture(scope="module")
def gpu_fields(built_llama, tiny_checkpoints, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu") / "out"
    shutil.copytree(built_llama, out)
    return dict(name="tiny-llama", target={"path": tiny_checkpoints["llama"]},
                draft={"path": tiny_checkpoints["llama-draft"]}, max_seq_len=128, precisions=GPU,
                quality_gates=GATES, output=out)


@pytest.fixture(scope="module")
def built_gpu(gpu_fields, write_yaml, run_build, tmp_path_factory) -> Path:
    assert run_build(write_yaml(tmp_path_factory.mktemp("gpu-yaml") / "model.yaml", **gpu_fields)) == 0
    return gpu_fields["output"]


# -- calibration feeds ---------------------------------------------------------------------------

def test_calibration_feeds_carry_the_fp32_graphs_real_past_kv(built_llama):
    path, io = _fp32(built_llama)
    session = runtime_session(path)
    seqs = sampled_sequences(session, io, start=1, length=40, count=3, seed=3)
    feeds, record = runtime_feeds(session, io, seqs, verify_tokens=5)
    assert record["phases"] == {p: 3 for p in PHASES} and record["feeds"] == len(feeds) == 9
    splits = set()
    for i, ids in enumerate(seqs):
        prefill, decode, verify = feeds[3 * i:3 * i + 3]
        P = split_point(len(ids), i, 5)
        splits.add(P)
        assert prefill["input_ids"].tolist() == [ids[:P].tolist()] and prefill["past_key.0"].shape[2] == 0
        assert decode["input_ids"].shape == (1, 1) and verify["input_ids"].tolist() == [ids[P:P + 5].tolist()]
        assert decode["position_ids"].tolist() == [[P]] and verify["attention_mask"].shape == (1, 5, P + 5)
        # the past is the K/V the fp32 graph wrote for the prefill, not zeros
        outs = dict(zip(io.output_names, session.run(None, prefill)))
        for name, present in zip(io.past_input_names, io.presents(outs)):
            assert decode[name].shape == (1, io.num_kv_heads, P, io.head_dim)
            np.testing.assert_array_equal(decode[name], present)
            np.testing.assert_array_equal(verify[name], present)
            assert np.abs(decode[name]).max() > 0
    assert len(splits) == 3, "the split point should move between sequences"
    assert split_point(5, 0, 5) is None and 10 <= split_point(40, 1, 5) <= 35


# -- the fp16 pass --------------------------------------------------------------------------------

def test_fp16_graph_keeps_the_io_table_attention_and_rotary_angles_in_fp32(built_llama, tmp_path, monkeypatch):
    path, io = _fp32(built_llama)

    def convert(name: str) -> Path:
        dest = tmp_path / name / "model.onnx"
        dest.parent.mkdir()
        onnx.save(fp16_pass.to_fp16(onnx.load(str(path))), str(dest), save_as_external_data=True,
                  location="model.onnx.data")
        return dest

    dest = convert("fp16")
    check_graph_io(dest, io)                                     # fp32 IO, names and axes unchanged
    model = onnx.load(str(dest), load_external_data=False)
    weights = {i.name: i.data_type for i in model.graph.initializer}
    matmul_weights = [weights[n.input[1]] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert matmul_weights and set(matmul_weights) == {onnx.TensorProto.FLOAT16}
    assert (dest.parent / "model.onnx.data").stat().st_size < 0.6 * (path.parent / "model.onnx.data").stat().st_size
    assert [n.op_type for n in model.graph.node].count("GroupQueryAttention") == io.num_layers
    assert not [n.name for n in model.graph.node if n.op_type == "Cast" and n.input[0] in io.past_input_names]

    # the rotary angles (position x inv_freq -> Cos/Sin) stay fp32: at position 3000 fp16's resolution is 2.
    # Checked on the graph's types: ONNX Runtime on CPU computes fp16 Mul/MatMul chains in fp32 (its
    # inserted casts), so its numbers would not show the planted bug; TensorRT follows the types.
    def angle_types(graph: Path) -> set:
        """The float types upstream of Cos/Sin."""
        m = onnx.load(str(graph), load_external_data=False)
        types = fp16_pass.tensor_types(m)
        producers = {o: n for n in m.graph.node for o in n.output}
        names, stack = set(), [i for n in m.graph.node if n.op_type in ("Cos", "Sin") for i in n.input]
        while stack:
            name = stack.pop()
            if name in producers and name not in names:
                names.add(name)
                stack.extend(producers[name].input)
        return {types[n] for n in names} - {onnx.TensorProto.INT64}

    assert angle_types(dest) == {onnx.TensorProto.FLOAT}
    monkeypatch.setattr(fp16_pass, "ANGLE_OPS", ())          # the planted bug: angles computed in fp16
    assert angle_types(convert("fp16-angles")) == {onnx.TensorProto.FLOAT16}
    feeds = io.feeds(np.arange(3, 11)[None], positions=1000 + np.arange(8))
    ref = runtime_session(path).run(["logits"], feeds)[0]
    got = runtime_session(dest).run(["logits"], feeds)[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 5e-3


def test_cpu_emulation_of_an_fp16_graph_rounds_and_overflows_like_fp16():
    """ORT on CPU computes an fp16 Mul feeding an fp16 Add in fp32 (no rounding in between, no overflow);
    the emulation rounds each fp16 node's output, as the GPU does."""
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper as h

    # as the fp16 pass writes graphs: fp32 IO, cast to fp16 after the inputs and back before the output
    nodes = [h.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16), h.make_node("Cast", ["z"], ["z16"], to=T.FLOAT16),
             h.make_node("Mul", ["x16", "w"], ["t"]), h.make_node("Add", ["t", "z16"], ["y16"]),
             h.make_node("Cast", ["y16"], ["y"], to=T.FLOAT)]
    w = np.array([1 + 2 ** -10, 300], np.float16)
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info(n, T.FLOAT, [2]) for n in "xz"],
                         [h.make_tensor_value_info("y", T.FLOAT, [2])], initializer=[onnx.numpy_helper.from_array(w, "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)])
    model.ir_version = 10
    x, z = np.array([1.5, 300], np.float32), np.array([-1.5, -60000], np.float32)
    with np.errstate(over="ignore"):
        fp16 = ((x.astype(np.float16) * w).astype(np.float16) + z.astype(np.float16)).astype(np.float16)

    def run(m):
        s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return s.run(None, {"x": x, "z": z})[0].astype(np.float64)

    upcast = run(model)
    assert upcast[0] == pytest.approx(1.5 * 2 ** -10) and np.isfinite(upcast[1])    # what ORT CPU computes
    emulated = run(fp16_pass.emulate(model))
    assert emulated[0] == fp16[0] == 2 ** -9 and np.isinf(emulated[1]) and np.isinf(fp16[1])


def test_the_plugin_graph_passes_the_parity_gate_against_pytorch(built_llama, tiny_checkpoints, tmp_path):
    """attention as the tree-attention plugin node, run in ONNX Runtime with the node computed by the
    numpy reference: the same phases (prefill, decode, a random tree) as the exported graph's gate."""
    from specexport.export.to_onnx import load_hf_model
    from specexport.export.validate import compare, onnx_logits, parity_case, reference_logits
    from specexport.trt.plugin_graph import cpu_session, write_plugin_graph

    path, io = _fp32(built_llama)
    folder = tmp_path / "fp32"
    shutil.copytree(path.parent, folder)
    trt = write_plugin_graph(folder / "model.onnx", folder / "trt.onnx", head_dim=io.head_dim)
    assert trt.stat().st_size < (folder / "model.onnx").stat().st_size + 4096       # weights shared, not copied
    case = parity_case(io, max_seq_len=128, max_verify_tokens=16)
    reference = reference_logits(load_hf_model(tiny_checkpoints["llama"]), case)
    report = compare(reference, onnx_logits(None, io, case, session=cpu_session(trt)))
    assert report.max_rel_error < 1e-4 and set(report.per_phase) == {"prefill", "prefill_last", "decode", "tree"}

    # the build's exact check of the rewrite (fp32, parity_tolerance) catches a wiring error
    wrong = onnx.load(str(trt))
    for node in wrong.graph.node:
        if node.op_type == "tree_attention":                  # the planted bug: K and V swapped
            node.input[1], node.input[2] = node.input[2], node.input[1]
    source = onnx_logits(path, io, case)
    assert compare(source, onnx_logits(None, io, case, session=cpu_session(wrong))).max_rel_error > 1e-2


def test_activation_quantized_graphs_pad_one_row_calls_at_any_difference():
    from specexport.quant.quality import min_tokens_for

    for scheme in ("modelopt", "smoothquant", "static_qdq"):
        assert min_tokens_for({"one_token": 1e-6, "two_tokens": 0.0}, scheme) == 2
        assert min_tokens_for({"one_token": 0.0, "two_tokens": 0.0}, scheme) == 1
    assert min_tokens_for({"one_token": 1e-6, "two_tokens": 0.0}, "matmulnbits") == 1
    assert min_tokens_for({"one_token": 1e-3, "two_tokens": 0.0}, "cast") == 2


def test_what_stays_unquantized(built_llama):
    from specexport.quant.ptq import kept_high_precision

    path, io = _fp32(built_llama)
    model = onnx.load(str(path), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    lm_head = [n.name for n in model.graph.node if "logits" in n.output]
    assert kept_high_precision(model, {"lm_head": "fp32"}) == lm_head
    assert kept_high_precision(model, {"lm_head": "quantized"}) == []
    down = kept_high_precision(model, {"lm_head": "quantized", "keep": "mlp_down"})
    assert len(down) == io.num_layers
    for name in down:            # each reads act(gate) * up, whose left factor is the activation
        node = next(n for n in model.graph.node if n.name == name)
        gated = producer[node.input[0]]
        assert gated.op_type == "Mul" and any(producer[i].op_type in ("Mul", "Sigmoid") for i in gated.input)


# -- builds ---------------------------------------------------------------------------------------

def test_gpu_precisions_build_with_their_gates_calibration_and_qdq_recorded(built_gpu):
    manifest = read_manifest(built_gpu)
    for role in ("target", "draft"):
        model = manifest["models"][role]
        assert list(model["precisions"]) == ["fp32", *GPU]
        io = ModelIO.from_dict(model["io"])
        for precision in GPU:
            e = model["precisions"][precision]
            assert e["quality_gate"] == GATES[precision]
            assert GATES[precision]["min_top1"] <= e["top1_agreement"] and e["mean_kl"] <= GATES[precision]["max_kl"]
            assert e["row_dependence"]["two_tokens"] < 1e-4
            graph = built_gpu / e["dir"] / "model.onnx"
            check_graph_io(graph, io)
            nodes = onnx.load(str(graph), load_external_data=False).graph
            inits = {i.name: i.data_type for i in nodes.initializer}
            q = e["quantization"]
            plugin = e["plugin_graph"]             # the graph TensorRT engines are built from
            assert plugin["file"] == "trt.onnx" and plugin["rewrite_check_fp32_max_rel_error"] < 1e-5
            assert plugin["vs_source_top1_agreement"] > 0.95 and plugin["vs_source_max_rel_error"] < 1e-3
            assert f"{e['dir']}/trt.onnx" in e["files"]
            check_graph_io(built_gpu / e["dir"] / "trt.onnx", io)
            trt = onnx.load(str(built_gpu / e["dir"] / "trt.onnx"), load_external_data=False).graph
            plugins = [n for n in trt.node if n.op_type == "tree_attention"]
            assert len(plugins) == io.num_layers and not any(n.op_type == "GroupQueryAttention" for n in trt.node)
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in plugins[0].attribute}
            assert attrs["plugin_namespace"] == b"specexport" and attrs["aot"] == 1
            assert attrs["num_kv_heads"] == io.num_kv_heads
            if precision == "fp16":
                assert q["scheme"] == "cast" and e["ort_optimization"] == "all" and e["cpu_graph"] == "cpu.onnx"
                assert {f"{e['dir']}/cpu.onnx", f"{e['dir']}/model.onnx"} <= set(e["files"])
                check_graph_io(built_gpu / e["dir"] / "cpu.onnx", io)
                continue
            calibration = q["calibration"]
            assert calibration["phases"] == {"prefill": 8, "decode": 8, "verify": 8} and calibration["sequences"] == 8
            assert calibration["source"] == "sampled from the fp32 graph" and "modelopt" in q["tool"]
            assert q["lm_head"] == "fp32" and q["modelopt_version"]
            assert e["ort_optimization"] == "basic"
            dtype = onnx.TensorProto.FLOAT8E4M3FN if precision == "fp8" else onnx.TensorProto.INT8
            producers = {o: n for n in nodes.node for o in n.output}
            for n in nodes.node:
                if n.op_type != "MatMul":
                    continue
                w = producers.get(n.input[1])
                if "logits" in n.output:                        # the lm_head stays fp32
                    assert w is None or w.op_type != "DequantizeLinear"
                else:                                           # every other weight is stored quantized
                    assert w is not None and w.op_type == "DequantizeLinear" and inits[w.input[0]] == dtype
            if precision == "int8_sq":
                assert q["smooth_alpha"] == 0.5
    assert [p.name for p in built_gpu.rglob("*") if "partial" in p.name or "-ptq" in p.name] == []


@pytest.mark.parametrize("precision", GPU)
def test_greedy_speculative_equals_vanilla_on_each_gpu_precision(built_gpu, precision):
    with specexport.load(built_gpu, precision=precision) as pipe:
        for prompt in PROMPTS:
            vanilla = pipe.generate(prompt, max_new_tokens=40, method="vanilla").token_ids
            for gamma in (1, 3):
                assert pipe.generate(prompt, max_new_tokens=40, method="draft", gamma=gamma).token_ids == vanilla


def test_a_failing_fp8_gate_fails_the_build_and_names_it(built_gpu, gpu_fields, write_yaml, run_build, tmp_path,
                                                         capsys):
    out = tmp_path / "out"
    shutil.copytree(built_gpu, out)
    before = json.loads((out / "manifest.json").read_text())
    capsys.readouterr()
    gates = {**GATES, "fp8": {"min_top1": 0.5, "max_kl": 0.0}}
    code = run_build(write_yaml(tmp_path / "model.yaml", **{**gpu_fields, "output": out, "quality_gates": gates}))
    assert code == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("error:"))
    assert "fp8: quality gate against fp32 failed" in line and "quality_gates.fp8" in line
    assert re.search(r"mean KL \d\.\d{4} > max_kl 0\.0000", line), line
    assert json.loads((out / "manifest.json").read_text()) == before       # the previous build stands


def test_bench_reports_gpu_precisions_as_accuracy_only_with_their_acceptance(built_gpu, tmp_path):
    from specexport.report.bench import BenchConfig, run_bench
    from specexport.report.render import render_markdown

    cfg = BenchConfig(output_dir=built_gpu, prompts=tuple(PROMPTS), precisions=("fp32", "fp8"),
                      methods=("vanilla", "draft"), gammas=(3,), max_new_tokens=24, rounds=1, peers=False,
                      plots=False, out=tmp_path / "bench")
    report = run_bench(cfg, log=lambda m: None)
    rows = {(r["precision"], r["draft_precision"], r["method"]): r for r in report["rows"]}
    fp8 = rows[("fp8", "fp8", "draft")]
    assert fp8["accuracy_only"] and fp8["tokens_per_s"] is None and fp8["speedup_vs_vanilla"] is None
    assert 0 <= fp8["acceptance_rate"] <= 1 and fp8["mean_accepted_tokens"] >= 1
    assert rows[("fp32", "fp32", "draft")]["tokens_per_s"] > 0 and not rows[("fp32", "fp32", "draft")]["accuracy_only"]
    drop = {(d["target"], d["draft"]): d for d in report["acceptance_drop"]}
    assert drop[("fp8", "fp8")]["tokens_per_pass"] == fp8["mean_accepted_tokens"]
    assert "fp8/fp8" not in report["gamma_auto"]                     # no γ choice from emulated timings
    assert not [k for k in report["method_auto"] if "fp8" in k]      # nor a method choice
    markdown = render_markdown(report)
    assert "accuracy only" in markdown and "| -x |" not in markdown


def test_without_modelopt_fp8_is_refused_in_one_line_before_any_work(gpu_fields, write_yaml, tmp_path, monkeypatch,
                                                                     capsys):
    import importlib.util

    from specexport.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "modelopt" else real(name, *a))
    path = write_yaml(tmp_path / "model.yaml", **{**gpu_fields, "output": tmp_path / "out"})
    capsys.readouterr()
    assert main(["build", str(path)]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "fp16, fp8, int8_sq need NVIDIA ModelOpt" in err[0] and "specexport[quant]" in err[0]
    assert not (tmp_path / "out").exists()
