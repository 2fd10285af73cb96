"""int8 / int4 builds on ONNX Runtime CPU: quantized from fp32, gated against it, decoded losslessly.

One module build (tiny llama target + 1-layer draft, fp32 + int8 + int4 for both) is exported once; the
other builds copy it, so their fp32 stages are reused and only the quantized stages run. Random tiny
weights have nearly flat next-token distributions, so int4 agrees with fp32 far less than a trained
model does: the gates here are loose on purpose.
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
from specexport.cli import main
from specexport.config import DEFAULT_QUALITY_GATES, load_config
from specexport.errors import SpecexportError
from specexport.builder.plan import plan_build
from specexport.quant.quality import QualityReport, text_sequences
from specexport.export.to_onnx import check_graph_io
from specexport.io_spec import ModelIO
from specexport.manifest import file_problems, listed_files, read_manifest, sha256_file

GATES = {"int8": {"min_top1": 0.8, "max_kl": 0.01}, "int4": {"min_top1": 0.4, "max_kl": 0.1}}
PROMPTS = ["def fib(n):", "import os\nclass A:"]
STOCK = {"int8": {"scheme": "matmulnbits"}, "int4": {"scheme": "matmulnbits"}}


@pytest.fixture(scope="module")
def quant_fields(tiny_checkpoints, tmp_path_factory) -> dict:
    return dict(name="tiny-quant", target={"path": tiny_checkpoints["llama"]},
                draft={"path": tiny_checkpoints["llama-draft"]}, max_seq_len=128, precisions=["int8", "int4"],
                quality_gates=GATES, output=tmp_path_factory.mktemp("quant") / "out",
                quantization=STOCK)   # the MatMulNBits schemes (blocks, the default: tests/test_blocks.py)


@pytest.fixture(scope="module")
def built_quant(quant_fields, write_yaml, run_build, tmp_path_factory) -> Path:
    path = write_yaml(tmp_path_factory.mktemp("quant-yaml") / "model.yaml", **quant_fields)
    assert run_build(path) == 0
    return quant_fields["output"]


@pytest.fixture
def rebuild(built_quant, quant_fields, write_yaml, run_build, tmp_path):
    """rebuild(**changes) -> (exit code, output): the module build copied to tmp_path, rebuilt with changes."""
    out = tmp_path / "out"
    shutil.copytree(built_quant, out)

    def run(**changes):
        fields = {**quant_fields, "output": out, **changes}
        return run_build(write_yaml(tmp_path / "model.yaml", **fields)), out

    return run


def mtimes(out: Path) -> dict:
    """{"role/precision": (stage folder, mtime of its model.onnx)} of the current build."""
    models = read_manifest(out)["models"]
    return {f"{role}/{p}": (e["dir"], (out / e["dir"] / "model.onnx").stat().st_mtime_ns)
            for role, m in models.items() for p, e in m["precisions"].items()}


# -- building ------------------------------------------------------------------------------------

def test_quantized_builds_pass_their_gates_and_record_the_figures(built_quant):
    manifest = read_manifest(built_quant)
    for role in ("target", "draft"):
        model = manifest["models"][role]
        assert list(model["precisions"]) == ["fp32", "int8", "int4"]
        assert model["precisions"]["fp32"]["parity_reference"] == "pytorch"
        io = ModelIO.from_dict(model["io"])
        for precision, bits in (("int8", 8), ("int4", 4)):
            e = model["precisions"][precision]
            gate = GATES[precision]
            assert e["quality_gate"] == gate
            assert gate["min_top1"] <= e["top1_agreement"] <= 1 and 0 <= e["mean_kl"] <= gate["max_kl"]
            assert e["quality_text"]["source"] == "sampled" and "fp32 graph" in e["quality_text"]["description"]
            assert e["quality_text"]["sequences"] == 4 and e["quality_text"]["positions"] == 4 * 128
            assert e["parity_reference"] == "fp32" and e["parity_tolerance"] is None
            assert 0 < e["parity_max_rel_error"] < 1 and set(e["parity_per_phase"]) == {"prefill", "prefill_last", "decode", "tree"}
            assert e["quantization"]["bits"] == bits and e["quantization"]["accuracy_level"] == 4
            assert e["quantization"]["block_size"] == 32
            assert e["dir"].startswith(f"{role}/{precision}-")
            assert set(e["files"]) == {f"{e['dir']}/model.onnx", f"{e['dir']}/model.onnx.data"}
            for rel, meta in e["files"].items():
                assert sha256_file(built_quant / rel) == meta["sha256"]
            graph_path = built_quant / e["dir"] / "model.onnx"
            check_graph_io(graph_path, io)                         # the IO table is unchanged
            ops = [n for n in onnx.load(str(graph_path), load_external_data=False).graph.node]
            nbits = [n for n in ops if n.op_type == "MatMulNBits"]
            assert nbits and not any(n.op_type == "MatMul" for n in ops)
            assert all(a.i == bits for n in nbits for a in n.attribute if a.name == "bits")
        # quantized graphs are smaller than fp32
        sizes = {p: model["precisions"][p]["size_bytes"] for p in ("fp32", "int8", "int4")}
        assert sizes["int4"] < sizes["int8"] < sizes["fp32"]
    assert [p.name for p in built_quant.rglob("*") if ".partial" in p.name] == []


def test_impossible_gate_fails_with_exit_2_the_figures_and_keeps_the_previous_build(rebuild, capsys):
    capsys.readouterr()
    code, out = rebuild(quality_gates={**GATES, "int4": {"min_top1": 1.0, "max_kl": 0.0}})
    assert code == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("error:"))
    assert "target int4: quality gate against fp32 failed" in line
    assert re.search(r"top-1 agreement 0\.\d{3} < min_top1 1\.000", line), line
    assert re.search(r"mean KL \d\.\d{4} > max_kl 0\.0000", line), line
    assert "quality_gates.int4" in line and "Traceback" not in err
    manifest = json.loads((out / "manifest.json").read_text())     # the previous build, untouched and whole
    assert manifest["models"]["target"]["precisions"]["int4"]["quality_gate"] == GATES["int4"]
    assert not file_problems(out, listed_files(manifest), hashes=True)
    on_disk = {f"{role}/{p.name}" for role in ("target", "draft") for p in (out / role).iterdir()}
    assert on_disk == {e["dir"] for m in manifest["models"].values() for e in m["precisions"].values()}
    assert [p.name for p in out.rglob("*") if ".partial" in p.name] == []


def test_rerun_reuses_each_role_and_precision_and_a_new_gate_redoes_only_that_one(rebuild):
    code, out = rebuild()
    before = mtimes(out)
    assert len(before) == 6
    assert code == 0 and mtimes(out) == before, "an unchanged stage was rebuilt"

    code, _ = rebuild(quality_gates={**GATES, "int4": {"min_top1": 0.3, "max_kl": 0.1}})
    assert code == 0
    changed = {k for k, v in mtimes(out).items() if v != before[k]}
    assert changed == {"target/int4", "draft/int4"}
    manifest = read_manifest(out)
    assert manifest["models"]["draft"]["precisions"]["int4"]["quality_gate"] == {"min_top1": 0.3, "max_kl": 0.1}


def test_eval_text_is_used_and_recorded_and_the_summary_shows_the_figures(rebuild, tmp_path, capsys):
    text = tmp_path / "heldout.txt"
    text.write_text(json.__doc__ * 3)
    capsys.readouterr()
    code, out = rebuild(eval_text=str(text))
    assert code == 0
    summary = capsys.readouterr().out
    manifest = read_manifest(out)
    for role in ("target", "draft"):
        for precision in ("int8", "int4"):
            e = manifest["models"][role]["precisions"][precision]
            assert e["quality_text"]["source"] == "eval_text" and e["quality_text"]["path"] == str(text)
            assert e["quality_text"]["tokens"] > 4 * 128 and e["quality_text"]["positions"] == 4 * 128
            assert f"{e['top1_agreement']:.3f}" in summary and f"{e['mean_kl']:.4f}" in summary
    assert "eval_text heldout.txt" in summary.replace("\n", " ")

    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    e = manifest["models"]["target"]["precisions"]["int4"]
    assert "int4" in shown and f"{e['top1_agreement']:.3f}" in shown and f"{e['mean_kl']:.4f}" in shown


# -- decoding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision, draft_precision", [
    ("int8", None), ("int4", None), ("int4", "fp32"), ("int4", "int8"), ("fp32", "int4")])
def test_greedy_speculative_equals_vanilla_on_the_same_precision(built_quant, precision, draft_precision):
    with specexport.load(built_quant, precision=precision, draft_precision=draft_precision) as pipe:
        assert pipe.draft_precision == (draft_precision or precision)
        for prompt in PROMPTS:
            vanilla = pipe.generate(prompt, max_new_tokens=100, method="vanilla").token_ids
            for gamma in (1, 3, 6):
                out = pipe.generate(prompt, max_new_tokens=100, method="draft", gamma=gamma)
                assert out.token_ids == vanilla, (prompt, gamma)


def test_quantized_graph_computes_each_row_independently(built_quant):
    """Lossless verification needs a token's logits not to depend on the other tokens of the call."""
    from specexport.quant.quality import prefill_logits, runtime_session

    manifest = read_manifest(built_quant)
    io = ModelIO.from_dict(manifest["models"]["target"]["io"])
    ids = np.arange(3, 13)
    for precision in ("int8", "int4"):
        session = runtime_session(built_quant / manifest["models"]["target"]["precisions"][precision]["dir"] / "model.onnx")
        full = prefill_logits(session, io, ids)                          # [10, V]
        alone = prefill_logits(session, io, ids[:4])                     # [4, V]: same prefix, fewer rows
        assert np.abs(full[:4] - alone).max() <= 1e-4 * np.abs(full).max(), precision


