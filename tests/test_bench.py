"""specexport bench: the speedup arithmetic on numbers with known answers, the whole bench driven by an
injected clock against closed-form figures, the report schema on a tiny build, and the γ choice
(stored per target/draft precision, kept across rebuilds that reuse the graphs, never replaced by a
shorter bench, and --gamma auto's fall-back to vanilla)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil

import numpy as np
import pytest

import specexport
from specexport.cli import main
from specexport.errors import SpecexportError
from specexport.gamma import store_gamma_choices
from specexport.io_spec import ModelIO
from specexport.manifest import read_manifest, stage_dir
from specexport.report.bench import ROW_KEYS, BenchConfig, run_bench
from specexport.runtime.backends import open_backend
from specexport.runtime.backends.base import StepOutput
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


# -- the whole bench against closed-form answers (injected clock) ---------------------------------
# Step costs in seconds: target c_t(T) = 10 ms + 1 ms per extra token, draft 1 ms (1 token) or 1.5 ms
# (2 tokens); every backend.commit costs 0.5 ms of "loop overhead" outside the forwards.
C_T = {T: 0.010 + 0.001 * (T - 1) for T in range(1, 65)}
C_D = {1: 0.001, 2: 0.0015}
OVERHEAD = 0.0005
N = 20                                  # max_new_tokens


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _charge(backend, clock, costs, *, shift_argmax=False):
    """Make each forward of `backend` take costs[T] on the fake clock (and each commit OVERHEAD);
    shift_argmax turns the model into a draft that is never right (argmax + 1)."""
    forward, commit = backend._forward, backend.commit

    def timed_forward(tokens, depths, mask, last_only):
        clock.now += costs[len(tokens)]
        out = forward(tokens, depths, mask, last_only)
        return StepOutput(np.roll(out.logits, 1, axis=-1), out.hidden) if shift_argmax else out

    def timed_commit(keep):
        clock.now += OVERHEAD
        commit(keep)

    backend._forward, backend.commit = timed_forward, timed_commit


def _fake_bench(build, tmp_path, *, wrong_draft: bool, target_costs=None):
    """Run the real bench on the tiny build with the draft = the target model (greedy: every
    proposal accepted) or a draft that is always wrong, every time on the fake clock; target_costs
    {precision: costs} charges other precisions other costs (C_T by default)."""
    clock = FakeClock()
    manifest = read_manifest(build)
    target_costs = target_costs or {"fp32": C_T}

    def open_pipeline(precision, threads, spin):
        pipe = specexport.load(build, precision=precision, threads=threads, spin=spin)
        _charge(pipe.target, clock, target_costs[precision])
        entry = manifest["models"]["target"]
        draft = open_backend("onnxruntime", stage_dir(build, manifest, "target", precision),
                             io=ModelIO.from_dict(entry["io"]), capacity=pipe.capacity,
                             max_tokens=pipe.target.max_tokens, threads=1)
        _charge(draft, clock, {**{t: 0.002 for t in range(3, 65)}, **C_D}, shift_argmax=wrong_draft)
        pipe.drafts[precision] = draft
        return pipe

    cfg = BenchConfig(output_dir=build, prompts=("def f(x):", "import os"), gammas=(4,), max_new_tokens=N, rounds=2,
                      out=tmp_path / "report", threads=1, peers=False, plots=False, precisions=tuple(target_costs))
    return run_bench(cfg, log=lambda m: None, clock=clock, open_pipeline=open_pipeline)


@pytest.fixture(scope="module")
def fake_build(built_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("fakebench")
    shutil.copytree(built_llama, work / "build")
    return work / "build"


def test_bench_figures_equal_the_closed_form_when_every_proposal_is_accepted(fake_build, tmp_path):
    report = _fake_bench(fake_build, tmp_path, wrong_draft=False)
    vanilla, spec = report["rows"]
    assert (vanilla["method"], spec["method"], spec["gamma"]) == ("vanilla", "draft", 4)
    assert vanilla["delivered_tokens"] == spec["delivered_tokens"] == 4 * N, "a prompt hit EOS: pick others"
    assert spec["acceptance_rate"] == 1.0
    # 19 decode tokens. Rounds: three of 4 proposals (5 tokens each) and one shortened to 3 (budget).
    # Draft calls: the first round feeds 1 token then 3 x 1; later rounds feed 2 (the unseen last
    # proposal + bonus) then 1 x 1 each.
    assert spec["rounds_by_proposals"] == {"3": 4, "4": 12}
    forwards = 4 * C_D[1] + C_T[5] + 2 * (C_D[2] + 3 * C_D[1] + C_T[5]) + (C_D[2] + 2 * C_D[1] + C_T[4])
    commits = 19 * OVERHEAD                  # 4+1, 4+1, 4+1, 3+1 commits; vanilla: one per token
    assert spec["tokens_per_s"] == pytest.approx(19 / (forwards + commits))
    assert vanilla["tokens_per_s"] == pytest.approx(1 / (C_T[1] + OVERHEAD))
    assert spec["tpot_ms_p50"] == pytest.approx((forwards + commits) / 19 * 1e3)
    prompt_lengths = [len(specexport.load(fake_build).encode(p)) for p in ("def f(x):", "import os")]
    prefill = sorted(C_T[n] + OVERHEAD for n in prompt_lengths)      # one chunk (+ its commit) per prompt
    assert spec["prefill_ms"] == pytest.approx(np.median(prefill) * 1e3)
    assert spec["draft_prefill_ms"] == pytest.approx(0.002e3 + OVERHEAD * 1e3)
    speedup = 19 * (C_T[1] + OVERHEAD) / (forwards + commits)
    ideal = 19 * C_T[1] / forwards                                     # the forwards only
    assert spec["speedup_vs_vanilla"] == pytest.approx(speedup)
    assert spec["ideal_speedup"] == pytest.approx(ideal)
    assert spec["efficiency"] == pytest.approx(speedup / ideal)
    assert spec["speedup_ci95"] == pytest.approx([speedup, speedup])  # every cell is the same here
    assert report["step_costs_ms"]["fp32/fp32"]["target"] == pytest.approx(
        {"1": 10.0, "4": 13.0, "5": 14.0})
    assert report["step_costs_ms"]["fp32/fp32"]["draft"] == pytest.approx({"1": 1.0, "2": 1.5})
    curve = report["pass_curve_ms"]["fp32"]               # the target pass by rows: c(M) on the fake clock
    assert curve == pytest.approx({str(m): C_T[m] * 1e3 for m in (1, 2, 4, 8, 16) if str(m) in curve})
    assert {"1", "2", "4"} <= set(curve)
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"| {C_T[4] * 1e3:.2f} ms, {C_T[4] / C_T[1]:.2f}x |" in md


def test_a_quantized_row_is_also_compared_with_the_fp32_vanilla(fake_build, tmp_path):
    """An 'int8' target (the fp32 graph listed again, charged half the cost) has its speedup over its own
    vanilla and over the fp32 vanilla, both with intervals; fp32 rows have no second figure."""
    build = tmp_path / "b"
    shutil.copytree(fake_build, build)
    manifest = json.loads((build / "manifest.json").read_text())
    for model in manifest["models"].values():
        model["precisions"]["int8"] = model["precisions"]["fp32"]
    (build / "manifest.json").write_text(json.dumps(manifest))
    half = {t: c / 2 for t, c in C_T.items()}
    rows = {(r["precision"], r["method"]): r
            for r in _fake_bench(build, tmp_path, wrong_draft=False, target_costs={"fp32": C_T, "int8": half})["rows"]
            if r["draft_precision"] in (None, r["precision"])}
    fp32_vanilla = 1 / (C_T[1] + OVERHEAD)
    assert rows[("int8", "vanilla")]["tokens_per_s"] == pytest.approx(1 / (half[1] + OVERHEAD))
    for method in ("vanilla", "draft"):
        r = rows[("int8", method)]
        assert r["speedup_vs_fp32_vanilla"] == pytest.approx(r["tokens_per_s"] / fp32_vanilla)
        assert r["speedup_vs_fp32_ci95"] == pytest.approx([r["speedup_vs_fp32_vanilla"]] * 2)
        assert rows[("fp32", method)]["speedup_vs_fp32_vanilla"] is None
    assert rows[("int8", "draft")]["speedup_vs_fp32_vanilla"] > rows[("int8", "draft")]["speedup_vs_vanilla"] > 1
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"{rows[('int8', 'draft')]['speedup_vs_fp32_vanilla']:.2f}x [" in md


def test_bench_figures_equal_the_closed_form_when_no_proposal_is_accepted(fake_build, tmp_path):
    report = _fake_bench(fake_build, tmp_path, wrong_draft=True)
    _, spec = report["rows"]
    assert spec["acceptance_rate"] == 0.0
    # one token per round: 15 rounds of 4 proposals, then the budget shortens them to 3, 2, 1 and
    # the last token is a plain target step
    assert spec["rounds_by_proposals"] == {"0": 4, "1": 4, "2": 4, "3": 4, "4": 60}     # 4 runs
    forwards = 66 * C_D[1] + 15 * C_T[5] + C_T[4] + C_T[3] + C_T[2] + C_T[1]
    commits = (66 + 19) * OVERHEAD
    speedup = 19 * (C_T[1] + OVERHEAD) / (forwards + commits)
    assert spec["speedup_vs_vanilla"] == pytest.approx(speedup)
    assert spec["ideal_speedup"] == pytest.approx(19 * C_T[1] / forwards)
    assert spec["efficiency"] == pytest.approx(speedup * forwards / (19 * C_T[1]))
    assert report["gamma_auto"]["fp32/fp32"]["gamma"] == 0                # speculation loses: vanilla


def test_speedup_interval_is_a_paired_bootstrap():
    """Noise shared by a cell's two runs cancels; an interval over cells that differ has width."""
    from types import SimpleNamespace

    from specexport.report.accounting import speedup_interval

    run = lambda tokens, seconds: SimpleNamespace(delivered=tokens + 1, decode_s=seconds)    # noqa: E731
    slow = [1.0, 3.0, 1.5, 2.5]                        # the machine's speed per cell
    spec = [run(100, 0.5 * f) for f in slow]
    vanilla = [run(100, 1.0 * f) for f in slow]
    assert speedup_interval(spec, vanilla) == pytest.approx([2.0, 2.0])
    spec[1] = run(100, 3.0)                           # one cell where speculation did not help
    lo, hi = speedup_interval(spec, vanilla)
    assert lo < 2.0 * (8 / 9.5) + 1e-9 < hi and hi <= 2.0 + 1e-9


