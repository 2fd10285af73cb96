"""specexport bench: the speedup arithmetic on numbers with known answers, the report schema on a
tiny build, and --gamma auto (including its fall-back to vanilla)."""
from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest

import specexport
from specexport.cli import main
from specexport.errors import SpecexportError
from specexport.report.bench import ROW_KEYS, BenchConfig, run_bench
from specexport.report.model import choose_gamma, expected_tokens, extend, predicted_speedup, speedup_from_counts


def test_expected_tokens_matches_the_iid_formula():
    for alpha in (0.3, 0.7, 0.9):
        for gamma in (1, 3, 6):
            assert expected_tokens([alpha] * gamma) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))
    assert expected_tokens([]) == 1.0
    assert expected_tokens([1.0, 0.5, 0.0]) == pytest.approx(1 + 1 + 0.5)


def test_predicted_speedup_worked_example():
    c_target = {1: 1.0, 2: 1.1, 3: 1.2}
    assert predicted_speedup([0.8, 0.8], c_draft=0.1, c_target=c_target) == pytest.approx(2.44 / 1.4)
    assert predicted_speedup([0.8], c_draft=0.1, c_target=c_target) == pytest.approx(1.8 / 1.2)


def test_speedup_from_counts():
    c_target = {1: 1.0, 2: 1.1, 3: 1.2}
    # 10 rounds of 2 proposals and 5 of 1, plus 2 plain steps; 30 tokens emitted
    cost = 10 * (0.2 + 1.2) + 5 * (0.1 + 1.1) + 2 * 1.0
    assert speedup_from_counts(30, {2: 10, 1: 5, 0: 2}, c_draft=0.1, c_target=c_target) == pytest.approx(30 / cost)
    # fixed γ with every round accepting all: the per-position formula's answer
    assert speedup_from_counts(30, {2: 10}, c_draft=0.1, c_target=c_target) == pytest.approx(
        predicted_speedup([1.0, 1.0], c_draft=0.1, c_target=c_target))


def test_choose_gamma():
    c_target = {t: 1.0 + 0.05 * (t - 1) for t in range(1, 9)}
    g, s = choose_gamma([0.9], c_draft=0.05, c_target=c_target, max_gamma=7)
    assert g > 3 and s == pytest.approx(max(predicted_speedup(extend([0.9], k), c_draft=0.05, c_target=c_target)
                                            for k in range(1, 8)))
    assert choose_gamma([0.1], c_draft=0.5, c_target=c_target, max_gamma=7) == (0, 1.0)     # speculation loses
    assert extend([0.5, 0.4], 4).tolist() == [0.5, 0.4, 0.4, 0.4]


