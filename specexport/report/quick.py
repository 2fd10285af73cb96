"""The build's quick bench: the short report `specexport build` ends with (`quick_bench`), and the
table it prints (`short_table`).
"""
from __future__ import annotations

from pathlib import Path

from specexport.config import GPU_PRECISIONS
from specexport.manifest import read_manifest
from specexport.report.grid import DEFAULT_PROMPTS, BenchConfig
from specexport.report.run import run_bench


def quick_bench(output_dir: Path, *, max_verify_tokens: int, log=print, steps=None) -> dict:
    """The short report `specexport build` ends with: every built CPU precision, vanilla and every method
    the build can run (draft at γ = 1..6, lookup at 2, 4, 6), one round of the default prompts, 32 tokens; no peers, no plots. Its report goes to bench/quick/,
    so a full `specexport bench` report in bench/ survives a rebuild; its γ choice is stored unless a
    fuller bench stored one for the same graphs."""
    gammas = tuple(range(1, min(6, max_verify_tokens - 1) + 1))
    manifest = read_manifest(Path(output_dir))
    built = manifest["models"]["target"]["precisions"]
    # every method the build can run, so that `--method auto` chooses among them all (lookup and suffix
    # need only the target: a build without a draft would otherwise measure vanilla alone)
    methods = ("vanilla", "lookup", "suffix", *(m for m in ("draft",) if m in manifest["models"]),
               *(m for m in ("medusa", "eagle") if m in manifest.get("heads", {})))
    # a latency report: GPU precisions (accuracy only on this CPU path, and slow to emulate) are left to
    # `specexport bench --precisions ...`
    cfg = BenchConfig(output_dir=Path(output_dir), prompts=DEFAULT_PROMPTS, gammas=gammas, max_new_tokens=32,
                      methods=methods, lookup_gammas=gammas[1::2],         # γ 2, 4, 6: a row costs a build's time
                      rounds=1, peers=False, plots=False, out=Path(output_dir) / "bench" / "quick",
                      precisions=tuple(p for p in built if p not in GPU_PRECISIONS))
    return run_bench(cfg, log=log, steps=steps)


def short_table(report: dict) -> list[tuple]:
    """(target, draft, method, γ, tok/s, acceptance, speedup) rows: vanilla and the best γ per precision
    (accuracy-only rows: the most tokens per pass; their tok/s and speedup are None)."""
    best = {}
    score = lambda r: (r["mean_accepted_tokens"] if r["accuracy_only"] else r["speedup_vs_vanilla"]) or 0  # noqa: E731
    for r in report["rows"]:
        key = (r["precision"], r["draft_precision"], r["method"])
        if key not in best or score(r) > score(best[key]):
            best[key] = r
    return [(r["precision"], r["draft_precision"] or "-", r["method"], r["gamma"] or "-", r["tokens_per_s"],
             r["acceptance_rate"], r["speedup_vs_vanilla"]) for r in best.values()]
