"""A bench report as markdown (report.md) and as a plot of speedup against γ."""
from __future__ import annotations



def _f(v, fmt: str, unit: str = "") -> str:
    return "-" if v is None else format(v, fmt) + unit


def _speedup(r: dict, key: str = "speedup_vs_vanilla", ci_key: str = "speedup_ci95") -> str:
    s, ci = r.get(key), r.get(ci_key)
    if s is None:
        return "-"
    return f"{s:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci and (r["method"] != "vanilla" or key != "speedup_vs_vanilla")
                          else "")


def _draft_threads(st: dict) -> str:
    n = st["draft_threads"]       # reports before December 2026: 1 (the draft ran on one thread then)
    return f"{n} thread{'s' * (n != 1)}" if isinstance(n, int) else f"{n} threads"


def render_markdown(report: dict) -> str:
    """report.md: the settings, the rows, then a section per part of the report."""
    lines = [*_header_lines(report), *_row_lines(report), *_suffix_lines(report), *_time_lines(report),
             *_curve_lines(report), *_choice_lines(report), *_step_lines(report), *_peer_lines(report),
             *_memory_lines(report), ""]
    return "\n".join(lines)


def _header_lines(report: dict) -> list[str]:
    st = report["settings"]
    threads = "; ".join(f"{tp} target: {label}" for tp, label in st["target_threads"].items())
    decoding = "greedy" if st.get("greedy", True) else \
        f"sampled at temperature {st['temperature']} (each cell's runs share a seed)"
    return [f"# specexport bench: {report['output_dir']}", "",
            f"`{report['command']}`: {st['prompts']} prompts x {st['rounds']} rounds, {st['max_new_tokens']} new "
            f"tokens, {decoding}, every configuration interleaved per prompt after an untimed warm-up.", "",
            "tok/s, TPOT and speedup are on decode time (first token to last delivered token; prefill is in "
            "TTFT) and count delivered tokens only. Speedup: tok/s over vanilla's on the same target session, "
            f"with a 95% paired-bootstrap interval over (prompt, round) cells ({st['bootstrap_resamples']} "
            "resamples). Ideal: the speedup if only the forwards cost time, from the forwards the rounds "
            "actually made and the mean in-run cost of each size; efficiency = speedup / ideal. vs fp32: a "
            "quantized target's row over the fp32 target's vanilla tok/s, interval alike. \"accuracy only\": a "
            "GPU precision (fp16, fp8, int8_sq) run on ONNX Runtime CPU, where its Q/DQ is emulated: its "
            "acceptance and tokens per pass are what the GPU engine gets, its time is not.", "",
            f"Threads: {threads} (the fastest for vanilla of those tried; speculative rows use the same "
            f"session); draft: {_draft_threads(st)}.", "",
            *([f"Kernels: {'; '.join(f'{tp} target: {k}' for tp, k in st['kernels'].items())}.", ""]
              if st.get("kernels") else [])]


def _row_lines(report: dict) -> list[str]:
    lines = ["| target | draft | method | γ | tok/s | TTFT ms | TPOT p50 | TPOT p90 | acceptance | tokens/pass "
             "| speedup [95% CI] | ideal | efficiency | vs fp32 vanilla [95% CI] |", "|" + "---|" * 14]
    for r in report["rows"]:
        g = (f"≤{r['gamma']}, stop {r['draft_stop']:g}" if r["draft_stop"] else
             f"tree {r['tree']} (depth {r['gamma']})" if r.get("tree") else
             f"≤{r['gamma']}" if r["method"] in ("lookup", "suffix") else (r["gamma"] or "-"))
        lines.append(f"| {r['precision']} | {r['draft_precision'] or '-'} | {r['method']} | {g} | "
                     f"{_f(r['tokens_per_s'], '.1f')} | {_f(r['ttft_ms'], '.2f')} | {_f(r['tpot_ms_p50'], '.3f')} | "
                     f"{_f(r['tpot_ms_p90'], '.3f')} | {_f(r['acceptance_rate'], '.3f')} | "
                     f"{_f(r['mean_accepted_tokens'], '.2f')} | "
                     f"{'accuracy only' if r.get('accuracy_only') else _speedup(r)} | "
                     f"{_f(r['ideal_speedup'], '.2f', 'x')} | {_f(r['efficiency'], '.2f')} | "
                     f"{_speedup(r, 'speedup_vs_fp32_vanilla', 'speedup_vs_fp32_ci95')} |")
    return lines


