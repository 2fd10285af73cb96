"""specexport train-heads TARGET --kind medusa --heads 4 --out DIR: Medusa heads for a target."""
from __future__ import annotations

from pathlib import Path

import click

from specexport.cli import cli
from specexport.cli.distill import self_distillation_options


@cli.command("train-heads")
@click.argument("target", type=click.Path(file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder (Medusa-1 layout).")
@click.option("--kind", default="medusa", show_default=True, help="medusa (EAGLE heads come later).")
@click.option("--heads", default=4, show_default=True, help="Number of heads (head k predicts k + 2 tokens ahead).")
@click.option("--layers", default=1, show_default=True, help="Residual blocks per head.")
@click.option("--projection", default="own", show_default=True,
              help="own: a vocab projection per head (Medusa-1); shared: reuse the target's lm_head (smaller).")
@click.option("--dtype", default="float32", show_default=True, help="float32 or float16 (of the written weights).")
@self_distillation_options
@click.option("--top-k", default=10, show_default=True, help="k of the reported top-k accuracy.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("-v", "--verbose", is_flag=True)
def train_heads(target, out, kind, heads, layers, projection, dtype, prompts, corpus, num_prompts, prompt_tokens,
                new_tokens, steps, batch_size, lr, seed, checkpoint_every, top_k, device, verbose):
    """Self-distill Medusa heads for TARGET (a HF checkpoint folder) into --out."""
    from rich.console import Console

    from specexport.distill.heads import HeadsTrainConfig, train_heads as run

    cfg = HeadsTrainConfig(target=Path(target).resolve(), out=Path(out).resolve(), kind=kind, heads=heads,
                           layers=layers, projection=projection, dtype=dtype, prompts=tuple(Path(p) for p in prompts),
                           corpus=Path(corpus) if corpus else None, num_prompts=num_prompts,
                           prompt_tokens=prompt_tokens, new_tokens=new_tokens, steps=steps, batch_size=batch_size,
                           lr=lr, seed=seed, checkpoint_every=checkpoint_every, top_k=top_k, device=device)
    console = Console(stderr=True)
    report = run(cfg, console=console)
    per_head = ", ".join(f"head {k}: {a:.2f} / {b:.2f}" for k, (a, b) in
                         enumerate(zip(report["after"]["top1"], report["after"]["topk"])))
    console.print(f"[green]✓[/] {heads} Medusa heads written to {cfg.out}; held-out top-1 / top-{top_k} accuracy: "
                  f"{per_head}")
