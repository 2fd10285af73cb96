"""From the runs of one bench to its rows: throughput on decode time, the ideal from the rounds that
ran, efficiency, and a 95% interval for every speedup. Pure functions over DecodeStats records.

Definitions (every row; `cells` are the (round, prompt) pairs, each run once per configuration):
    tokens/s      Σ (delivered - 1) / Σ decode_s           decode time only; TTFT is reported apart
    speedup       tokens/s of the row / tokens/s of vanilla on the same target precision
    interval      2.5th-97.5th percentile of the speedup over cells resampled with replacement
                  (each resampled cell brings its vanilla run and its speculative run: a paired bootstrap)
    ideal         Σ (delivered - 1) · c_vanilla(1) / Σ over the decode-time forwards the row made of
                  c_role(T): the speedup if nothing but the forwards cost time. c are means of the
                  decode-time forwards timed inside the row's own runs (c_vanilla(1): the vanilla row's;
                  prefill forwards are tagged apart). Priced with the mean over every row of the session
                  instead, a row whose forwards ran faster than the session's mean got an ideal below
                  what its own forwards allowed (issue 33: draft γ 6, efficiency 1.04). The forward
                  counts are the rounds that actually ran, shortened last rounds, plain steps and the draft's two-token catch-up calls included, fixed γ or adaptive.
                  Means, not medians: the ideal must split the measured time into forwards and the
                  rest, and the forward times have a right tail (a shared machine's slow moments) that
                  differs by forward size. With medians the tail landed in "overhead", most of all for
                  vanilla's small forwards, and efficiency reached 1.023 on a 110M model whose loop
                  costs 1.5% of a step; with means it is the ratio of the two sides' forward shares.
    free draft    the ideal with every draft (or heads) forward free: what the verify passes alone allow
    free verify   the ideal with every target pass costing one decode step, c_target(1): what the
                  draft's cost alone allows. The smaller of the two names what caps the row.
    efficiency    speedup / ideal: what the loop around the forwards loses, relative to vanilla's loop.
                  Above 1.02 means the baseline lost more outside its forwards than the speculative run
                  did, or the two sides ran on different machines in effect: a bug to find.
"""
from __future__ import annotations

import statistics

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def decode_costs(timings: dict | None) -> dict[int, float]:
    """{T: mean seconds} of the decode-time forwards a backend timed ({(phase, T): [s]})."""
    return {T: statistics.fmean(v) for (phase, T), v in sorted((timings or {}).items()) if phase == "decode" and v}


def row_costs(runs) -> dict | None:
    """{"target": {T: mean s}, "draft": {T: mean s}} of the decode-time forwards the runs themselves made
    (DecodeStats.forward_seconds, set by the bench's timed runs); None when a run carries none."""
    if not runs or any(getattr(s, "forward_seconds", None) is None for s in runs):
        return None
    pooled: dict = {"target": {}, "draft": {}}
    for s in runs:
        for role, by_size in s.forward_seconds.items():
            for T, seconds in by_size.items():
                pooled[role].setdefault(T, []).extend(seconds)
    return {role: {T: statistics.fmean(v) for T, v in sorted(t.items())} for role, t in pooled.items()}


def ideal_cost(stats, c_target: dict[int, float], c_draft: dict[int, float]) -> float:
    """Seconds the run's decode-time forwards would take at the median step costs."""
    cost = 0.0
    for (role, T), n in stats.forwards.items():
        table = c_target if role == "target" else c_draft
        if T not in table:
            raise KeyError(f"no timed {role} forward of {T} tokens: timings were off during the runs")
        cost += n * table[T]
    return cost


def throughput(runs) -> float | None:
    """Σ (delivered - 1) / Σ decode seconds over runs."""
    tokens = sum(max(s.delivered - 1, 0) for s in runs)
    seconds = sum(s.decode_s for s in runs)
    return tokens / seconds if tokens and seconds > 0 else None


def speedup_interval(spec, vanilla, *, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> list[float] | None:
    """95% paired-bootstrap interval of the throughput ratio; spec[i] and vanilla[i] share a cell."""
    if len(spec) != len(vanilla) or len(spec) < 2:
        return None
    arrays = [np.array([max(s.delivered - 1, 0) for s in runs], float) for runs in (spec, vanilla)]
    times = [np.array([s.decode_s for s in runs], float) for runs in (spec, vanilla)]
    idx = np.random.default_rng(seed).integers(0, len(spec), size=(resamples, len(spec)))     # [R, cells]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (arrays[0][idx].sum(1) / times[0][idx].sum(1)) / (arrays[1][idx].sum(1) / times[1][idx].sum(1))
    ratio = ratio[np.isfinite(ratio)]
    if not len(ratio):
        return None
    return [float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))]


