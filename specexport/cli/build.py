"""specexport build CONFIG: export, check and describe every model x precision in model.yaml."""
from __future__ import annotations

from pathlib import Path

import click

from specexport._console import console as make_console, progress
from specexport.config import load_config
from specexport.errors import SpecexportError


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Validate the config and print the plan; build nothing.")
@click.option("--force", is_flag=True, help="Rebuild every stage, even unchanged ones.")
@click.option("--only", default=None, metavar="ROLE[/PRECISION]",
              help="Rebuild only these stages (e.g. target, draft/int4, medusa, tokenizer); every other stage is "
                   "kept from the current build as it is.")
@click.option("--bench/--no-bench", default=True, show_default=True,
              help="End with a short latency report per precision (and store the γ for --gamma auto).")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
def build(config, dry_run, force, only, bench, verbose):
    """Build the artifacts described by CONFIG (a model.yaml).

    With SPECEXPORT_EXPORT_CACHE=<folder> set, exported graphs are kept there by content and a later export
    of the same model (--force included) takes its graph from it (docs/model-yaml.md)."""
    from specexport.builder.plan import plan_build

    cfg = load_config(config)
    if dry_run and _print_pending(cfg):
        return
    plan = plan_build(cfg, console=make_console(stderr=True))
    _print_plan(plan)
    if dry_run:
        return
    from specexport.builder.run import Reporter, run_build

    manifest = run_build(plan, force=force, reporter=Reporter(), only=only)
    _print_summary(manifest, cfg.output)
    if bench:
        _print_quick_bench(cfg)


def _print_pending(cfg) -> bool:
    """--dry-run with GGUF models not converted yet: check what can be checked, name what a build would
    convert and where, convert nothing. False when there is nothing pending (the full plan prints)."""
    from specexport.builder.plan import check_before_work
    from specexport.export.gguf import pending_conversions

    pending = pending_conversions(cfg)
    if not pending:
        return False
    check_before_work(cfg)
    console = make_console(stderr=True)
    console.print(f"[bold]plan[/] {cfg.name} -> {cfg.output}  (max_seq_len {cfg.max_seq_len}, "
                  f"verify up to {cfg.max_verify_tokens} tokens)")
    for role, gguf, dest in pending:
        console.print(f"  {role}: {gguf} is a GGUF file not converted yet; a build converts it once "
                      f"({gguf.stat().st_size / 1e6:.0f} MB) into {dest}")
    console.print("  a dry run converts nothing: the stages are planned once the conversion is made "
                  "(`specexport build` makes it first)")
    return True


def _print_quick_bench(cfg) -> None:
    from rich.table import Table

    from specexport.report.bench import quick_bench, short_table

    try:
        with progress(make_console(stderr=True), "short latency report (every method the build can run)") as steps:
            report = quick_bench(cfg.output, max_verify_tokens=cfg.max_verify_tokens, log=lambda m: None,
                                 steps=steps)
    except SpecexportError as err:          # the build itself succeeded; say why there is no report
        make_console(stderr=True).print(f"[yellow]latency report skipped:[/] {err}")
        return
    table = Table(title="latency (greedy, 3 short prompts x 32 tokens; `specexport bench` for the full report)")
    for col in ("target", "draft", "method", "γ", "tok/s", "acceptance", "speedup"):
        table.add_column(col)
    for t, d, m, g, tps, acc, spd in short_table(report):
        table.add_row(t, d, m, str(g), "accuracy only" if tps is None else f"{tps:.1f}",
                      "-" if acc is None else f"{acc:.2f}",
                      "-" if spd is None else f"{spd:.2f}x")
    make_console().print(table)
    for p, c in report["gamma_auto"].items():
        verdict = f"γ = {c['gamma']}" if c["gamma"] else "vanilla (speculation predicted to lose)"
        make_console().print(f"--gamma auto for {p}: {verdict}, predicted {c['predicted_speedup']:.2f}x")