def _suffix_lines(report: dict) -> list[str]:
    suffix = [r for r in report["rows"] if r["method"] == "suffix" and r.get("suffix_hit_rate") is not None]
    if not suffix:
        return []
    lines = ["", "## Suffix decoding", "",
             "Hit rate: rounds whose lookup found a match and proposed; from the cache: of those, the share "
             "whose tree came from earlier requests (only with --workload, which replays the requests in "
             "order through one cache per round); proposal: the mean time of a lookup and its tree.", "",
             "| target | hit rate | from the cache | proposal µs | proposal / target step |", "|" + "---|" * 5]
    for r in suffix:
        step = report.get("step_costs_ms", {}).get(f"{r['precision']}/-", {}).get("target", {}).get("1")
        ratio = r["suffix_propose_us"] / 1e3 / step if step and r["suffix_propose_us"] else None
        lines.append(f"| {r['precision']} | {_f(r['suffix_hit_rate'], '.2f')} | "
                     f"{_f(r['suffix_from_shared'], '.2f')} | {_f(r['suffix_propose_us'], '.0f')} | "
                     f"{_f(ratio, '.3f')} |")
    return lines


def _time_lines(report: dict) -> list[str]:
    lines = ["", "## Where the time goes", "",
             "Draft: the draft's (or heads') cost of one call in target decode steps. Verify: a target pass's "
             "mean cost in decode steps over the passes the row made. The ideal with a free draft and with "
             "free verification (every pass at one step's cost); the smaller one names what caps the row.", "",
             "| target | draft | method | γ | draft / step | verify pass / step | ideal | ideal, free draft "
             "| ideal, free verify | capped by |", "|" + "---|" * 10]
    for r in report["rows"]:
        if r["method"] == "vanilla" or r.get("ideal_free_draft") is None:
            continue
        g = f"tree {r['tree']}" if r.get("tree") else (r["gamma"] or "-")
        lines.append(f"| {r['precision']} | {r['draft_precision'] or '-'} | {r['method']} | {g} | "
                     f"{_f(r['draft_step_ratio'], '.2f')} | {_f(r['verify_step_ratio'], '.2f')} | "
                     f"{_f(r['ideal_speedup'], '.2f', 'x')} | {_f(r['ideal_free_draft'], '.2f', 'x')} | "
                     f"{_f(r['ideal_free_verify'], '.2f', 'x')} | {r['capped_by'] or '-'} |")
    return lines


def _choice_lines(report: dict) -> list[str]:
    """What --gamma auto and --method auto chose, and what quantization cost in acceptance."""
    lines = ["", "## γ chosen for `--gamma auto`", ""]
    for key, c in report["gamma_auto"].items():
        verdict = "vanilla (speculation predicted to lose)" if c["gamma"] == 0 else f"γ = {c['gamma']}"
        lines.append(f"- target/draft {key}: {verdict}, predicted speedup {c['predicted_speedup']:.2f}x "
                     f"(acceptance measured at γ {c['measured_at_gamma']} on {c['measured_tokens']} tokens)")
    lines += ["", "## Chosen for `--method auto` (the fastest measured; vanilla when all lost)", ""]
    for key, c in report.get("method_auto", {}).items():
        chosen = c["method"] + (f" γ {c['gamma']}" if c["method"] != "vanilla" else "") + \
            (f" tree {c['tree']}" if c["tree"] else "")
        best = f"{c['speedup']:.2f}x" if c["speedup"] else "-"
        lines.append(f"- target/draft {key}: {chosen} (best measured {c['best_measured'] or '-'} at {best})")
    lines += [f"- {line}" for line in report.get("gamma_store", [])]
    if report["acceptance_drop"]:
        lines += ["", "## Acceptance cost of quantization (vs fp32 target and draft)", ""]
        for d in report["acceptance_drop"]:
            lines.append(f"- target {d['target']}, draft {d['draft']}, γ {d['gamma']}: {d['acceptance']:.3f} "
                         f"(fp32 {d['fp32_acceptance']:.3f}, drop {d['drop']:+.3f}; "
                         f"{_f(d.get('tokens_per_pass'), '.2f')} tokens per pass)")
    return lines