def test_quantization_schemes_build_are_recorded_and_decode_losslessly(rebuild, quant_fields):
    """static QDQ for the targets' int8 (SmoothQuant, percentile calibration on sequences the gate never
    sees, lm_head left fp32), dynamic int8 for the draft (its rows may depend on each other: only a
    target's must not), a MatMulNBits option for int4."""
    draft = {**quant_fields["draft"], "quantization": {"int8": {"scheme": "dynamic"}}}
    static = {"scheme": "static_qdq", "smooth_alpha": 0.5, "calibrate": "percentile", "lm_head": "fp32"}
    code, out = rebuild(quantization={"int8": static, "int4": {"scheme": "matmulnbits", "block_size": 128}}, draft=draft,
                        quality_gates={**GATES, "int8": {"min_top1": 0.6, "max_kl": 0.05}})
    assert code == 0
    models = read_manifest(out)["models"]
    target, drafted = models["target"]["precisions"], models["draft"]["precisions"]
    assert target["int8"]["quantization"]["scheme"] == "static_qdq"
    assert target["int8"]["quantization"]["calibration"] == {"method": "Percentile", "CalibPercentile": 99.999,
                                                             "sequences": 8, "smoothquant_alpha": 0.5, "seed": 1,
                                                             "source": "sampled from the fp32 graph"}
    assert target["int8"]["row_dependence"]["two_tokens"] <= 1e-4 and target["int8"]["quantization"]["row_independent"]
    assert target["int8"]["min_tokens"] == 1                         # static Q/DQ: one-row passes agree too
    assert target["int4"]["quantization"]["block_size"] == 128 and drafted["int4"]["quantization"]["block_size"] == 128
    assert drafted["int8"]["quantization"]["scheme"] == "dynamic" and not drafted["int8"]["quantization"]["row_independent"]
    assert drafted["int8"]["row_dependence"]["two_tokens"] > 1e-4   # measured, and allowed for a draft
    assert drafted["int8"]["min_tokens"] == 1

    def ops(entry):
        return {n.op_type for n in onnx.load(str(out / entry["dir"] / "model.onnx"), load_external_data=False).graph.node}

    assert {"QuantizeLinear", "DequantizeLinear"} <= ops(target["int8"]) and "MatMulNBits" not in ops(target["int8"])
    graph = onnx.load(str(out / target["int8"]["dir"] / "model.onnx"), load_external_data=False).graph
    made = {o: n for n in graph.node for o in n.output}
    assert made["logits"].input[1] not in made       # lm_head: its fp32 weights, no DequantizeLinear
    assert not list(out.rglob(".*.smooth"))                                 # the scratch folder is gone
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops(drafted["int8"])
    with specexport.load(out, precision="int8") as pipe:
        for prompt in PROMPTS:
            vanilla = pipe.generate(prompt, max_new_tokens=60, method="vanilla").token_ids
            for gamma in (2, 5):
                assert pipe.generate(prompt, max_new_tokens=60, method="draft", gamma=gamma).token_ids == vanilla