# -- the report on a tiny build ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_report(built_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    shutil.copytree(built_llama, work / "build")
    cfg = BenchConfig(output_dir=work / "build", prompts=("def f(x):", "import os"), gammas=(1, 2),
                      draft_stops=(0.5,), max_new_tokens=8, rounds=2, out=work / "report")
    return work, run_bench(cfg, log=lambda m: None)


def test_report_rows_and_files(bench_report):
    work, report = bench_report
    saved = json.loads((work / "report" / "report.json").read_text())
    rows = saved["rows"]
    assert {(r["method"], r["gamma"]) for r in rows} == {("vanilla", 0), ("draft", 1), ("draft", 2)}
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert r["efficiency"] is not None and r["speedup_ci95"] is not None
    vanilla = next(r for r in rows if r["method"] == "vanilla")
    assert vanilla["speedup_vs_vanilla"] == pytest.approx(1.0) and vanilla["acceptance_rate"] is None
    for r in rows:
        if r["method"] == "draft":
            assert 0 <= r["acceptance_rate"] <= 1 and len(r["acceptance_per_position"]) == r["gamma"]
            assert r["efficiency"] == pytest.approx(r["speedup_vs_vanilla"] / r["ideal_speedup"])
            lo, hi = r["speedup_ci95"]
            assert lo <= r["speedup_vs_vanilla"] <= hi
            assert r["runs"] == 4 and r["ttft_ms"] > 0 and r["draft_prefill_ms"] > 0
    # the step costs of the ideal are decode-time forwards only: sizes of prefill (prompt lengths,
    # 3 and 2 tokens here) appear only where a round verified that many tokens
    costs = report["step_costs_ms"]["fp32/fp32"]
    assert set(costs["target"]) <= {"1", "2", "3"} and set(costs["draft"]) <= {"1", "2"}
    adaptive = [r for r in rows if r["draft_stop"]]
    assert [(r["gamma"], r["draft_stop"]) for r in adaptive] == [(2, 0.5)]
    md = (work / "report" / "report.md").read_text()
    # the rows, where the time goes, the pass curve
    assert md.count("| fp32 |") == 4 + 3 + 1 and "95% CI" in md and "threads" in md.lower()
    assert "## Where the time goes" in md and "capped by" in md
    assert (work / "report" / "speedup_vs_gamma.png").stat().st_size > 0
    probe = saved["settings"]["thread_probe_tokens_per_s"]["fp32"]
    assert saved["settings"]["target_threads"]["fp32"] and probe and all(np.isfinite(v) and v > 0 for v in probe.values())
    # this bench measured fewer tokens than the build's short bench (3 prompts x 32): its choice is not stored
    measured = next(r for r in rows if r["gamma"] == 2 and not r["draft_stop"])["delivered_tokens"]
    assert report["gamma_auto"]["fp32/fp32"]["measured_tokens"] == measured == 2 * 2 * 8
    stored = read_manifest(work / "build")["gamma_auto"]["fp32/fp32"]
    assert stored["measured_tokens"] == 3 * 32 and "kept the stored γ choice" in report["gamma_store"][0]