def _print_plan(plan) -> None:
    console = make_console(stderr=True)
    cfg = plan.config
    console.print(f"[bold]plan[/] {cfg.name} -> {cfg.output}  (max_seq_len {cfg.max_seq_len}, "
                  f"verify up to {cfg.max_verify_tokens} tokens)")
    for m in plan.models:
        a = m.arch
        aux = f", aux hidden layers {list(m.io.aux_hidden_layers)}" if m.io.aux_hidden_layers else ""
        if m.config.vocab is not None:          # a reduced output vocabulary: its size, from a file or measured
            aux += f", proposes {m.io.vocab_size} of them ({m.config.vocab if isinstance(m.config.vocab, int) else m.config.vocab.name})"
        console.print(f"  {m.role}: {m.config.path} ({a.model_type}, {a.num_layers} layers x {a.hidden_size}, "
                      f"{a.num_heads}/{a.num_kv_heads} heads, vocab {a.vocab_size}{aux})")
        for precision, why in m.instead_of_blocks:
            console.print(f"  {m.role} {precision}: MatMulNBits (ONNX Runtime), not blocks on specexport's kernels: {why}")
    console.print(f"  stages: {', '.join(s.name for s in plan.stages())}")


def _print_summary(manifest: dict, output) -> None:
    console = make_console()
    console.print(checks_table(manifest, title=f"built {manifest['name']} -> {output}", build_columns=True))
    rss = manifest.get("build_peak_rss_bytes")
    if rss:
        children = f", {rss['children'] / 2**30:.2f} GiB in export child processes" if rss["children"] else ""
        console.print(f"peak memory (RSS): {rss['process'] / 2**30:.2f} GiB in the build process{children}")


def checks_table(manifest: dict, *, title: str | None = None, build_columns: bool = False):
    """One row per model x precision: what it was checked against, the figures and the gate.

    fp32 rows: relative logits error against PyTorch (parity_tolerance). Quantized rows: top-1 agreement
    and mean KL against the fp32 graph (quality_gates), and the relative logits error for reference."""
    from rich.table import Table

    columns = ["model", "precision", "top-1", "KL", "rel err", "gate"]
    if build_columns:
        columns[2:2] = ["size"]
        columns.append("time")
    table = Table(title=title, show_edge=False)
    for col in columns:
        numeric = col in ("size", "top-1", "KL", "rel err", "time")
        table.add_column(col, justify="right" if numeric else "left", overflow="fold")
    sources, lean = set(), False
    for role, m in (*manifest["models"].items(), *manifest.get("heads", {}).items()):
        for precision, e in m["precisions"].items():
            cells = dict(zip(("top-1", "KL", "rel err", "gate"), _check_cells(e)), model=role,
                         precision=precision, size=f"{e['size_bytes'] / 2**20:.1f} MiB",
                         time=f"{e['build_seconds']:.1f} s")
            table.add_row(*(cells[c] for c in columns))
            if "quality_text" in e:
                t = e["quality_text"]
                lean = lean or e.get("quality_reference", "fp32") != "fp32"
                sources.add(f"eval_text {Path(t['path']).name}" if t["source"] == "eval_text"
                            else t["description"].split(" (")[0].replace(f"the {role} ", "each model's "))
    caption = "fp32: rel err of the logits vs PyTorch"
    if sources:
        against = "fp32 (a lean gguf graph: its accuracy_level-0 twin)" if lean else "fp32"
        caption += f"; quantized: top-1 agreement, mean KL and rel err vs {against} on {' and '.join(sorted(sources))}"
    table.caption = caption
    return table


def _check_cells(e: dict) -> list[str]:
    rel = f"{e['parity_max_rel_error']:.1e}"
    if e.get("parity_reference", "pytorch") == "pytorch":          # fp32: parity against PyTorch
        return ["", "", rel, f"rel ≤ {e['parity_tolerance']:.0e}"]
    gate = e["quality_gate"]                  # a head's blocks: top-1 proposals only, no KL
    kl = f"{e['mean_kl']:.4f}" if "mean_kl" in e else ""
    return [f"{e['top1_agreement']:.3f}", kl, rel,
            f"top-1 ≥ {gate['min_top1']:.2f}" + (f"\nKL ≤ {gate['max_kl']:g}" if "max_kl" in gate else "")]