def throughput_interval(tokens, seconds, *, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> list[float] | None:
    """95% bootstrap interval of Σ tokens / Σ seconds over runs (a peer's runs, resampled with replacement)."""
    tokens, seconds = np.asarray(tokens, float), np.asarray(seconds, float)
    if len(tokens) < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, len(tokens), size=(resamples, len(tokens)))
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = tokens[idx].sum(1) / seconds[idx].sum(1)
    rate = rate[np.isfinite(rate)]
    return [float(np.percentile(rate, 2.5)), float(np.percentile(rate, 97.5))] if len(rate) else None


def ideal_speedup(runs, *, c_vanilla1: float, c_target: dict, c_draft: dict) -> float | None:
    tokens = sum(max(s.delivered - 1, 0) for s in runs)
    cost = sum(ideal_cost(s, c_target, c_draft) for s in runs)
    return tokens * c_vanilla1 / cost if tokens and cost > 0 else None


def where_time_goes(runs, *, c_vanilla1: float, c_target: dict, c_draft: dict) -> dict:
    """The row's draft cost per target step, its verify passes' mean cost in steps, the ideal with a
    free draft and with free verification, and which of the two caps it."""
    free_draft = ideal_speedup(runs, c_vanilla1=c_vanilla1, c_target=c_target, c_draft={t: 0.0 for t in c_draft})
    free_verify = ideal_speedup(runs, c_vanilla1=c_vanilla1, c_target={t: c_vanilla1 for t in c_target}, c_draft=c_draft)
    target = [(T, n) for s in runs for (role, T), n in s.forwards.items() if role == "target"]
    passes = sum(n for _, n in target)
    verify = sum(n * c_target[T] for T, n in target) / (passes * c_vanilla1) if passes else None
    capped = None
    if free_draft and free_verify:
        capped = "verify" if free_draft < free_verify else "draft"
    drafted = any(role != "target" for s in runs for (role, _) in s.forwards)
    return {"draft_step_ratio": c_draft.get(1, 0.0) / c_vanilla1 if drafted and c_draft else 0.0,
            "verify_step_ratio": verify, "ideal_free_draft": free_draft, "ideal_free_verify": free_verify,
            "capped_by": capped}


def acceptance_figures(runs, gamma: int, adaptive: bool) -> dict:
    """Acceptance overall, per position, conditional per position (fixed γ only), tokens per pass."""
    proposed = sum(s.proposed for s in runs)
    passes = sum(s.target_passes for s in runs)
    out = {"acceptance_rate": sum(s.accepted for s in runs) / proposed if proposed else None,
           "acceptance_per_position": [], "acceptance_conditional": [],
           "mean_accepted_tokens": sum(s.emitted - 1 for s in runs) / passes if passes else None,
           "rounds_by_proposals": _rounds_by_proposals(runs)}
    if gamma:
        accepted_at = np.sum([s.accepted_at for s in runs], axis=0)
        proposed_at = np.sum([s.proposed_at for s in runs], axis=0)
        per_pos = (accepted_at / np.maximum(proposed_at, 1)).tolist()
        out["acceptance_per_position"] = per_pos
        # conditional: P(pos i accepted | pos i-1 accepted); meaningful when rounds were not cut short
        # by draft_stop (an adaptive round that stopped early has no position i to accept)
        if per_pos and not adaptive:
            out["acceptance_conditional"] = [per_pos[0]] + [per_pos[i] / per_pos[i - 1] if per_pos[i - 1] else 0.0
                                                            for i in range(1, len(per_pos))]
    return out


def _rounds_by_proposals(runs) -> dict[str, int]:
    counts: dict[int, int] = {}
    for s in runs:
        for j, _ in s.rounds:
            counts[j] = counts.get(j, 0) + 1
    return {str(j): counts[j] for j in sorted(counts)}


def timing_figures(runs) -> dict:
    tpot = [s.tpot_s * 1e3 for s in runs if s.delivered > 1]
    med = lambda xs: statistics.median(xs) if xs else None      # noqa: E731
    return {"ttft_ms": med([s.ttft_s * 1e3 for s in runs]),
            "prefill_ms": med([s.prefill_s * 1e3 for s in runs]),
            "draft_prefill_ms": med([s.draft_prefill_s * 1e3 for s in runs]) if any(s.draft_prefill_s for s in runs)
            else None,
            "tpot_ms_p50": float(np.percentile(tpot, 50)) if tpot else None,
            "tpot_ms_p90": float(np.percentile(tpot, 90)) if tpot else None,
            "delivered_tokens": sum(s.delivered for s in runs), "runs": len(runs),
            # for comparison with figures that include prefill (the first token and TTFT counted in)
            "tokens_per_s_end_to_end": (sum(s.delivered for s in runs) / total if (total := sum(
                s.total_s for s in runs)) > 0 else None)}