def test_peers_run_apart_and_are_compared_with_our_fp32_vanilla_output(bench_report):
    work, report = bench_report
    peers = {p["peer"]: p for p in report["peers"]}
    for name in ("transformers greedy", "transformers assisted"):
        assert peers[name]["tokens_per_s"] > 0 and peers[name]["runs"] == 4
        # greedy on the same fp32 weights: whole outputs equal ours (a near-tie may flip one run)
        assert peers[name]["same_tokens_as_fp32_vanilla"] >= 0.5
        # our rows against the peer: a ratio with its paired interval over the 4 cells, and only so in the text
        vs = {v["which"]: v for v in peers[name]["ours_vs_peer"]}
        assert set(vs) == {"vanilla", "best"} and vs["vanilla"]["row"] == "vanilla"
        for v in vs.values():
            assert v["ci95"][0] <= v["ratio"] * (1 + 1e-9) and v["ratio"] <= v["ci95"][1] * (1 + 1e-9)
    text = (work / "report" / "report.md").read_text()
    assert "[95% interval" in text.split("## Peers")[1]
    assert "torch" not in report["memory"]["peak_rss_note"]
    assert all(v > 0 for v in report["memory"]["peers_peak_rss_bytes"].values())
    if importlib.util.find_spec("onnxruntime_genai") is None:
        assert "skipped" in peers["onnxruntime-genai"]
    else:
        for name in ("onnxruntime-genai greedy", "onnxruntime-genai n-gram (n=3, k=4)"):
            assert peers[name]["tokens_per_s"] > 0 and peers[name]["same_tokens_as_fp32_vanilla"] >= 0.5
        assert (work / "report" / "peers" / "onnxruntime-genai-fp32" / "greedy" / "model.onnx").is_file()


