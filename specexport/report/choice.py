"""Choices made from a bench's rows: the γ the measured acceptance and step costs predict best per
(target, draft) precision (`--gamma auto`), the method with the best measured speedup per precision
pair (`--method auto`), and the acceptance each quantized combination loses against fp32/fp32.
"""
from __future__ import annotations

from specexport.report.grid import VANILLA
from specexport.report.model import choose_gamma, extend, predicted_speedup
from specexport.runtime.methods import configuration


def gamma_choice(rows, costs, isolated, max_gamma: int) -> dict:
    """Per (target, draft) precision: the γ the measured acceptance (at the largest fixed γ run) and
    step costs predict best; step costs from the runs, sizes they did not make from the isolated timing."""
    choice = {}
    for r in rows:
        if r["method"] != "draft" or r["draft_stop"] or not r["acceptance_conditional"] or r["accuracy_only"]:
            continue
        key = (r["precision"], r["draft_precision"])
        if key in choice and choice[key]["measured_at_gamma"] >= r["gamma"]:
            continue
        cost, iso = costs[key], isolated[key]
        c_target = {**iso["target"], **cost["target"]}
        c_draft = cost["draft"].get(1, iso["draft"].get(1))
        top = min(max_gamma, max(c_target) - 1)
        g, s = choose_gamma(r["acceptance_conditional"], c_draft=c_draft, c_target=c_target, max_gamma=top)
        choice[key] = {"gamma": g, "predicted_speedup": s, "measured_at_gamma": r["gamma"],
                       "measured_tokens": r["delivered_tokens"],
                       "predicted_by_gamma": {str(k): predicted_speedup(extend(r["acceptance_conditional"], k),
                                                                         c_draft=c_draft, c_target=c_target)
                                              for k in range(1, top + 1)}}
    return choice


def method_choices(rows) -> dict:
    """`--method auto` per (target precision, draft precision or "-"): the row with the best measured
    speedup among those that precision pair can run (draft-free rows and rows with that draft);
    vanilla when none of them beat vanilla."""
    choices = {}
    timed = [r for r in rows if not r.get("accuracy_only")]        # accuracy-only rows measured no speed
    pairs = {(r["precision"], r["draft_precision"] or "-") for r in timed}
    pairs |= {(r["precision"], "-") for r in timed}
    for tp, dp in pairs:
        candidates = [r for r in rows if r["precision"] == tp and r["method"] != VANILLA and r["speedup_vs_vanilla"]
                      and (r["draft_precision"] or "-") in ("-", dp)]
        best = max(candidates, key=lambda r: r["speedup_vs_vanilla"], default=None)
        win = best is not None and best["speedup_vs_vanilla"] > 1.0
        row = best if win else None
        choices[(tp, dp)] = {
            "method": row["method"] if row else VANILLA, "gamma": row["gamma"] if row else 0,
            "tree": row["tree"] if row else None, "draft_stop": row["draft_stop"] if row else 0.0,
            "draft_precision": row["draft_precision"] if row else None,
            "speedup": best["speedup_vs_vanilla"] if best else None,
            "speedup_ci95": best["speedup_ci95"] if best else None,
            "best_measured": configuration(best) if best else None,
            "measured_tokens": sum(r["delivered_tokens"] for r in rows if r["precision"] == tp)}
    return choices


def acceptance_drop(rows) -> list:
    """Acceptance of each quantized combination against fp32/fp32 at the same γ."""
    ref = {r["gamma"]: r["acceptance_rate"] for r in rows
           if r["method"] == "draft" and r["precision"] == "fp32" and r["draft_precision"] == "fp32" and not r["draft_stop"]
           and not r["tree"]}
    out = []
    for r in rows:
        if r["method"] == "draft" and (r["precision"], r["draft_precision"]) != ("fp32", "fp32") and r["gamma"] in ref \
                and not r["draft_stop"] and not r["tree"]:
            out.append({"target": r["precision"], "draft": r["draft_precision"], "gamma": r["gamma"],
                        "acceptance": r["acceptance_rate"], "fp32_acceptance": ref[r["gamma"]],
                        "drop": ref[r["gamma"]] - r["acceptance_rate"],
                        "tokens_per_pass": r["mean_accepted_tokens"], "accuracy_only": r["accuracy_only"]})
    return out