def test_a_target_whose_rows_depend_on_each_other_is_refused(rebuild, capsys):
    capsys.readouterr()
    code, out = rebuild(precisions=["int8"], quantization={**STOCK, "int8": {"scheme": "dynamic"}})
    assert code == 2
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    assert "target int8 (dynamic): a token's logits depend on the other tokens of the same pass" in line
    assert read_manifest(out)["models"]["target"]["precisions"]["int8"]["quantization"]["scheme"] == "matmulnbits"


def test_per_model_precisions_and_clear_runtime_errors(rebuild, quant_fields, capsys):
    code, out = rebuild(draft={**quant_fields["draft"], "precisions": ["int4"]})
    assert code == 0
    models = read_manifest(out)["models"]
    assert list(models["target"]["precisions"]) == ["fp32", "int8", "int4"]
    assert list(models["draft"]["precisions"]) == ["fp32", "int4"]

    pipe = specexport.load(out, precision="int8")
    assert pipe.generate(PROMPTS[0], max_new_tokens=4, method="vanilla").token_ids
    with pytest.raises(SpecexportError, match=r"draft_precision: 'int8' was not built for the draft; "
                                              r"built: fp32, int4 \(draft_precision defaults to precision"):
        pipe.generate(PROMPTS[0], max_new_tokens=4, method="draft")
    with pytest.raises(SpecexportError, match=r"precision: 'int2' was not built for the target; built: fp32, int8"):
        specexport.load(out, precision="int2")

    capsys.readouterr()
    assert main(["generate", str(out), "def", "--method", "draft", "--precision", "int8", "--draft-precision", "int4",
                 "--max-new-tokens", "6"]) == 0
    assert main(["generate", str(out), "def", "--method", "draft", "--precision", "int8", "--max-new-tokens", "6"]) == 1
    assert "error: draft_precision: 'int8' was not built for the draft" in capsys.readouterr().err