def test_same_output_is_whole_and_never_empty():
    from specexport.report.rows import _same_output

    assert _same_output([5, 6, 2], [5, 6, 2], {2}) and _same_output([5, 6], [5, 6, 2], {2})
    assert not _same_output([], [5, 6], {2}) and not _same_output([5], [5, 6], {2})
    assert not _same_output([5, 6, 7], [5, 6], {2})


def test_build_ends_with_a_short_report(built_llama):
    """`specexport build` (conftest's built_llama) ran the quick bench: report and γ choice are there."""
    report = json.loads((built_llama / "bench" / "quick" / "report.json").read_text())
    assert {r["method"] for r in report["rows"]} == {"vanilla", "draft", "lookup", "suffix"}
    assert "fp32/fp32" in read_manifest(built_llama)["gamma_auto"]


# -- the stored γ choice -----------------------------------------------------------------------------
def test_gamma_choice_is_kept_by_a_rebuild_that_reuses_the_graphs_and_not_replaced_by_a_shorter_bench(
        built_llama, tiny_checkpoints, tmp_path, write_yaml, run_build):
    out = tmp_path / "b"
    shutil.copytree(built_llama, out)
    m = read_manifest(out)
    fields = dict(name="tiny-llama", target={"path": tiny_checkpoints["llama"]},
                  draft={"path": tiny_checkpoints["llama-draft"]}, max_seq_len=m["max_seq_len"], output=out)
    path = write_yaml(tmp_path / "model.yaml", **fields)
    full = {("fp32", "fp32"): {"gamma": 5, "predicted_speedup": 1.9, "measured_tokens": 10_000}}
    assert store_gamma_choices(out, full, build_id=m["build_id"], command="test") == []
    assert run_build(path) == 0                      # reuses both graphs, runs the short bench at its end
    stored = read_manifest(out)["gamma_auto"]["fp32/fp32"]
    assert (stored["gamma"], stored["measured_tokens"]) == (5, 10_000)
    report = json.loads((out / "bench" / "quick" / "report.json").read_text())
    assert any("kept the stored γ choice" in line for line in report["gamma_store"])
    stale = read_manifest(out)["build_id"]
    assert run_build(path, "--force", "--no-bench") == 0     # new graphs: the old choice no longer applies
    assert "gamma_auto" not in read_manifest(out)
    lines = store_gamma_choices(out, full, build_id=stale, command="test")
    assert lines and "replaced" in lines[0] and "gamma_auto" not in read_manifest(out)


