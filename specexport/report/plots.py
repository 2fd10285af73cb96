"""The bench's figures (matplotlib, optional: without it the report says so and has none).

    speedup_vs_gamma.png   one panel per target precision; a colour per draft precision (and prompt
                           lookup); measured speedup solid with its 95% interval, predicted dashed; the
                           legend outside the panels
    tokens_per_s.png       decode tokens/s of vanilla and each method's fastest row per target precision,
                           next to the peers', with 95% intervals (ours: vanilla's tok/s times the
                           speedup interval; peers': a bootstrap over their runs)
"""
from __future__ import annotations

from pathlib import Path


def plot_report(report: dict, out: Path, log) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (pip install 'specexport[bench]')")
        return []
    return [p for p in (_speedup_vs_gamma(report, out, plt), _tokens_per_s(report, out, plt)) if p]


def _colours(keys, plt) -> dict:
    cycle = plt.get_cmap("tab10").colors
    return {k: cycle[i % len(cycle)] for i, k in enumerate(sorted(keys, key=str))}


def _speedup_vs_gamma(report: dict, out: Path, plt) -> str | None:
    series = {}                                         # target precision -> [(label, colour key, rows, predicted)]
    for key, choice in report["gamma_auto"].items():
        tp, dp = key.split("/")
        series.setdefault(tp, []).append((f"draft {dp}", dp, _gamma_rows(report, "draft", tp, dp=dp),
                                          choice.get("predicted_by_gamma")))
    for tp in dict.fromkeys(r["precision"] for r in report["rows"] if r["method"] == "lookup"):
        series.setdefault(tp, []).append(("prompt lookup", "lookup", _gamma_rows(report, "lookup", tp, dp=None), None))
    series = {tp: [s for s in lines if s[2]] for tp, lines in series.items()}
    series = {tp: lines for tp, lines in series.items() if lines}
    if not series:
        return None
    colour = _colours({k for lines in series.values() for _, k, _, _ in lines}, plt)
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series) + 2.2, 3.8), sharey=True, squeeze=False)
    handles = {}
    for ax, (tp, lines) in zip(axes[0], series.items()):
        for label, key, rows, predicted in lines:
            x = [r["gamma"] for r in rows]
            y = [r["speedup_vs_vanilla"] for r in rows]
            ci = [r["speedup_ci95"] or [r["speedup_vs_vanilla"]] * 2 for r in rows]
            h = ax.errorbar(x, y, yerr=[[v - c[0] for v, c in zip(y, ci)], [c[1] - v for v, c in zip(y, ci)]],
                            fmt="o-", color=colour[key], capsize=3)
            handles[f"{label}, measured (95% interval)"] = h
            if predicted:
                (p,) = ax.plot([int(k) for k in predicted], list(predicted.values()), "--", color=colour[key], alpha=0.8)
                handles[f"{label}, predicted"] = p
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"target {tp}")
        ax.set_xlabel("γ (tokens proposed per round)")
    axes[0][0].set_ylabel("speedup over vanilla (decode time)")
    fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    path = Path(out) / "speedup_vs_gamma.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path.name


def _gamma_rows(report, method, tp, *, dp) -> list:
    return [r for r in report["rows"] if r["method"] == method and r["precision"] == tp and r["draft_precision"] == dp
            and not r.get("draft_stop") and not r.get("tree") and r["speedup_vs_vanilla"]]


def _tokens_per_s(report: dict, out: Path, plt) -> str | None:
    bars = []                                           # (label, tok/s, interval or None, colour key)
    for tp in dict.fromkeys(r["precision"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["precision"] == tp and r["tokens_per_s"]]
        vanilla = next((r for r in rows if r["method"] == "vanilla"), None)
        if vanilla is None:
            continue
        bars.append((f"{tp} vanilla", vanilla["tokens_per_s"], None, "ours"))
        for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "vanilla"):
            best = max((r for r in rows if r["method"] == method), key=lambda r: r["tokens_per_s"])
            ci = best.get("speedup_ci95")
            interval = [c * vanilla["tokens_per_s"] for c in ci] if ci else None
            draft = f"/{best['draft_precision']}" if best["draft_precision"] else ""
            bars.append((f"{tp}{draft} {method} γ {best['gamma'] or '-'}", best["tokens_per_s"], interval, "ours"))
    for p in report.get("peers", []):
        if p.get("tokens_per_s"):
            bars.append((p["peer"], p["tokens_per_s"], p.get("tokens_per_s_ci95"), "peer"))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(bars) + 1.2))
    y = list(range(len(bars)))[::-1]
    colours = {"ours": "tab:blue", "peer": "tab:orange"}
    for yi, (_label, v, ci, who) in zip(y, bars):
        err = [[v - ci[0]], [ci[1] - v]] if ci else None
        ax.barh(yi, v, color=colours[who], xerr=err, capsize=3)
    ax.set_yticks(y, [b[0] for b in bars], fontsize=8)
    ax.set_xlabel("decode tokens/s (95% interval)")
    ax.set_title("specexport (blue) and peers (orange), one interleaved run")
    fig.tight_layout()
    path = Path(out) / "tokens_per_s.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path.name
