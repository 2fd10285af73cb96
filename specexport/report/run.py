"""`run_bench`: the order of a bench. The target's thread settings are chosen (or given), every draft
and head opened, every configuration runs once untimed (warm-up), then every round runs every
configuration once per prompt (the order rotated per cell), followed by the peers; from the timings of
those runs and an isolated timing per forward size come the rows, the γ and method choices (stored with
the build when greedy), and the report written to report.json / report.md / plots.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from specexport._console import Steps
from specexport.gamma import store_gamma_choices
from specexport.manifest import read_manifest, write_json_atomic, write_text_atomic
from specexport.plugins import cpu
from specexport.report import accounting as acc
from specexport.report.choice import acceptance_drop, gamma_choice, method_choices
from specexport.report.folder import REPORT_FILES, claim_report_folder, record_report_files
from specexport.report.grid import BenchConfig, Config, check_request, bench_configs, accuracy_only
from specexport.report.rows import memory, open_peers, peer_row, config_row
from specexport.report.threads import ThreadSetting, fastest_for_vanilla
from specexport.report.timing import (clocked, encode_prompt, isolated_costs, to_ms, pass_curve, reference_outputs, run_config,
                                      step_costs)
from specexport.report.workload import expand_workload, suffix_caches
from specexport.runtime.methods import HEAD_METHODS, configuration

# A peer's thread pools (torch's OpenMP, ONNX Runtime's) spin for a while after it answers, in its own
# process but on our cores: measured on the demo, the run right after the peers had its prefill 38%
# slower (20.3 vs 14.7 ms) until this pause was added. Rotating the order spreads whatever remains.
PEER_SETTLE_S = 0.1


def run_bench(cfg: BenchConfig, *, log=print, clock=time.perf_counter, open_pipeline=None, steps=None) -> dict:
    """Run the bench and write its report. `clock` and `open_pipeline(precision=, threads=, spin=)` are
    for tests: every time the report uses comes from `clock`. steps: _console.Steps, told of every run
    (warm-up and timed)."""
    steps = steps or Steps()
    import specexport

    manifest = read_manifest(cfg.output_dir)
    cpu.offer(cfg.output_dir, manifest)          # the engine's library, before the tier measurement loads one
    precisions, has_draft = check_request(cfg, manifest)
    claim_report_folder(Path(cfg.out or cfg.output_dir / "bench"))
    configs = bench_configs(precisions, manifest, cfg, has_draft)
    if open_pipeline is None:
        def open_pipeline(**kw):
            return specexport.load(cfg.output_dir, **kw)
    built = manifest["models"]["target"]["precisions"]
    if any(cpu.on_ours(built.get(tp, {})) for tp in precisions) and (table := cpu.remeasure_tiers()):   # for this run
        log(f"bench: kernel tiers measured for this run: {table}")
    first_prompt = cfg.prompts[0]
    settings, probes = {}, {}
    for tp in precisions:
        if cfg.threads is None:
            settings[tp], probes[tp] = fastest_for_vanilla(
                open_pipeline, tp, lambda pipe: encode_prompt(pipe, first_prompt, cfg.chat), log=log)
        else:
            settings[tp] = ThreadSetting(cfg.threads, True)
    pipes = {tp: clocked(open_pipeline(precision=tp, **settings[tp].options()), clock) for tp in precisions}
    try:
        if cfg.workload is not None:                # its conversations' turns carry the target's own answers
            cfg = replace(cfg, prompts=expand_workload(cfg.workload, pipes[precisions[0]], chat=cfg.chat,
                                                       max_new_tokens=cfg.max_new_tokens, log=log))
        return _measure(cfg, manifest, configs, pipes=pipes, settings=settings, probes=probes, clock=clock, log=log,
                        steps=steps)
    finally:
        for pipe in pipes.values():
            pipe.close()


def _measure(cfg, manifest, configs, *, pipes, settings, probes, clock, log, steps) -> dict:
    _open_proposers(configs, pipes, clock)
    prompt_ids = {p: encode_prompt(next(iter(pipes.values())), p, cfg.chat) for p in cfg.prompts}
    log(f"bench: warm-up, {len(configs)} configurations")
    steps.total(len(configs) * (1 + cfg.rounds * len(cfg.prompts)))
    for c in configs:
        run_config(pipes, c, prompt_ids[cfg.prompts[0]], max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
        steps.advance()
    peers, peer_skips = open_peers(manifest, list(pipes), cfg, log)
    built = manifest["models"]["target"]["precisions"]
    reference = {p: reference_outputs(cfg, pipes, prompt_ids, precision=p)      # what peers' outputs must equal
                 for p in sorted({getattr(peer, "reference_precision", "fp32") for peer in peers}) if p in built}
    for pipe in pipes.values():                     # time every forward from here on
        for b in pipe.opened:
            b.timings = {}
    runs, peer_runs = _interleave(cfg, configs, pipes, peers=peers, prompt_ids=prompt_ids, log=log, steps=steps)
    costs = step_costs(configs, pipes)
    for pipe in pipes.values():                     # the isolated timing below is not part of the runs
        for b in pipe.opened:
            b.timings = None
    max_t = max(cfg.gammas) + 1
    # only the γ choice uses these, and only for draft models: timing them for every key (vanilla, lookup, heads)
    # repeated the same target timings once per key
    isolated = {(tp, key): isolated_costs(pipes[tp], key, max_t, clock=clock)
                for tp, key in costs if key is not None and key not in HEAD_METHODS and not accuracy_only(tp, key)}
    curves = {tp: pass_curve(pipe, clock) for tp, pipe in pipes.items() if not accuracy_only(tp, None)}
    rows = [config_row(c, runs, costs) for c in configs]
    choice = gamma_choice(rows, costs, isolated, max(cfg.gammas))
    report = {
        "command": " ".join(sys.argv),
        "output_dir": str(cfg.output_dir),
        "build_id": manifest["build_id"],
        "settings": {"prompts": len(cfg.prompts), "rounds": cfg.rounds, "workload": cfg.workload is not None,
                     "max_new_tokens": cfg.max_new_tokens,
                     "greedy": cfg.temperature == 0, "temperature": cfg.temperature,
                     "bootstrap_resamples": acc.BOOTSTRAP_RESAMPLES,
                     "target_threads": {tp: s.label for tp, s in settings.items()},
                     "thread_probe_tokens_per_s": probes,
                     "draft_threads": "the target's",
                     "kernels": {tp: pipe.kernel_note for tp, pipe in pipes.items() if pipe.kernel_note},
                     # suffix trees (and lookup at γ auto) sized from a pass curve stored by an earlier bench
                     "sized_by_pass_curve": {tp: getattr(pipe, "verify_costs", lambda: None)() is not None
                                             for tp, pipe in pipes.items()}},
        "rows": rows,
        "step_costs_ms": {f"{tp}/{key or '-'}": to_ms(v) for (tp, key), v in costs.items()},
        "step_costs_isolated_ms": {f"{tp}/{key or '-'}": to_ms(v) for (tp, key), v in isolated.items()},
        "pass_curve_ms": {tp: {str(m): t * 1e3 for m, t in curve.items()} for tp, curve in curves.items()},
        "pass_curve_tiers": {tp: {str(m): v for m, v in by_rows.items()} for tp, curve in curves.items()
                             if (by_rows := cpu.tiers_by_rows(manifest["models"]["target"]["precisions"][tp], curve))},
        "gamma_auto": {f"{tp}/{dp}": c for (tp, dp), c in choice.items()},
        "acceptance_drop": acceptance_drop(rows),
        "memory": memory(manifest, pipes, peers),
        "peers": [{**peer_row(p, name, peer_runs[name], references=reference, manifest=manifest),
                   "ours_vs_peer": _ours_vs_peer(p, peer_runs[name], rows, runs=runs, configs=configs)}
                  for p in peers for name in p.names] + peer_skips,
    }
    _store_choices(cfg, manifest, report, choice=choice, rows=rows, log=log, settings=settings)
    _store_curves(cfg, manifest, report, pipes=pipes, log=log)
    _write_report(report, Path(cfg.out or cfg.output_dir / "bench"), cfg.plots, log)   # claimed by run_bench
    return report


def _ours_vs_peer(peer, peer_runs, rows, *, runs, configs) -> list[dict]:
    """Our vanilla row and fastest row on the peer's precision against the peer: the ratio of decode
    tokens/s and its 95% paired-bootstrap interval over the cells both ran in (a ratio is shown only with it)."""
    from types import SimpleNamespace

    precision = peer.spec.precision.split()[0]
    theirs = [SimpleNamespace(delivered=len(g.tokens), decode_s=g.total_s - g.ttft_s) for _, g in peer_runs]
    mine = [(r, c) for r, c in zip(rows, configs) if c.precision == precision and r["tokens_per_s"]
            and c.draft_precision in (None, precision)]
    picked = {"vanilla": next(((r, c) for r, c in mine if c.method == "vanilla"), None),
              "best": max(mine, key=lambda rc: rc[0]["tokens_per_s"], default=None)}
    peer_tps, out = acc.throughput(theirs), []
    for which, rc in picked.items():
        if rc is None:
            continue
        r, c = rc
        ours = acc.throughput(runs[c])
        out.append({"which": which, "row": "vanilla" if c.method == "vanilla" else
                    configuration({"method": c.method, "gamma": c.gamma, "tree": c.tree}),
                    "ratio": ours / peer_tps if ours and peer_tps else None,
                    "ci95": acc.speedup_interval(runs[c], theirs) if len(runs[c]) == len(theirs) else None})
    return out


def _open_proposers(configs, pipes, clock) -> None:
    """Every draft a row names, opened before the runs, and every proposer on the bench's clock."""
    drafts = sorted({(c.precision, c.draft_precision) for c in configs if c.draft_precision is not None})
    for tp, dp in drafts:                           # open every draft before the runs
        pipes[tp].use_draft_precision(dp)
        pipes[tp].draft.clock = clock
    for kind in {c.method for c in configs} & set(HEAD_METHODS):
        for pipe in pipes.values():
            getattr(pipe, kind).clock = clock