def test_gamma_auto_uses_the_stored_choice_and_falls_back_to_vanilla(bench_report, tmp_path):
    work, _ = bench_report
    shutil.copytree(work / "build", tmp_path / "b")
    out = tmp_path / "b"
    path = out / "manifest.json"

    def store(gamma, speedup):
        m = read_manifest(out)
        m.pop("gamma_auto", None)
        path.write_text(json.dumps(m))
        store_gamma_choices(out, {("fp32", "fp32"): {"gamma": gamma, "predicted_speedup": speedup,
                                                     "measured_tokens": 1}}, build_id=m["build_id"], command="t")

    store(0, 0.6)
    pipe = specexport.load(out)
    out_ = pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=10, gamma="auto")
    assert out_.stats.proposed == 0 and "decoding vanilla" in out_.note and out_.method == "vanilla"
    store(3, 1.7)
    pipe = specexport.load(out)
    out_ = pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=10, gamma="auto")
    assert out_.stats.gamma == 3 and out_.stats.proposed > 0
    m = read_manifest(out)
    del m["gamma_auto"]
    path.write_text(json.dumps(m))
    with pytest.raises(SpecexportError, match="run `specexport bench"):
        specexport.load(out).generate(prompt_ids=[1, 5], gamma="auto")


def test_bench_cli(built_llama, tmp_path, capsys):
    shutil.copytree(built_llama, tmp_path / "b")
    b = str(tmp_path / "b")
    assert main(["bench", b, "--gammas", "1", "--rounds", "1", "--max-new-tokens", "4", "--no-peers",
                 "--threads", "1"]) == 0
    assert "| fp32 |" in capsys.readouterr().out
    assert main(["generate", b, "x", "--method", "draft", "--gamma", "auto", "--max-new-tokens", "3"]) == 0
    assert "--gamma auto" in capsys.readouterr().err
    assert main(["generate", b, "def f(x):", "--max-new-tokens", "6", "--method", "draft", "--gamma", "2",
                 "--compare"]) == 0
    assert re.search(r"speedup: draft .* = \d\.\d\dx \[95% interval \d\.\d\d-\d\.\d\d\] \(decode time",
                     capsys.readouterr().err)


