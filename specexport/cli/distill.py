"""specexport distill-draft TARGET --out DIR: a draft for a target that has none."""
from __future__ import annotations

from pathlib import Path

import click

from specexport._console import console as make_console


def checkpoint_folder(target: str, console=None) -> Path:
    """TARGET as a checkpoint folder: a GGUF file is converted once (cached; export/gguf.py)."""
    path = Path(target).resolve()
    if path.is_file():
        from specexport.export.gguf import hf_folder_from_gguf, is_gguf

        if is_gguf(path):
            return hf_folder_from_gguf(path, console=console)
    return path


def self_distillation_options(command):
    """The options of the data and the training loop that distill-draft and train-heads share."""
    options = [
        click.option("--prompts", multiple=True, type=click.Path(dir_okay=False), help="Prompt file (repeatable)."),
        click.option("--corpus", default=None, type=click.Path(),
                     help="Folder to draw prompts from, or a text file listing files."),
        click.option("--num-prompts", default=256, show_default=True),
        click.option("--prompt-tokens", default=32, show_default=True),
        click.option("--new-tokens", default=96, show_default=True, help="Target continuation length per prompt."),
        click.option("--steps", default=300, show_default=True),
        click.option("--batch-size", default=16, show_default=True),
        click.option("--lr", default=1e-3, show_default=True),
        click.option("--seed", default=0, show_default=True),
        click.option("--checkpoint-every", default=50, show_default=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command("distill-draft")
@click.argument("target", type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output checkpoint folder.")
@click.option("--layers", default=2, show_default=True, help="Draft decoder layers.")
@click.option("--hidden-size", default=None, type=int, help="Draft width (default: the target's).")
@click.option("--intermediate-size", default=None, type=int, help="Draft MLP width (default: scaled).")
@click.option("--draft-vocab", default=None, type=int,
              help="Propose from the N tokens most frequent in the target's continuations only (a smaller "
                   "lm_head: cheaper drafting with a large vocabulary); written as draft_vocab.json.")
@self_distillation_options
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--force", is_flag=True, help="Write into a non-empty --out that distill-draft did not write "
                                             "(replacing only files of the names it writes).")
@click.option("-v", "--verbose", is_flag=True)
def distill_draft(target, out, layers, hidden_size, intermediate_size, draft_vocab, prompts, corpus, num_prompts,
                  prompt_tokens, new_tokens, steps, batch_size, lr, seed, checkpoint_every, device, force, verbose):
    """Self-distill a small draft from TARGET (a HF checkpoint folder) into --out."""
    from specexport.distill.train import DistillConfig, distill_draft as run

    console = make_console(stderr=True)
    cfg = DistillConfig(target=checkpoint_folder(target, console), out=Path(out).resolve(), layers=layers,
                        hidden_size=hidden_size, intermediate_size=intermediate_size,
                        prompts=tuple(Path(p) for p in prompts), corpus=Path(corpus) if corpus else None,
                        num_prompts=num_prompts, prompt_tokens=prompt_tokens, new_tokens=new_tokens, steps=steps,
                        batch_size=batch_size, lr=lr, seed=seed, checkpoint_every=checkpoint_every, device=device,
                        draft_vocab=draft_vocab, force=force)
    report = run(cfg, console=console)
    console.print(f"[green]✓[/] draft written to {cfg.out} ({report['draft']['parameters']:,} parameters); "
                  f"greedy agreement with the target on held-out prompts: {report['agreement_before']:.3f} before, "
                  f"{report['agreement_after']:.3f} after (KL {report['kl_before']:.3f} -> {report['kl_after']:.3f})")
    if report["draft_vocab"]:
        console.print(f"  it proposes from {report['draft_vocab']['size']:,} tokens (draft_vocab.json, used by the "
                      f"build), which hold {report['draft_vocab']['target_mass']:.3f} of the target's probability "
                      f"on held-out text")