# -- config --------------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, match, key", [
    (lambda f: f.update(precisions=["bf16"]), r"precisions: 'bf16' is not supported; supported: fp32, int8, int4, fp16, fp8, int8_sq",
     "precisions"),
    (lambda f: f["target"].update(precisions=["int3"]), r"target\.precisions: 'int3' is not supported",
     "target.precisions"),
    (lambda f: f.update(quality_gates={"int8": {"min_top": 0.9}}),
     r"quality_gates\.int8\.min_top: unknown key; allowed: min_top1, max_kl", "quality_gates.int8.min_top"),
    (lambda f: f.update(quality_gates={"fp32": {"min_top1": 0.9}}),
     r"quality_gates\.fp32: unknown key; allowed: int8, int4, fp16, fp8, int8_sq, gguf \(fp32 is gated against PyTorch", "quality_gates.fp32"),
    (lambda f: f.update(quality_gates={"int4": {"min_top1": 2}}),
     r"quality_gates\.int4\.min_top1: expected a number in 0\.\.1", "quality_gates.int4.min_top1"),
    (lambda f: f.update(quality_gates={"int4": {"max_kl": -1}}), r"quality_gates\.int4\.max_kl: expected a number >= 0",
     "quality_gates.int4.max_kl"),
    (lambda f: f.update(quality_gates=[0.9]), r"quality_gates: expected a mapping", "quality_gates"),
    (lambda f: f.update(eval_text="missing.txt"), r"eval_text: missing\.txt does not exist", "eval_text"),
    (lambda f: f.update(eval_text=5), r"eval_text: expected a text file path", "eval_text"),
    (lambda f: f.update(quantization={"int4": {"scheme": "dynamic"}}),
     r"quantization\.int4\.scheme: 'dynamic' cannot make int4; supported: matmulnbits", "quantization.int4.scheme"),
    (lambda f: f.update(quantization={"int8": {"scheme": "matmulnbits", "block_size": 100}}),
     r"quantization\.int8\.block_size: expected one of 16, 32, 64, 128, 256, got 100", "quantization.int8.block_size"),
    (lambda f: f["target"].update(quantization={"int8": {"scheme": "static_qdq", "accuracy_level": 4}}),
     r"target\.quantization\.int8\.accuracy_level: unknown key for scheme static_qdq", "target.quantization.int8"),
], ids=["precision", "model-precision", "gate-key", "gate-fp32", "gate-top1", "gate-kl", "gate-type",
        "eval-missing", "eval-type", "scheme-precision", "scheme-option", "scheme-key"])