@pytest.mark.parametrize("args, message", [
    (["--gammas", "0"], "--gammas: expected integers >= 1"),
    (["--draft-stops", "1.5"], "--draft-stops: expected probabilities"),
    (["--methods", "vanilla,hydra"], "--methods: 'hydra' is not a method"),
    (["--precisions", "int4"], "--precisions: 'int4' was not built"),
    (["--prompts", "MISSING"], "--prompts: .*missing.jsonl: no such file"),
    (["--prompts", "BAD"], "--prompts: .*bad.jsonl line 2: not JSON"),
    (["--prompts", "NUMBER"], "--prompts: .*number.jsonl line 1: expected a non-empty JSON string"),
])
def test_bench_cli_errors_are_one_line(built_llama, tmp_path, capsys, args, message):
    (tmp_path / "bad.jsonl").write_text('"ok"\n{not json\n')
    (tmp_path / "number.jsonl").write_text("42\n")
    files = {"MISSING": str(tmp_path / "missing.jsonl"), "BAD": str(tmp_path / "bad.jsonl"),
             "NUMBER": str(tmp_path / "number.jsonl")}
    args = [files.get(a, a) for a in args]
    capsys.readouterr()
    assert main(["bench", str(built_llama), "--no-peers", *args]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def _child_peak(queue):
    from specexport.report.peers import _peak_rss_bytes

    queue.put(_peak_rss_bytes())


def test_a_peer_process_reports_its_own_peak_memory_not_ours():
    """ru_maxrss survives fork + exec on Linux: a spawned peer would report the bench's peak."""
    import multiprocessing

    ballast = np.ones(400 * 2**20 // 8)                  # 400 MiB resident in this process
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_peak, args=(queue,))
    child.start()
    peak = queue.get(timeout=60)
    child.join()
    assert 0 < peak < 300 * 2**20 and ballast.sum() > 0


# -- the stored method choice (--method auto) ---------------------------------------------------------
def _row(method, speedup, dp=None, gamma=4, tree=None, tokens=100):
    return {"precision": "fp32", "draft_precision": dp, "method": method, "gamma": gamma, "tree": tree,
            "draft_stop": 0.0, "speedup_vs_vanilla": speedup, "speedup_ci95": [speedup - 0.1, speedup + 0.1],
            "delivered_tokens": tokens}


def test_method_choice_is_the_fastest_row_each_pair_can_run_and_vanilla_when_all_lose():
    from specexport.report.bench import method_choices

    rows = [_row("vanilla", 1.0), _row("lookup", 1.3), _row("medusa", 1.6, tree="auto", gamma=3),
            _row("draft", 1.8, dp="fp32"), _row("draft", 1.2, dp="int4")]
    c = method_choices(rows)
    assert (c[("fp32", "fp32")]["method"], c[("fp32", "fp32")]["draft_precision"]) == ("draft", "fp32")
    assert (c[("fp32", "int4")]["method"], c[("fp32", "int4")]["tree"]) == ("medusa", "auto")   # 1.6 > 1.2
    assert c[("fp32", "-")]["method"] == "medusa" and c[("fp32", "-")]["measured_tokens"] == 500
    lost = method_choices([_row("vanilla", 1.0), _row("lookup", 0.9), _row("draft", 0.97, dp="fp32")])
    assert lost[("fp32", "fp32")]["method"] == "vanilla" and lost[("fp32", "fp32")]["speedup"] == 0.97
    assert lost[("fp32", "fp32")]["best_measured"] == "draft γ 4"


def test_method_auto_uses_the_stored_choice_on_these_graphs_only(bench_report, tmp_path):
    work, report = bench_report
    assert set(report["method_auto"]) >= {"fp32/fp32", "fp32/-"}
    shutil.copytree(work / "build", tmp_path / "b")
    out = tmp_path / "b"

    def store(choice):
        m = read_manifest(out)
        m.pop("method_auto", None)
        (out / "manifest.json").write_text(json.dumps(m))
        store_gamma_choices(out, {("fp32", "fp32"): {"tree": None, "draft_stop": 0.0, "draft_precision": None,
                                                      "speedup": 1.5, "best_measured": "x", "measured_tokens": 1,
                                                      **choice}},
                            build_id=m["build_id"], command="t", section="method_auto")

    store({"method": "lookup", "gamma": 3})
    pipe = specexport.load(out)
    got = pipe.generate(prompt_ids=[1, 5, 6, 5, 6, 5, 6], max_new_tokens=20, method="auto")
    assert got.stats.forwards and not any(role == "draft" for role, _ in got.stats.forwards)
    assert "lookup γ 3" in got.note and got.method == "lookup"
    store({"method": "draft", "gamma": 2, "draft_precision": "fp32"})
    pipe = specexport.load(out)
    assert pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=20, method="auto").stats.gamma == 2
    store({"method": "vanilla", "gamma": 0, "speedup": 0.8})
    pipe = specexport.load(out)
    got = pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=10, method="auto")
    assert got.stats.proposed == 0 and got.method == "vanilla"
    assert "vanilla: every speculative configuration measured was slower (the best, x, measured 0.80x)" in got.note
    store({"method": "vanilla", "gamma": 0, "speedup": None, "best_measured": None})     # only vanilla measured
    pipe = specexport.load(out)
    note = pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=4, method="auto").note
    assert "measured no speculative configuration" in note and "None" not in note
    assert f"specexport bench {out} --methods vanilla,lookup,suffix" in note
    m = read_manifest(out)                       # a choice measured on other graphs is not used
    m["method_auto"]["fp32/fp32"]["stages"]["target"] = "target/fp32-00000000"
    (out / "manifest.json").write_text(json.dumps(m))
    got = specexport.load(out).generate(prompt_ids=[1, 5], max_new_tokens=4, method="auto")
    assert got.method == "vanilla" and "no measured choice" in got.note and f"specexport bench {out}" in got.note