def _step_lines(report: dict) -> list[str]:
    lines = ["", "## Step costs (ms per forward; in-run: mean of the decode-time forwards of the runs, "
             "used for the ideal and the γ choice; isolated: median of one forward at a 64-token context, "
             "used to predict γ beyond the sizes the runs made)", ""]
    for title, table in (("in-run", report["step_costs_ms"]), ("isolated", report["step_costs_isolated_ms"])):
        for key, roles in table.items():
            parts = [f"{role} T={t}: {c:.3f}" for role, costs in roles.items() for t, c in costs.items()]
            lines.append(f"- {key} ({title}): " + ", ".join(parts))
    return lines


def _memory_lines(report: dict) -> list[str]:
    mem = report["memory"]
    lines = ["", "## Memory", "", f"- bench process peak RSS {mem['peak_rss_bytes'] / 2**20:.0f} MiB "
             f"({mem['peak_rss_note']})"]
    for name, rss in mem["peers_peak_rss_bytes"].items():
        lines.append(f"- {name} (own process): peak RSS {_f(rss and rss / 2**20, '.0f')} MiB")
    return lines


def _curve_lines(report: dict) -> list[str]:
    """The target pass by its rows, c(M) and c(M)/c(1): what a verify pass of M tokens costs here."""
    curves = report.get("pass_curve_ms") or {}      # reports before December 2026 have none
    if not curves:
        return []
    sizes = sorted({int(m) for c in curves.values() for m in c})
    kernels = report["settings"].get("kernels") or {}
    lines = ["", "### A target pass by its rows: c(M) and c(M)/c(1)", "",
             "Median ms of one M-row forward after a 64-token prefill (sizes interleaved, 7 each, nothing "
             "committed): what verifying M tokens costs; flat is what speculation needs.", "",
             "| target | kernels | " + " | ".join(f"M={m}" for m in sizes) + " |", "|" + "---|" * (2 + len(sizes))]
    tiers = report.get("pass_curve_tiers") or {}
    for tp, curve in curves.items():
        one = curve["1"]
        cells = [f"{curve[str(m)]:.2f} ms" + ("" if m == 1 else f", {curve[str(m)] / one:.2f}x")
                 if str(m) in curve else "-" for m in sizes]
        lines.append(f"| {tp} | {kernels.get(tp, 'ONNX Runtime')} | " + " | ".join(cells) + " |")
        if tp in tiers:                     # which kernel path each M ran on (the tiers path, measured here)
            lines.append(f"| {tp} | tier by M | " + " | ".join(tiers[tp].get(str(m), "-") for m in sizes) + " |")
    sized = [tp for tp, on in (report["settings"].get("sized_by_pass_curve") or {}).items() if on]
    lines += ["", "Stored with the build for the runtime's draft-free rounds on this CPU and thread count "
              "(docs/methods.md, rounds sized from the pass curve); this bench's suffix rows were sized by "
              f"an earlier bench's curve for: {', '.join(sized) if sized else 'none'}."]
    return lines


def _ours(v: dict) -> str:
    """"vanilla", or "best (draft γ 3)"."""
    return v["which"] if v["which"] == v["row"] else f"{v['which']} ({v['row']})"


def _peer_lines(report: dict) -> list[str]:
    lines = ["", "## Peers (same weights and prompt tokens, interleaved in the same run, each in its own process; "
             "tok/s on decode time)", ""]
    for p in report["peers"]:
        if "skipped" in p:
            lines.append(f"- {p['peer']}: skipped ({p['skipped']})")
            continue
        prec = p["precision"].split()[0]
        ratio = "".join(f"; specexport {prec} {_ours(v)} is {v['ratio']:.2f}x "
                        f"[95% interval {v['ci95'][0]:.2f}-{v['ci95'][1]:.2f}]"
                        for v in p.get("ours_vs_peer", []) if v["ratio"] and v["ci95"])
        if any(v["ratio"] and not v["ci95"] for v in p.get("ours_vs_peer", [])):
            ratio += "; no ratio shown without an interval (fewer than 2 paired runs)"
        key = next((k for k in p if k.startswith("same_tokens_as_")), "same_tokens_as_fp32_vanilla")
        same, against = p.get(key), key.removeprefix("same_tokens_as_").removesuffix("_vanilla")
        spec = f"; acceptance {p['acceptance_rate']:.2f} of {p['drafted']} drafted" if "drafted" in p else ""
        lines.append(f"- {p['peer']} ({p['precision']}): {_f(p['tokens_per_s'], '.1f')} tok/s{ratio}{spec}; whole output "
                     f"equal to our {against} vanilla output in {_f(same, '.0%')} of {p['runs']} runs")
    return lines