def _interleave(cfg, configs, pipes, *, peers, prompt_ids: dict, log, steps) -> tuple[dict, dict]:
    """The timed rounds: per configuration and per peer name, its runs (a peer's with the prompt's index).
    The peers are closed at the end, an error included."""
    runs = {c: [] for c in configs}
    peer_runs = {name: [] for peer in peers for name in peer.names}
    slots = [*configs, *((peer, name) for peer in peers for name in peer.names)]
    log(f"bench: {len(configs)} configurations + {len(peer_runs)} peers x {len(cfg.prompts)} prompts x {cfg.rounds} "
        "rounds, interleaved")
    try:
        for r in range(cfg.rounds):
            caches = suffix_caches(configs, cfg)    # a workload: each round replays it through fresh caches
            for i, prompt in enumerate(cfg.prompts):
                # rotate the order per cell, the peers among our configurations: none always runs first, and
                # a slow stretch of a shared machine falls on ours and the peers' runs alike
                shift = (r * len(cfg.prompts) + i) % len(slots)
                for slot in slots[shift:] + slots[:shift]:
                    if not isinstance(slot, Config):             # (peer, name)
                        peer, name = slot
                        peer_runs[name].append((i, peer.run(name, prompt_ids[prompt], cfg.max_new_tokens)))
                        time.sleep(PEER_SETTLE_S)
                        continue
                    runs[slot].append(run_config(pipes, slot, prompt_ids[prompt], max_new_tokens=cfg.max_new_tokens,
                                                 temperature=cfg.temperature,
                                           seed=r * 1000 + i, cache=caches.get(slot)))
                    steps.advance()
            log(f"  round {r + 1}/{cfg.rounds} done")
    finally:
        for peer in peers:
            peer.close()
    return runs, peer_runs