def test_where_the_time_goes_arithmetic():
    """A row's ideal with a free draft and with free verification, and which one caps it (by hand)."""
    from specexport.report.accounting import where_time_goes
    from specexport.runtime.loop import DecodeStats

    s = DecodeStats(delivered=31, forwards={("target", 5): 10, ("draft", 1): 40})
    w = where_time_goes([s], c_vanilla1=1.0, c_target={1: 1.0, 5: 1.5}, c_draft={1: 0.1})
    assert w["draft_step_ratio"] == pytest.approx(0.1) and w["verify_step_ratio"] == pytest.approx(1.5)
    assert w["ideal_free_draft"] == pytest.approx(30 / 15) and w["ideal_free_verify"] == pytest.approx(30 / 14)
    assert w["capped_by"] == "verify"
    cheap_verify = where_time_goes([s], c_vanilla1=1.0, c_target={1: 1.0, 5: 1.05}, c_draft={1: 0.3})
    assert cheap_verify["capped_by"] == "draft"


def test_thread_probe_decodes_the_prompt_as_the_bench_sends_it_and_refuses_an_immediate_eos():
    """A chat model given its first prompt as raw text may answer EOS at once: the probe then timed
    nothing (every setting nan tok/s, the first one 'won'). It decodes prompt_of(pipe) instead, and
    says so when even that stops after one token."""
    from types import SimpleNamespace

    from specexport.report.threads import fastest_for_vanilla

    class Pipe:
        def __init__(self, threads, spin, tokens):
            self.speed, self.tokens = (100.0 if spin else 50.0) * (threads or 2), tokens
            self.seen, self.closed = [], False

        def chat_ids(self, text):
            return [7, 8, 9]

        def generate(self, *, prompt_ids, max_new_tokens, method):
            self.seen.append(prompt_ids)
            return SimpleNamespace(token_ids=[1] * self.tokens, stats=SimpleNamespace(tokens_per_second=self.speed))

        def close(self):
            self.closed = True

    opened = []

    def open_pipeline(tokens):
        def make(precision, threads, spin):
            opened.append(Pipe(threads, spin, tokens))
            return opened[-1]
        return make

    best, speeds = fastest_for_vanilla(open_pipeline(5), "fp32", lambda pipe: pipe.chat_ids("hi"), cores=2, log=lambda m: None)
    assert best.threads is None and best.spin and all(v > 0 for v in speeds.values())
    assert all(seen == [7, 8, 9] for pipe in opened for seen in pipe.seen) and all(pipe.closed for pipe in opened)
    with pytest.raises(SpecexportError, match="one token"):
        fastest_for_vanilla(open_pipeline(1), "fp32", lambda pipe: pipe.chat_ids("hi"), cores=2, log=lambda m: None)


def test_the_builds_measured_settings_are_the_defaults(bench_report, tmp_path):
    """The bench stores the thread setting it measured fastest with its method choice; load() opens the
    target with it, and a method asked for without a γ takes the γ (and tree) the bench chose for it."""
    work, report = bench_report
    out = tmp_path / "b"
    shutil.copytree(work / "build", out)
    stored = read_manifest(out)["method_auto"]["fp32/fp32"]
    assert set(stored["threads"]) == {"threads", "spin"}                 # what the bench's rows ran with
    m = read_manifest(out)
    m["method_auto"]["fp32/fp32"].update(method="draft", gamma=2, tree=None, draft_precision="fp32",
                                         threads={"threads": 1, "spin": False})
    (out / "manifest.json").write_text(json.dumps(m))
    with specexport.load(out) as pipe:
        assert pipe.thread_note.startswith("threads: 1, spinning off")
        assert pipe.target.session.get_session_options().intra_op_num_threads == 1
        assert pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=8, method="draft").stats.gamma == 2
        assert pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=8, method="draft", gamma=3).stats.gamma == 3
    with specexport.load(out, threads=2, spin=True) as pipe:                  # given: used as given
        assert pipe.thread_note == "threads: as given"
        target, draft = (b.session.get_session_options() for b in (pipe.target, pipe.draft))
        assert target.intra_op_num_threads == draft.intra_op_num_threads == 2       # the draft: the target's
        # two models taking turns: each pool stops spinning when its run ends (ort.open_session)
        assert target.get_session_config_entry("session.force_spinning_stop") == "1"
        assert draft.get_session_config_entry("session.force_spinning_stop") == "1"
    with specexport.load(out, threads=2, draft_threads=1) as pipe:
        assert pipe.draft.session.get_session_options().intra_op_num_threads == 1
    m["method_auto"]["fp32/fp32"]["method"] = "lookup"                         # a choice of another method:
    (out / "manifest.json").write_text(json.dumps(m))                          # the draft's stored --gamma auto
    with specexport.load(out) as pipe:
        auto = read_manifest(out)["gamma_auto"]["fp32/fp32"]["gamma"]
        assert pipe.generate(prompt_ids=[1, 5, 6], max_new_tokens=8, method="draft").stats.gamma == (auto or 4)