def test_config_errors(tiny_checkpoints, tmp_path, write_yaml, capsys, edit, match, key):
    fields = dict(name="q", target={"path": tiny_checkpoints["llama"]}, max_seq_len=64, output=tmp_path / "out")
    edit(fields)
    check_one_line_error(write_yaml(tmp_path / "model.yaml", **fields), match, key, capsys)


def test_eval_text_too_short_is_refused_before_any_work(tiny_checkpoints, tmp_path, write_yaml, capsys):
    (tmp_path / "short.txt").write_text("x = 1")
    path = write_yaml(tmp_path / "model.yaml", name="q", target={"path": tiny_checkpoints["llama"]},
                      max_seq_len=64, eval_text="short.txt", output=tmp_path / "out")
    check_one_line_error(path, r"eval_text: .*short\.txt has \d+ tokens; the quality gate needs at least 16",
                         "eval_text", capsys)
    assert not (tmp_path / "out").exists()


def check_one_line_error(path: Path, match: str, key: str, capsys) -> None:
    with pytest.raises(SpecexportError, match=match) as info:
        plan_build(load_config(path))
    assert "\n" not in str(info.value) and key in str(info.value)
    capsys.readouterr()
    assert main(["build", str(path)]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(match, lines[0]), lines


def test_config_precisions_resolve_per_model_with_fp32_first(tiny_checkpoints, tmp_path, write_yaml):
    path = write_yaml(tmp_path / "model.yaml", name="q", target={"path": tiny_checkpoints["llama"]},
                      draft={"path": tiny_checkpoints["llama-draft"], "precisions": ["int4"]},
                      precisions=["int8"], max_seq_len=64, quality_gates={"int4": {"min_top1": 0.5}})
    cfg = load_config(path)
    assert cfg.precisions == ("fp32", "int8")
    assert cfg.target.precisions == ("fp32", "int8") and cfg.draft.precisions == ("fp32", "int4")
    assert cfg.quality_gates == {**DEFAULT_QUALITY_GATES, "int4": {"min_top1": 0.5, "max_kl": 0.2}}
    graphs = [(s.role, s.precision) for s in plan_build(cfg).stages() if s.precision]    # stages are values now
    assert graphs == [("target", "fp32"), ("target", "int8"), ("draft", "fp32"), ("draft", "int4")]


# -- pieces --------------------------------------------------------------------------------------

def test_text_sequences_and_gate_arithmetic():
    seqs = text_sequences(list(range(100, 400)), bos=1, length=64)
    assert len(seqs) == 4 and all(len(s) == 64 and s[0] == 1 for s in seqs)
    assert list(seqs[1][1:4]) == [163, 164, 165]                   # consecutive chunks of 63 text tokens
    short = text_sequences(list(range(20)), bos=None, length=64)
    assert len(short) == 1 and len(short[0]) == 20

    report = QualityReport(top1_agreement=0.85, mean_kl=0.06, positions=512, sequences=4)
    assert report.failures({"min_top1": 0.8, "max_kl": 0.1}) == []
    assert report.failures({"min_top1": 0.9, "max_kl": 0.05}) == [
        "top-1 agreement 0.850 < min_top1 0.900", "mean KL 0.0600 > max_kl 0.0500"]


def test_use_draft_precision_switches_the_draft_and_keeps_the_target(built_quant):
    with specexport.load(built_quant) as pipe:
        target, fp32_draft = pipe.target, pipe.draft
        pipe.use_draft_precision("int4")
        assert pipe.draft is not fp32_draft and pipe.target is target and pipe.draft_precision == "int4"
        assert pipe.draft.model_path.parent.name.startswith("int4-")
        pipe.use_draft_precision("fp32")
        assert pipe.draft is fp32_draft
        with pytest.raises(SpecexportError, match="draft_precision: 'fp8' was not built"):
            pipe.use_draft_precision("fp8")
        assert pipe.draft_precision == "fp32" and pipe.draft is fp32_draft


def test_bench_runs_each_mixed_row_with_the_draft_it_names(built_quant, tmp_path, monkeypatch):
    """fp32 target + quantized draft rows at every γ, quantized target + fp32 draft at the first γ;
    a spy on Pipeline.generate records which draft each run actually decoded with."""
    from specexport.report.bench import BenchConfig, run_bench
    from specexport.runtime.pipeline import Pipeline

    used, real = set(), Pipeline.generate

    def spy(self, prompt=None, **kwargs):
        out = real(self, prompt, **kwargs)
        if kwargs.get("method") == "draft":
            used.add((self.precision, self.draft.model_path.parent.name.split("-")[0], kwargs["gamma"]))
        return out

    monkeypatch.setattr(Pipeline, "generate", spy)
    shutil.copytree(built_quant, tmp_path / "b")
    report = run_bench(BenchConfig(output_dir=tmp_path / "b", prompts=PROMPTS[:2], gammas=(2, 3), max_new_tokens=16,
                                   rounds=1, peers=False, plots=False), log=lambda m: None)
    combos = {(r["precision"], r["draft_precision"], r["gamma"]) for r in report["rows"] if r["method"] == "draft"}
    for d in ("int8", "int4"):
        assert {("fp32", d, 2), ("fp32", d, 3), (d, "fp32", 2), (d, d, 2), (d, d, 3)} <= combos
    assert used == combos
    assert set(report["step_costs_ms"]) >= {"fp32/fp32", "fp32/int4", "int4/fp32", "fp32/-"}
    # every row of one target precision uses the same in-run target costs, whichever draft it ran with
    costs = report["step_costs_ms"]
    assert costs["fp32/fp32"]["target"] == costs["fp32/int4"]["target"] == costs["fp32/-"]["target"]
    assert set(report["gamma_auto"]) >= {"fp32/fp32", "fp32/int4", "int4/int4", "int4/fp32"}


def test_smoothquant_rewrite_is_exact_in_fp32(built_quant, tmp_path):
    """X/s @ diag(s)W = X @ W: the smoothed fp32 graph gives the original logits; norms take the 1/s
    where they can (q/k/v, gate/up inputs) and a Mul is inserted where they cannot (o_proj, down_proj,
    lm_head)."""
    from specexport.quant import smooth
    from specexport.quant.quality import runtime_session
    from specexport.manifest import stage_dir

    m = read_manifest(built_quant)
    io = ModelIO.from_dict(m["models"]["target"]["io"])
    source = stage_dir(built_quant, m, "target", "fp32") / "model.onnx"
    ids = np.array([1, 40, 41, 300, 7, 9, 12, 5], np.int64)
    feeds = [io.feeds(ids[None])]
    model = onnx.load(str(source))
    act_max = smooth.activation_channel_max(source, feeds, list(smooth.weight_matmuls(model)), work_dir=tmp_path)
    assert all(v.ndim == 1 and (v > 0).all() for v in act_max.values())
    counts = smooth.smooth(model, act_max, 0.5)
    layers = io.num_layers
    # lm_head reads the rows the graph projects (a Gather after the final norm): a Mul there too
    assert counts["folded_into_norms"] == 2 * layers and counts["mul_inserted"] == 2 * layers + 1
    onnx.save(model, str(tmp_path / "s.onnx"), save_as_external_data=True, location="s.onnx.data")
    before = runtime_session(source).run(["logits"], feeds[0])[0]
    after = runtime_session(tmp_path / "s.onnx").run(["logits"], feeds[0])[0]
    assert np.abs(after - before).max() <= 1e-4 * np.abs(before).max()
    weights = [n.input[1] for nodes in smooth.weight_matmuls(model).values() for n in nodes]
    assert len(weights) == 7 * layers + 1 and all("_smooth" in w for w in weights)      # every MatMul rescaled


def test_near_ties_count_as_agreement_and_are_reported_apart(monkeypatch):
    """An exact conversion of a model with tied logits is not a disagreement; a real flip is."""
    from specexport.quant import quality

    ref = np.array([[2.0, 2.0, 0.0], [1.0, 3.0, 0.0], [5.0, 1.0, 0.0]], np.float32)       # row 0: a tie
    got = np.array([[1.0, 2.0, 0.0], [1.0, 3.0, 0.0], [1.0, 5.0, 0.0]], np.float32)       # row 2 flips
    monkeypatch.setattr(quality, "prefill_logits", lambda session, io, ids: ref if session == "ref" else got)
    report = quality.measure_quality("ref", "got", None, sequences=[np.zeros(3, np.int64)])
    assert report.top1_agreement == pytest.approx(2 / 3) and report.ties == 1
    assert "(1 of them near-ties)" in report.describe()


def test_quality_from_spilled_logits_in_row_chunks_equals_the_whole_computation(tmp_path):
    """A lean build keeps one session's logits on disk (SpilledLogits) and measures a few rows at a time:
    the figures are those of the plain computation over every row at once; the folder goes on exit."""
    from specexport.quant import quality

    rng = np.random.default_rng(4)
    seqs = [np.zeros(n, np.int64) for n in (37, 5)]                  # 37 > ROWS_AT_ONCE: chunks and a tail
    ref = [rng.standard_normal((len(s), 50)).astype(np.float32) * 3 for s in seqs]
    got = [r + rng.standard_normal(r.shape).astype(np.float32) * 0.5 for r in ref]
    with quality.SpilledLogits() as spilled:
        for g in got:
            spilled.append(g)
        folder = spilled._dir.name
        assert len(spilled) == 2 and np.array_equal(spilled[1], got[1])
        report = quality.measure_quality(ref, spilled, None, sequences=seqs)
    assert not Path(folder).exists()

    def log_softmax(x):
        z = x.astype(np.float64) - x.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(np.concatenate(ref)), log_softmax(np.concatenate(got))
    assert report.positions == 42
    assert report.mean_kl == pytest.approx((np.exp(lp) * (lp - lq)).sum(-1).mean(), rel=1e-12)
    exact = int((lp.argmax(-1) == lq.argmax(-1)).sum())
    assert round(report.top1_agreement * 42) - report.ties == exact
