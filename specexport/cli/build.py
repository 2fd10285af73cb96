"""specexport build CONFIG: export, check and describe every model x precision in model.yaml."""
from __future__ import annotations

import click

from specexport.cli import cli


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Validate the config and print the plan; build nothing.")
@click.option("--force", is_flag=True, help="Rebuild every stage, even unchanged ones.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
def build(config, dry_run, force, verbose):
    """Build the artifacts described by CONFIG (a model.yaml)."""
    from specexport.config import load_config
    from specexport.export.plan import plan_build

    cfg = load_config(config)
    plan = plan_build(cfg)
    _print_plan(plan)
    if dry_run:
        return
    from specexport.export.build import Reporter, run_build

    manifest = run_build(plan, force=force, reporter=Reporter())
    _print_summary(manifest, cfg.output)


def _print_plan(plan) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    cfg = plan.config
    console.print(f"[bold]plan[/] {cfg.name} -> {cfg.output}  (max_seq_len {cfg.max_seq_len}, "
                  f"verify up to {cfg.max_verify_tokens} tokens)")
    for m in plan.models:
        a = m.arch
        aux = f", aux hidden layers {list(m.io.aux_hidden_layers)}" if m.io.aux_hidden_layers else ""
        console.print(f"  {m.role}: {m.config.path} ({a.model_type}, {a.num_layers} layers x {a.hidden_size}, "
                      f"{a.num_heads}/{a.num_kv_heads} heads, vocab {a.vocab_size}{aux})")
    console.print(f"  stages: {', '.join(f'{r} {p}' for r, p in plan.stages())}")


def _print_summary(manifest: dict, output) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"built {manifest['name']} -> {output}")
    for col in ("model", "precision", "size", "parity error", "gate", "time"):
        table.add_column(col)
    for role, m in manifest["models"].items():
        for precision, e in m["precisions"].items():
            table.add_row(role, precision, f"{e['size_bytes'] / 2**20:.1f} MiB", f"{e['parity_max_rel_error']:.2e}",
                          f"≤ {e['parity_tolerance']:.0e}", f"{e['build_seconds']:.1f} s")
    Console().print(table)