def test_a_peer_that_cannot_open_its_model_is_a_skip_with_its_reason(tmp_path):
    """A peer child that fails before it is ready (a checkpoint folder without weights: a lean gguf build's
    config) raises its reason, and is reaped: the bench skips that peer instead of crashing."""
    from specexport.report.peers import PeerProcess, PeerSpec

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(RuntimeError) as err:
        PeerProcess(PeerSpec("transformers", "fp32 (PyTorch)", (("target", str(tmp_path)),)), start_timeout_s=120)
    assert "AttributeError" not in str(err.value) and str(err.value)


def test_the_pass_curve_is_stored_and_sizes_draft_free_rounds_on_this_cpu_only(bench_report, tmp_path, capsys):
    """The bench stores the target's pass curve with the CPU and threads it ran on; a pipeline on the same
    CPU and threads sizes lookup (gamma "auto", its default then) and suffix rounds from it, outputs equal to
    vanilla; on another CPU it has no costs, lookup takes γ 4 and "auto" is a one-line error."""
    from specexport.plugins.cpu.tiers import cpu_id

    work, report = bench_report
    out = tmp_path / "b"
    shutil.copytree(work / "build", out)
    m = read_manifest(out)
    m.pop("method_auto")                    # a stored lookup choice (the fastest row, by chance) would be the default
    (out / "manifest.json").write_text(json.dumps(m))
    entry = m["pass_curve"]["fp32/-"]
    assert entry["cpu"] == cpu_id() and entry["ms"] == report["pass_curve_ms"]["fp32"]
    assert entry["stages"] == {"target": read_manifest(out)["models"]["target"]["precisions"]["fp32"]["dir"]}
    assert main(["inspect", str(out)]) in (0, None)
    assert "pass curve fp32: c(1)" in capsys.readouterr().out.replace("\n", " ")
    prompt = dict(prompt_ids=[1, 5, 6, 1, 5], max_new_tokens=24)
    with specexport.load(out, threads=entry["threads"]) as pipe:
        costs = pipe.verify_costs()
        assert costs[1] == 1.0 and len(costs) == pipe.max_verify_tokens + 1
        vanilla = pipe.generate(**prompt, method="vanilla").token_ids
        lookup = pipe.generate(**prompt, method="lookup")
        assert lookup.stats.gamma == pipe.max_verify_tokens - 1 and lookup.token_ids == vanilla
        assert "sized from this CPU's pass curve" in lookup.note
        assert pipe.generate(**prompt, method="suffix").token_ids == vanilla
    m = read_manifest(out)
    m["pass_curve"]["fp32/-"]["cpu"] = "another-cpu"
    (out / "manifest.json").write_text(json.dumps(m))
    with specexport.load(out, threads=entry["threads"]) as pipe:
        assert pipe.verify_costs() is None
        assert pipe.generate(**prompt, method="lookup").stats.gamma == 4
        with pytest.raises(SpecexportError, match="gamma: 'auto' for lookup .* pass curve"):
            pipe.generate(**prompt, method="lookup", gamma="auto")
    m["pass_curve"]["fp32/-"].update(cpu=cpu_id(), ms={"2": 1.0})          # hand-edited: no M = 1
    (out / "manifest.json").write_text(json.dumps(m))
    with specexport.load(out, threads=entry["threads"]) as pipe:
        with pytest.raises(SpecexportError, match=r"pass_curve\.fp32/-\.ms: .*M = 1"):
            pipe.generate(**prompt, method="suffix")