@pytest.fixture(scope="module")
def bench_report(built_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    shutil.copytree(built_llama, work / "build")
    cfg = BenchConfig(output_dir=work / "build", prompts=("def f(x):", "import os"), gammas=(1, 2),
                      draft_stops=(0.5,), max_new_tokens=8, rounds=1, out=work / "report")
    return work, run_bench(cfg, log=lambda m: None)


def test_report_rows_and_files(bench_report):
    work, report = bench_report
    rows = json.loads((work / "report" / "report.json").read_text())["rows"]
    assert {(r["method"], r["gamma"]) for r in rows} == {("vanilla", 0), ("draft", 1), ("draft", 2)}
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
    vanilla = next(r for r in rows if r["method"] == "vanilla")
    assert vanilla["speedup_vs_vanilla"] == pytest.approx(1.0) and vanilla["acceptance_rate"] is None
    for r in rows:
        if r["method"] == "draft":
            assert 0 <= r["acceptance_rate"] <= 1 and len(r["acceptance_per_position"]) == r["gamma"]
            assert r["efficiency"] == pytest.approx(r["speedup_vs_vanilla"] / r["ideal_speedup"])
    # the ideal uses the costs timed inside the runs (falling back to isolated timings per size)
    costs = report["step_costs_ms"]["fp32/fp32"]
    assert set(report["step_costs_isolated_ms"]["fp32/fp32"]) == set(costs)
    fixed = next(r for r in rows if r["method"] == "draft" and r["gamma"] == 2 and not r["draft_stop"])
    c_target = {int(t): c for t, c in costs.items() if t != "draft"}
    assert fixed["ideal_speedup"] == pytest.approx(predicted_speedup(fixed["acceptance_conditional"],
                                                                     c_draft=costs["draft"], c_target=c_target))
    adaptive = [r for r in rows if r["draft_stop"]]
    assert [(r["gamma"], r["draft_stop"]) for r in adaptive] == [(2, 0.5)]
    assert adaptive[0]["efficiency"] == pytest.approx(adaptive[0]["speedup_vs_vanilla"] / adaptive[0]["ideal_speedup"])
    assert (work / "report" / "report.md").read_text().count("| fp32 |") == 4
    assert (work / "report" / "speedup_vs_gamma.png").stat().st_size > 0
    stored = json.loads((work / "build" / "manifest.json").read_text())["gamma_auto"]["fp32"]
    assert stored["gamma"] == report["gamma_auto"]["fp32"]["gamma"]
    peers = {p["peer"]: p for p in report["peers"]}
    assert peers["transformers greedy"]["tokens_per_s"] > 0 and peers["transformers assisted"]["tokens_per_s"] > 0
    # greedy peers decode the same tokens as ours (fp32 on both sides; a near-tie may flip one run)
    assert peers["transformers greedy"]["same_tokens_as_specexport"] >= 0.5
    assert peers["transformers assisted"]["same_tokens_as_specexport"] >= 0.5
    if importlib.util.find_spec("onnxruntime_genai") is None:
        assert "skipped" in peers["onnxruntime-genai"]
    else:
        for name in ("onnxruntime-genai greedy", "onnxruntime-genai n-gram (n=3, k=4)"):
            assert peers[name]["tokens_per_s"] > 0 and peers[name]["same_tokens_as_specexport"] >= 0.5
        assert (work / "report" / "peers" / "onnxruntime-genai-fp32" / "greedy" / "model.onnx").is_file()
    assert "onnxruntime-genai greedy (fp32)" in (work / "report" / "report.md").read_text() or \
        importlib.util.find_spec("onnxruntime_genai") is None


def test_build_ends_with_a_short_report(built_llama):
    """`specexport build` (conftest's built_llama) ran the quick bench: report and γ choice are there."""
    report = json.loads((built_llama / "bench" / "report.json").read_text())
    assert {r["method"] for r in report["rows"]} == {"vanilla", "draft"}
    assert "fp32" in json.loads((built_llama / "manifest.json").read_text())["gamma_auto"]


def test_gamma_auto_uses_the_stored_choice_and_falls_back_to_vanilla(bench_report, tmp_path):
    work, _ = bench_report
    shutil.copytree(work / "build", tmp_path / "b")
    path = tmp_path / "b" / "manifest.json"
    m = json.loads(path.read_text())
    m["gamma_auto"] = {"fp32": {"gamma": 0, "predicted_speedup": 0.6}}
    path.write_text(json.dumps(m))
    pipe = specexport.load(tmp_path / "b")
    out = pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=10, gamma="auto")
    assert out.stats.proposed == 0 and "decoding vanilla" in pipe.auto_note
    m["gamma_auto"] = {"fp32": {"gamma": 3, "predicted_speedup": 1.7}}
    path.write_text(json.dumps(m))
    pipe = specexport.load(tmp_path / "b")
    out = pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=10, gamma="auto")
    assert out.stats.gamma == 3 and out.stats.proposed > 0
    del m["gamma_auto"]
    path.write_text(json.dumps(m))
    with pytest.raises(SpecexportError, match="run `specexport bench"):
        specexport.load(tmp_path / "b").generate(prompt_ids=[1, 5], gamma="auto")


def test_bench_cli(built_llama, tmp_path, capsys):
    shutil.copytree(built_llama, tmp_path / "b")
    assert main(["bench", str(tmp_path / "b"), "--gammas", "1", "--rounds", "1", "--max-new-tokens", "4",
                 "--no-peers"]) == 0
    assert "| fp32 |" in capsys.readouterr().out
    assert main(["bench", str(tmp_path / "b"), "--gammas", "0"]) == 1
    assert main(["bench", str(tmp_path / "b"), "--draft-stops", "1.5"]) == 1
    assert main(["generate", str(tmp_path / "b"), "x", "--gamma", "auto", "--max-new-tokens", "3"]) == 0
    assert "--gamma auto" in capsys.readouterr().err
