"""specexport train-heads TARGET --kind medusa|eagle1|eagle3 --out DIR: Medusa or EAGLE heads for a target.

Options of one kind given with another are refused (one line), not ignored: --heads, --layers,
--projection, --top-k are Medusa's; --draft-vocab, --ttt-steps, --eval-depth, --chat-template,
--intermediate-size are EAGLE's.
"""
from __future__ import annotations

from pathlib import Path

import click

from specexport._console import console as make_console
from specexport.cli.distill import self_distillation_options
from specexport.errors import SpecexportError

MEDUSA_ONLY = ("heads", "layers", "projection", "top_k")
EAGLE_ONLY = ("draft_vocab", "ttt_steps", "eval_depth", "chat_template", "intermediate_size")


@click.command("train-heads")
@click.argument("target", type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output folder (Medusa-1 layout, or the published EAGLE-1 / EAGLE-3 layout).")
@click.option("--kind", default="medusa", show_default=True, help="medusa, eagle1 or eagle3.")
@click.option("--heads", default=4, show_default=True, help="Medusa: number of heads (head k predicts k + 2 ahead).")
@click.option("--layers", default=1, show_default=True, help="Medusa: residual blocks per head.")
@click.option("--projection", default="own", show_default=True,
              help="Medusa: own: a vocab projection per head (Medusa-1); shared: reuse the target's lm_head.")
@click.option("--draft-vocab", default=None, type=int,
              help="EAGLE-3: propose from the N tokens most frequent in the target's continuations (EOS always "
                   "in) with an lm_head of N rows; default: the whole vocabulary.")
@click.option("--ttt-steps", default=3, show_default=True,
              help="EAGLE: training-time-test steps (the head unrolled on its own outputs).")
@click.option("--eval-depth", default=5, show_default=True,
              help="EAGLE: chain depth of the held-out acceptance length.")
@click.option("--chat-template", default="auto", show_default=True,
              help="EAGLE: auto|on|off: render each prompt as a user message of the tokenizer's chat template "
                   "(auto: when it has one).")
@click.option("--intermediate-size", default=None, type=int,
              help="EAGLE: the head's MLP width (default: the target's).")
@click.option("--dtype", default="float32", show_default=True, help="float32 or float16 (of the written weights).")
@self_distillation_options
@click.option("--top-k", default=10, show_default=True, help="Medusa: k of the reported top-k accuracy.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--force", is_flag=True, help="Write into a non-empty --out that train-heads did not write "
                                             "(replacing only files of the names it writes).")
@click.option("-v", "--verbose", is_flag=True)
@click.pass_context
def train_heads(ctx, target, out, kind, dtype, prompts, corpus, device, verbose, **options):
    """Self-distill Medusa or EAGLE heads for TARGET (a HF checkpoint folder or a GGUF file) into --out."""
    from specexport.cli.distill import checkpoint_folder
    from specexport.distill.heads import EAGLE_KINDS, HeadsTrainConfig, train_heads as run

    _refuse_other_kinds_options(ctx, kind)
    console = make_console(stderr=True)
    cfg = HeadsTrainConfig(target=checkpoint_folder(target, console), out=Path(out).resolve(), kind=kind, dtype=dtype,
                           prompts=tuple(Path(p) for p in prompts), corpus=Path(corpus) if corpus else None,
                           device=device, **options)
    report = run(cfg, console=console)
    if kind in EAGLE_KINDS:
        b, a = report["before"], report["after"]
        console.print(f"[green]✓[/] {kind} head written to {cfg.out}; held-out acceptance length (tokens per target "
                      f"pass, greedy chains of depth {a['depth']}): {_num(b['acceptance_length'])} before, "
                      f"{_num(a['acceptance_length'])} after; top-1 by depth {a['top1']}; loss "
                      f"{report['first_loss']} -> {report['final_loss']}")
        return
    per_head = ", ".join(f"head {k}: {a:.2f} / {b:.2f}" for k, (a, b) in
                         enumerate(zip(report["after"]["top1"], report["after"]["topk"])))
    console.print(f"[green]✓[/] {cfg.heads} Medusa heads written to {cfg.out}; held-out top-1 / top-{cfg.top_k} "
                  f"accuracy: {per_head}")


def _refuse_other_kinds_options(ctx, kind: str) -> None:
    other = MEDUSA_ONLY if kind in ("eagle1", "eagle3") else EAGLE_ONLY if kind == "medusa" else ()
    given = [n for n in other if ctx.get_parameter_source(n) not in (None, click.core.ParameterSource.DEFAULT)]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        owner = "Medusa" if other is MEDUSA_ONLY else "EAGLE"
        raise SpecexportError(f"{flags}: {owner} option(s), not taken by --kind {kind}")


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"