def _store_choices(cfg, manifest, report: dict, *, choice: dict, rows, log, settings) -> None:
    """The method choices into the report, and the γ and method choices stored with the build when greedy;
    a method choice carries the target's thread setting its rows ran with (the runtime's default)."""
    stored = {k: {"gamma": c["gamma"], "predicted_speedup": c["predicted_speedup"],
                  "measured_tokens": c["measured_tokens"]} for k, c in choice.items()}
    methods = {(tp, dp): {**c, "threads": settings[tp].options()} for (tp, dp), c in method_choices(rows).items()}
    report["method_auto"] = {f"{tp}/{dp}": c for (tp, dp), c in methods.items()}
    if cfg.temperature == 0:
        report["gamma_store"] = store_gamma_choices(cfg.output_dir, stored, build_id=manifest["build_id"],
                                                    command=report["command"])
        report["gamma_store"] += store_gamma_choices(cfg.output_dir, methods, build_id=manifest["build_id"],
                                                     command=report["command"], section="method_auto")
    else:                       # `--gamma auto` / `--method auto` are greedy measurements; this one samples
        report["gamma_store"] = [f"not stored: this bench sampled at temperature {cfg.temperature} (the stored "
                                 f"choices are greedy measurements)"]
    for line in report["gamma_store"]:
        log(f"bench: {line}")


def _store_curves(cfg, manifest, report: dict, *, pipes, log) -> None:
    """Each target's pass curve stored with the build, with the CPU and threads it ran on: the runtime's
    draft-free rounds are sized from it there (runtime/budget.py)."""
    curves = {(tp, "-"): {"ms": ms, **pipes[tp].curve_key(), "measured_tokens": 0}     # 0: never kept over
              for tp, ms in report["pass_curve_ms"].items() if hasattr(pipes[tp], "curve_key")}
    if curves:
        for line in store_gamma_choices(cfg.output_dir, curves, build_id=manifest["build_id"],
                                        command=report["command"], section="pass_curve"):
            log(f"bench: {line}")


def _write_report(report: dict, out_dir: Path, plots: bool, log) -> None:
    from specexport.report.plots import plot_report
    from specexport.report.render import render_markdown

    report["plots"] = plot_report(report, out_dir, log) if plots else []
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    write_json_atomic(out_dir / "report.json", report)
    record_report_files(out_dir, REPORT_FILES)
