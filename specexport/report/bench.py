"""`specexport bench`: configurations interleaved and repeated, medians, report.json / report.md / plots.

A configuration is (method, target precision, draft precision, γ, draft_stop). Every round runs every
configuration once per prompt, so machine noise hits all of them alike; figures are medians over
(prompt, round) runs, and speedups are ratios of medians measured in the same run.
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.manifest import MANIFEST_NAME, read_manifest, write_json_atomic
from specexport.report.model import choose_gamma, extend, predicted_speedup, speedup_from_counts

DEFAULT_PROMPTS = ("def fibonacci(n):", "import os\n\ndef main():", "class Stack:\n    def __init__(self):")
ROW_KEYS = ("precision", "draft_precision", "method", "gamma", "tokens_per_s", "ttft_ms", "tpot_ms_p50", "tpot_ms_p90",
            "acceptance_rate", "acceptance_per_position", "mean_accepted_tokens", "speedup_vs_vanilla",
            "ideal_speedup", "efficiency")


@dataclass(frozen=True)
class BenchConfig:
    output_dir: Path
    prompts: tuple[str, ...]
    precisions: tuple[str, ...] | None = None      # default: every precision built for the target
    methods: tuple[str, ...] = ("vanilla", "draft")
    gammas: tuple[int, ...] = (2, 3, 4, 5, 6)
    draft_stops: tuple[float, ...] = ()             # adaptive-γ rows, at the largest γ, per value
    max_new_tokens: int = 128
    rounds: int = 3
    out: Path | None = None                         # default: <output_dir>/bench
    threads: int | None = None
    peers: bool = True
    plots: bool = True


def run_bench(cfg: BenchConfig, *, log=print) -> dict:
    import specexport

    manifest = read_manifest(cfg.output_dir)
    models = manifest["models"]
    built = list(models["target"]["precisions"])
    precisions = list(cfg.precisions or built)
    has_draft = "draft" in models and "draft" in cfg.methods
    configs = _configs(precisions, models, cfg, has_draft)
    # One pipeline (one target session) per target precision; every draft precision is switched in on
    # it. Vanilla and speculative runs thus share the target's session: a second session of the same
    # model, idle with a spinning thread pool, would slow whichever session runs next.
    pipes = {tp: specexport.load(cfg.output_dir, precision=tp, threads=cfg.threads) for tp in precisions}
    cost_keys = sorted({(tp, dp) for _, tp, dp, _, _ in configs}, key=str)
    for tp, dp in cost_keys:                        # open every draft before the runs; time every forward
        pipes[tp].target.timings = {}
        if dp is not None:
            pipes[tp].use_draft_precision(dp)
            pipes[tp].draft.timings = {}
    out_dir = Path(cfg.out or cfg.output_dir / "bench")
    peers, skipped = _open_peers(manifest, precisions, cfg, out_dir, log)
    prompt_ids = {p: next(iter(pipes.values())).encode(p) for p in cfg.prompts}
    runs = {c: [] for c in configs}
    peer_runs = [[] for _ in peers]
    log(f"bench: {len(configs)} configurations + {len(peers)} peers x {len(cfg.prompts)} prompts x {cfg.rounds} "
        "rounds, interleaved")
    for r in range(cfg.rounds):
        for prompt in cfg.prompts:
            ours = {}
            for c in configs:
                method, tp, dp, g, stop = c
                if dp is not None:
                    pipes[tp].use_draft_precision(dp)
                out = pipes[tp].generate(prompt, max_new_tokens=cfg.max_new_tokens, method=method,
                                         gamma=max(g, 1), draft_stop=stop)
                runs[c].append(out.stats)
                ours.setdefault(tp, out.token_ids)
            for p, peer_run in zip(peers, peer_runs):
                start = time.perf_counter()
                got = p.run(prompt_ids[prompt], cfg.max_new_tokens)
                seconds = time.perf_counter() - start
                ref = ours.get(p.precision.split()[0], [])
                peer_run.append((len(got) / seconds, got[:len(ref)] == ref[:len(got)]))
        log(f"  round {r + 1}/{cfg.rounds} done")
    max_t = max(cfg.gammas) + 1
    in_loop = {(tp, dp): _in_loop_costs(pipes[tp].target, pipes[tp].drafts.get(dp), max_t) for tp, dp in cost_keys}
    for pipe in pipes.values():                     # the isolated timing below is not part of the runs
        for b in (pipe.target, *pipe.drafts.values()):
            b.timings = None
    isolated, costs = {}, {}
    for tp, dp in cost_keys:
        if dp is not None:
            pipes[tp].use_draft_precision(dp)
        isolated[(tp, dp)] = _step_costs(pipes[tp], max_t, dp is not None)
        costs[(tp, dp)] = {**isolated[(tp, dp)], **in_loop[(tp, dp)]}
    rows = [_row(c, runs, costs[c[1], c[2]]) for c in configs]
    choice = _gamma_choice(rows, costs)
    report = {
        "command": " ".join(sys.argv),
        "output_dir": str(cfg.output_dir),
        "settings": {"prompts": len(cfg.prompts), "rounds": cfg.rounds, "max_new_tokens": cfg.max_new_tokens,
                     "greedy": True, "threads": cfg.threads},
        "rows": rows,
        "step_costs_ms": {f"{tp}/{dp or '-'}": v for (tp, dp), v in costs.items()},
        "step_costs_isolated_ms": {f"{tp}/{dp or '-'}": v for (tp, dp), v in isolated.items()},
        "gamma_auto": choice,
        "acceptance_drop": _acceptance_drop(rows),
        "memory": _memory(manifest, pipes),
        "peers": [_peer_row(p, r) for p, r in zip(peers, peer_runs)] + skipped,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(render_markdown(report))
    report["plots"] = _plots(report, out_dir, log) if cfg.plots else []
    _store_gamma_choice(cfg.output_dir, choice)
    return report


def _open_peers(manifest, precisions, cfg, out_dir: Path, log):
    if not cfg.peers:
        return [], [{"peer": "all", "skipped": "peers not requested"}]
    from specexport.report.peers import open_peers

    return open_peers(manifest, precisions, work_dir=out_dir / "peers", log=log)


def _peer_row(peer, runs) -> dict:
    return {"peer": peer.name, "precision": peer.precision, "tokens_per_s": statistics.median(s for s, _ in runs),
            "same_tokens_as_specexport": sum(same for _, same in runs) / len(runs), "runs": len(runs)}


def _configs(precisions, models, cfg, has_draft):
    """Per target precision: vanilla; the draft of the same precision at every γ (and the adaptive
    rows); with an fp32 target, every quantized draft at every γ (the edge trick: quantize the draft
    harder); with a quantized target, the fp32 draft at the first γ (acceptance cost of that side)."""
    configs = []
    draft_built = models.get("draft", {}).get("precisions", {}) if has_draft else {}
    for p in precisions:
        if "vanilla" in cfg.methods:
            configs.append(("vanilla", p, None, 0, 0.0))
        if p in draft_built:
            configs += [("draft", p, p, g, 0.0) for g in cfg.gammas]
            configs += [("draft", p, p, max(cfg.gammas), stop) for stop in cfg.draft_stops if stop > 0]
    if "fp32" in draft_built:
        for p in precisions:
            if p != "fp32":
                configs.append(("draft", p, "fp32", cfg.gammas[0], 0.0))
    if "fp32" in precisions:
        for d in draft_built:
            if d != "fp32":
                configs += [("draft", "fp32", d, g, 0.0) for g in cfg.gammas]
    return configs


def _step_costs(pipe, max_t: int, with_draft: bool, reps: int = 30) -> dict:
    """Median seconds of one target forward for T = 1..max_t and one draft step, at a context of 64
    tokens (fewer when max_seq_len is small)."""
    ctx = np.arange(3, 3 + max(1, min(64, pipe.capacity - max_t))) % pipe.target.vocab_size
    samples = {t: [] for t in range(1, max_t + 1)}
    draft = []
    for _ in range(reps):
        for t in samples:
            samples[t].append(_time_forward(pipe.target, ctx, t))
        if with_draft:
            draft.append(_time_forward(pipe.draft, ctx, 1))
    out = {str(t): statistics.median(v) * 1e3 for t, v in samples.items()}
    out["draft"] = statistics.median(draft) * 1e3 if draft else None
    return out


def _in_loop_costs(target, draft, max_t: int, min_samples: int = 5) -> dict:
    """Median ms of the forwards timed inside the runs: target per T, the draft's T = 1 step.
    These are the costs the runs actually paid (real contexts, caches and thread pools as they
    were between calls); sizes with fewer than `min_samples` calls are left to the isolated timing."""
    out = {str(t): statistics.median(v) * 1e3 for t, v in sorted((target.timings or {}).items())
           if t <= max_t and len(v) >= min_samples}
    one = (draft.timings or {}).get(1, []) if draft is not None else []
    if len(one) >= min_samples:
        out["draft"] = statistics.median(one) * 1e3
    return out


def _time_forward(backend, ctx, t: int) -> float:
    backend.reset()
    backend.forward(ctx)
    backend.commit(len(ctx))
    start = time.perf_counter()
    backend.forward(ctx[:t])
    return time.perf_counter() - start


def _row(c, runs, cost) -> dict:
    method, tp, dp, g, stop = c
    st = runs[c]
    tps = statistics.median(s.tokens_per_second for s in st)
    tpot = [s.tpot_s * 1e3 for s in st if s.emitted > 1]
    proposed = sum(s.proposed for s in st)
    accepted_at = np.sum([s.accepted_at for s in st], axis=0) if g else np.zeros(0)
    proposed_at = np.sum([s.proposed_at for s in st], axis=0) if g else np.zeros(0)
    per_pos = (accepted_at / np.maximum(proposed_at, 1)).tolist() if g else []
    # conditional acceptance: P(pos i accepted | pos i-1 accepted); only meaningful when every round
    # proposed γ tokens (an adaptive round that stopped early has no position i to accept)
    cond = [per_pos[0]] + [per_pos[i] / per_pos[i - 1] if per_pos[i - 1] else 0.0 for i in range(1, len(per_pos))] \
        if per_pos and not stop else []
    vanilla = runs.get(("vanilla", tp, None, 0, 0.0))
    base = statistics.median(s.tokens_per_second for s in vanilla) if vanilla else None
    passes = sum(s.target_passes for s in st)
    if g and cost.get("draft") and stop:
        by_length = {j + 1: int(proposed_at[j] - (proposed_at[j + 1] if j + 1 < g else 0)) for j in range(g)}
        by_length[0] = passes - int(proposed_at[0])
        ideal = speedup_from_counts(sum(s.emitted - 1 for s in st), by_length, c_draft=cost["draft"],
                                    c_target=_target_costs(cost))
    elif g and cost.get("draft"):
        ideal = predicted_speedup(cond, c_draft=cost["draft"], c_target=_target_costs(cost))
    else:
        ideal = 1.0
    speedup = tps / base if base else None
    return {
        "precision": tp, "draft_precision": dp, "method": method, "gamma": g, "draft_stop": stop,
        "tokens_per_s": tps, "ttft_ms": statistics.median(s.ttft_s * 1e3 for s in st),
        "tpot_ms_p50": float(np.percentile(tpot, 50)) if tpot else None,
        "tpot_ms_p90": float(np.percentile(tpot, 90)) if tpot else None,
        "acceptance_rate": sum(s.accepted for s in st) / proposed if proposed else None,
        "acceptance_per_position": per_pos, "acceptance_conditional": cond,
        "mean_accepted_tokens": sum(s.emitted - 1 for s in st) / passes if passes else None,
        "speedup_vs_vanilla": speedup, "ideal_speedup": ideal,
        "efficiency": speedup / ideal if speedup and ideal else None,
    }


def _target_costs(cost: dict) -> dict[int, float]:
    """{T: ms} of one target forward, from a step-cost record (which also holds the draft's cost)."""
    return {int(k): v for k, v in cost.items() if k != "draft"}


def _gamma_choice(rows, costs) -> dict:
    """Per precision: the γ the measured acceptance (at the largest γ run) and step costs predict best."""
    choice = {}
    for r in rows:
        if r["method"] != "draft" or r["precision"] != r["draft_precision"] or r["draft_stop"]:
            continue
        best_so_far = choice.get(r["precision"])
        if best_so_far and best_so_far["measured_at_gamma"] >= r["gamma"]:
            continue
        cost = costs[(r["precision"], r["draft_precision"])]
        c_target = _target_costs(cost)
        g, s = choose_gamma(r["acceptance_conditional"], c_draft=cost["draft"], c_target=c_target,
                            max_gamma=max(c_target) - 1)
        choice[r["precision"]] = {"gamma": g, "predicted_speedup": s, "measured_at_gamma": r["gamma"],
                                  "predicted_by_gamma": {str(k): predicted_speedup(
                                      extend(r["acceptance_conditional"], k), c_draft=cost["draft"], c_target=c_target)
                                      for k in range(1, max(c_target))}}
    return choice


def _acceptance_drop(rows) -> list:
    """Acceptance of each quantized combination against fp32/fp32 at the same γ."""
    ref = {r["gamma"]: r["acceptance_rate"] for r in rows
           if r["method"] == "draft" and r["precision"] == "fp32" and r["draft_precision"] == "fp32" and not r["draft_stop"]}
    out = []
    for r in rows:
        if r["method"] == "draft" and (r["precision"], r["draft_precision"]) != ("fp32", "fp32") and r["gamma"] in ref \
                and not r["draft_stop"]:
            out.append({"target": r["precision"], "draft": r["draft_precision"], "gamma": r["gamma"],
                        "acceptance": r["acceptance_rate"], "fp32_acceptance": ref[r["gamma"]],
                        "drop": ref[r["gamma"]] - r["acceptance_rate"]})
    return out


def _memory(manifest, pipes) -> dict:
    weights = {}
    for role, m in manifest["models"].items():
        for p, e in m["precisions"].items():
            weights[f"{role}/{p}"] = e["size_bytes"]
    kv = {f"{tp}/{dp}": p.target.kv_bytes + d.kv_bytes for tp, p in pipes.items() for dp, d in p.drafts.items()}
    kv.update({f"{tp}/-": p.target.kv_bytes for tp, p in pipes.items()})
    return {"weights_bytes": weights, "kv_buffer_bytes": kv,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _store_gamma_choice(output_dir: Path, choice: dict) -> None:
    manifest = read_manifest(output_dir)
    manifest["gamma_auto"] = {p: {"gamma": c["gamma"], "predicted_speedup": c["predicted_speedup"]}
                              for p, c in choice.items()}
    write_json_atomic(Path(output_dir) / MANIFEST_NAME, manifest)


def quick_bench(output_dir: Path, *, max_verify_tokens: int, log=print) -> dict:
    """The short report `specexport build` ends with: every built precision, vanilla and γ = 1..6,
    one round of the default prompts, 32 tokens; no peers, no plots. Also stores the γ choice."""
    gammas = tuple(range(1, min(6, max_verify_tokens - 1) + 1))
    cfg = BenchConfig(output_dir=Path(output_dir), prompts=DEFAULT_PROMPTS, gammas=gammas, max_new_tokens=32,
                      rounds=1, peers=False, plots=False)
    return run_bench(cfg, log=log)


def short_table(report: dict) -> list[tuple]:
    """(target, draft, method, γ, tok/s, acceptance, speedup) rows: vanilla and the best γ per precision."""
    best = {}
    for r in report["rows"]:
        key = (r["precision"], r["draft_precision"], r["method"])
        if key not in best or (r["speedup_vs_vanilla"] or 0) > (best[key]["speedup_vs_vanilla"] or 0):
            best[key] = r
    return [(r["precision"], r["draft_precision"] or "-", r["method"], r["gamma"] or "-", r["tokens_per_s"],
             r["acceptance_rate"], r["speedup_vs_vanilla"]) for r in best.values()]


def render_markdown(report: dict) -> str:
    lines = [f"# specexport bench: {report['output_dir']}", "",
             f"`{report['command']}`, {report['settings']['prompts']} prompts x {report['settings']['rounds']} rounds, "
             f"{report['settings']['max_new_tokens']} new tokens, greedy; medians of interleaved runs.", "",
             "| target | draft | method | γ | tok/s | TTFT ms | TPOT p50 | TPOT p90 | acceptance | tokens/pass "
             "| speedup | ideal | efficiency |", "|" + "---|" * 13]
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for r in report["rows"]:
        g = f"≤{r['gamma']}, stop {r['draft_stop']:g}" if r["draft_stop"] else (r["gamma"] or "-")
        lines.append(f"| {r['precision']} | {r['draft_precision'] or '-'} | {r['method']} | {g} | "
                     f"{f(r['tokens_per_s'], '.1f')} | {f(r['ttft_ms'], '.2f')} | {f(r['tpot_ms_p50'], '.3f')} | "
                     f"{f(r['tpot_ms_p90'], '.3f')} | {f(r['acceptance_rate'], '.3f')} | "
                     f"{f(r['mean_accepted_tokens'], '.2f')} | {f(r['speedup_vs_vanilla'], '.2f')}x | "
                     f"{f(r['ideal_speedup'], '.2f')}x | {f(r['efficiency'], '.2f')} |")
    lines += ["", "## γ chosen for `--gamma auto`", ""]
    for p, c in report["gamma_auto"].items():
        verdict = "vanilla (speculation predicted to lose)" if c["gamma"] == 0 else f"γ = {c['gamma']}"
        lines.append(f"- {p}: {verdict}, predicted speedup {c['predicted_speedup']:.2f}x")
    if report["acceptance_drop"]:
        lines += ["", "## Acceptance cost of quantization (vs fp32 target and draft)", ""]
        for d in report["acceptance_drop"]:
            lines.append(f"- target {d['target']}, draft {d['draft']}, γ {d['gamma']}: {d['acceptance']:.3f} "
                         f"(fp32 {d['fp32_acceptance']:.3f}, drop {d['drop']:+.3f})")
    lines += ["", "## Step costs (ms per forward: median of the forwards timed inside the runs; sizes the runs "
              "did not make often enough: one isolated forward at a 64-token context)", ""]
    for title, table in (("used for the ideal", report["step_costs_ms"]),
                         ("isolated", report.get("step_costs_isolated_ms", {}))):
        for k, v in table.items():
            lines.append(f"- {k} ({title}): " + ", ".join(f"T={t}: {c:.3f}" if t != "draft" else f"draft: {c:.3f}"
                                                          for t, c in v.items() if c is not None))
    lines += ["", "## Peers (same weights and prompt tokens, interleaved in the same run)", ""]
    for p in report["peers"]:
        if "skipped" in p:
            lines.append(f"- {p['peer']}: skipped ({p['skipped']})")
            continue
        prec = p["precision"].split()[0]
        mine = [r for r in report["rows"] if r["precision"] == prec and r["draft_precision"] in (None, prec)]
        best = max(mine, key=lambda r: r["tokens_per_s"], default=None)
        vanilla = next((r for r in mine if r["method"] == "vanilla"), None)
        ratio = (f"; specexport {prec} best ({best['method']} γ {best['gamma'] or '-'}) is "
                 f"{best['tokens_per_s'] / p['tokens_per_s']:.2f}x" if best else "")
        ratio += f", specexport {prec} vanilla {vanilla['tokens_per_s'] / p['tokens_per_s']:.2f}x" if vanilla else ""
        lines.append(f"- {p['peer']} ({p['precision']}): {p['tokens_per_s']:.1f} tok/s{ratio}; greedy tokens equal to "
                     f"ours in {p['same_tokens_as_specexport']:.0%} of {p['runs']} runs")
    lines.append("")
    return "\n".join(lines)


def _plots(report: dict, out: Path, log) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (pip install 'specexport[bench]')")
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for p, c in report["gamma_auto"].items():
        rows = [r for r in report["rows"] if r["method"] == "draft" and r["precision"] == p == r["draft_precision"]
                and not r["draft_stop"]]
        ax.plot([r["gamma"] for r in rows], [r["speedup_vs_vanilla"] for r in rows], "o-", label=f"{p} measured")
        pred = c["predicted_by_gamma"]
        ax.plot([int(k) for k in pred], list(pred.values()), "x--", label=f"{p} predicted")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("γ (draft tokens per round)")
    ax.set_ylabel("speedup vs vanilla")
    ax.legend()
    fig.tight_layout()
    path = out / "speedup_vs_gamma.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
