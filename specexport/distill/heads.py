"""specexport train-heads TARGET --kind medusa: Medusa heads for a target, by self-distillation.

    target ──generate (sampled)──► sequences ──► frozen target: final hidden state h_i and p_i per position
    head k at position i learns KL(p_target(i + 1 + k) ‖ q_k(h_i)): the target's own distribution of
    the token k + 2 places after h_i's position (Medusa-2's self-distillation, heads only)

The prompts and target continuations are made exactly as for `distill-draft` (same options, same
data code); resumable the same way: state in .<out name>.heads/ beside the output, saved every
`checkpoint_every` steps, batches a pure function of (seed, step). Heads start as Medusa's do: each
residual block at zero (the block is the identity) and, with their own projection, a copy of the
target's lm_head, so an untrained head k already guesses "the next token again".

The output is the published Medusa-1 layout (heads/medusa.py: medusa_lm_head.safetensors +
config.json; `--projection shared` writes the "version 2" layout that reuses the target's lm_head),
so heads made here load in other tools and `medusa: {path: OUT}` builds them; train_report.json
holds each head's top-1 and top-k accuracy on held-out prompts (the target's greedy continuations).

--kind eagle1 / eagle3 train an EAGLE head instead (distill/eagle.py), from the same data.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specexport._optional import require
from specexport.distill import core, outputs
from specexport.errors import SpecexportError

KINDS = ("medusa", "eagle1", "eagle3")
EAGLE_KINDS = ("eagle1", "eagle3")
# Options of the EAGLE kinds only: left out of a Medusa run's fingerprint, so Medusa state saved before
# they existed still resumes.
EAGLE_FIELDS = ("draft_vocab", "ttt_steps", "chat_template", "intermediate_size")


@dataclass(frozen=True)
class HeadsTrainConfig:
    target: Path
    out: Path
    kind: str = "medusa"
    heads: int = 4
    layers: int = 1                         # residual blocks per head (Medusa's medusa_num_layers)
    projection: str = "own"                 # "own": a vocab projection per head (Medusa-1); "shared": the target's
    dtype: str = "float32"                  # of the written weights: float32 | float16
    prompts: tuple[Path, ...] = ()
    corpus: Path | None = None
    num_prompts: int = 256
    prompt_tokens: int = 32
    new_tokens: int = 96
    heldout: int = 16
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 0
    checkpoint_every: int = 50
    top_k: int = 10                         # the k of the reported top-k accuracy
    decay: float = 0.8                      # head k's loss weight decay^k (Medusa's λ_k)
    device: str | None = None
    # EAGLE kinds (distill/eagle.py)
    draft_vocab: int | None = None          # EAGLE-3: the N most frequent tokens only (None: the full vocabulary)
    ttt_steps: int = 3                      # training-time-test unroll
    eval_depth: int = 5                     # chain depth of the held-out acceptance length
    chat_template: str = "auto"             # auto | on | off: prompts as a user message of the tokenizer's template
    intermediate_size: int | None = None    # the head's MLP width (default: the target's)
    force: bool = False                     # write into a non-empty --out of someone else's (only our files)

    def fingerprint(self) -> str:
        skip = ("steps", "checkpoint_every", "device", "top_k", "eval_depth", "force")
        skip += EAGLE_FIELDS if self.kind == "medusa" else ()
        keep = {k: str(v) for k, v in asdict(self).items() if k not in skip}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def train_heads(cfg: HeadsTrainConfig, *, console=None, on_step=None) -> dict:
    """Run (or resume) training; returns the report written to <out>/train_report.json."""
    _check(cfg)
    if cfg.kind in EAGLE_KINDS:
        from specexport.distill.eagle import train_eagle

        return train_eagle(cfg, console=console, on_step=on_step)
    torch = require("torch")
    state_dir = outputs.state_folder(cfg.out.parent / f".{cfg.out.name}.heads", cfg)
    device, tokenizer, target = core.load_target(cfg)
    data = core.load_or_make_data(cfg, target, tokenizer, state_dir=state_dir, console=console)
    heads = medusa_heads(target, cfg).to(device)
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    state_path = state_dir / "state.pt"

    def restore(state):
        # a frozen shared projection is not saved (it is the target's lm_head): only it may be missing
        missing, unexpected = heads.load_state_dict(state["heads"], strict=False)
        if unexpected or set(missing) - ({"proj"} if cfg.projection == "shared" else set()):
            raise SpecexportError(f"{state_path}: does not match these heads (missing {missing}, unexpected "
                                  f"{unexpected}); delete it to start over")
        opt.load_state_dict(state["opt"])

    def save(step, history):
        trained = {k: v for k, v in heads.state_dict().items() if k != "proj" or cfg.projection == "own"}
        core.save_state(state_path, cfg, opt, step=step, history=history, heads=trained)

    step, history = core.resume(state_path, cfg, device, restore=restore, console=console)
    before = evaluate(target, medusa_heads(target, cfg).to(device), data["heldout"], cfg.top_k)
    core.train_loop(cfg, step=step, history=history, opt=opt, params=[p for p in heads.parameters() if p.requires_grad],
                    batch_at=lambda s: core.text_batch(data["train"], s, cfg, device=device),
                    loss_of=lambda batch: medusa_loss(target, heads, batch, cfg), save=save, console=console,
                    on_step=on_step, label="train-heads")
    after = evaluate(target, heads, data["heldout"], cfg.top_k)
    return _write_outputs(cfg, heads, before, after, history)


def _check(cfg: HeadsTrainConfig) -> None:
    if cfg.kind not in KINDS:
        raise SpecexportError(f"--kind: {cfg.kind!r} is not supported; supported: {', '.join(KINDS)}")
    if cfg.dtype not in ("float32", "float16"):
        raise SpecexportError(f"--dtype: expected float32 or float16, got {cfg.dtype!r}")
    if cfg.kind in EAGLE_KINDS:             # the rest in distill/eagle.py
        return
    if cfg.draft_vocab is not None or cfg.chat_template == "on":
        raise SpecexportError("--draft-vocab and --chat-template on are EAGLE options; --kind medusa takes neither")
    if cfg.projection not in ("own", "shared"):
        raise SpecexportError(f"--projection: expected own or shared, got {cfg.projection!r}")
    for name in ("heads", "layers", "top_k"):
        if getattr(cfg, name) < 1:
            raise SpecexportError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(cfg, name)}")
    core.check(cfg)


def medusa_heads(target, cfg: HeadsTrainConfig):
    """Trainable heads on the target's final hidden state, in Medusa's structure (the keys of
    `state()` are the published ones); projections start as copies of the target's lm_head."""
    torch = require("torch")
    nn = torch.nn
    lm_head = target.get_output_embeddings().weight.detach().float()             # [V, H]
    V, H = lm_head.shape

    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(H, H)
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

        def forward(self, x):
            return x + nn.functional.silu(self.linear(x))

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(*[ResBlock() for _ in range(cfg.layers)])
                                         for _ in range(cfg.heads)])
            own = cfg.projection == "own"
            self.proj = nn.Parameter(lm_head.clone().expand(cfg.heads, V, H).clone() if own else lm_head.clone()[None],
                                     requires_grad=own)                         # [N | 1, V, H]

        def forward(self, hidden):                                              # [B, S, H] -> [B, S, N, V]
            outs = [self.blocks[k](hidden) @ self.proj[k if len(self.proj) > 1 else 0].T for k in range(cfg.heads)]
            return torch.stack(outs, dim=2)

    return Heads()


def _target_states(target, ids, mask):
    """(final post-norm hidden states [B, S, H], log-probs [B, S, V]) of the frozen target."""
    torch = require("torch")
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        return hidden, torch.log_softmax(target.get_output_embeddings()(hidden).float(), -1)


def medusa_loss(target, heads, batch, cfg: HeadsTrainConfig):
    """Head k at position i against the target's p at position i + 1 + k (the token k + 2 ahead)."""
    torch = require("torch")
    ids, mask = batch
    hidden, p_log = _target_states(target, ids, mask)
    q_log = torch.log_softmax(heads(hidden).float(), -1)                        # [B, S, N, V]
    loss, weight = 0.0, 0.0
    for k in range(cfg.heads):
        shift = k + 1
        if ids.shape[1] <= shift:
            break
        p, q = p_log[:, shift:], q_log[:, :-shift, k]                           # [B, S - shift, V]
        valid = mask[:, shift:].float()
        kl = (p.exp() * (p - q)).sum(-1)                                        # [B, S - shift]
        loss = loss + cfg.decay ** k * (kl * valid).sum() / valid.sum().clamp(min=1)
        weight += cfg.decay ** k
    return loss / weight


def evaluate(target, heads, heldout, top_k: int) -> dict:
    """On the target's greedy continuations of held-out prompts: per head k, the share of positions
    i (from the last prompt token on) whose token i + 2 + k is the head's top-1, and is in its top-k,
    and the mean KL(p_target(i + 1 + k) ‖ q_k(i)) the training minimises."""
    torch = require("torch")
    device = next(heads.parameters()).device
    n = len(heads.blocks)
    top1, topk, kl, total = [0] * n, [0] * n, [0.0] * n, [0] * n
    with torch.no_grad():
        for seq, n_prompt in heldout:
            ids = torch.tensor([seq], device=device)
            hidden, p_log = _target_states(target, ids, torch.ones_like(ids))
            q_log = torch.log_softmax(heads(hidden)[0].float(), -1)                 # [S, N, V]
            ranked = q_log.topk(top_k, dim=-1).indices                               # [S, N, K]
            for k in range(n):
                rows = torch.arange(n_prompt - 1, len(seq) - 2 - k, device=device)
                if len(rows) == 0:
                    continue
                truth = ids[0, rows + 2 + k]
                top1[k] += int((ranked[rows, k, 0] == truth).sum())
                topk[k] += int((ranked[rows, k] == truth[:, None]).any(-1).sum())
                p = p_log[0, rows + 1 + k]
                kl[k] += float((p.exp() * (p - q_log[rows, k])).sum())
                total[k] += len(rows)
    return {"top1": [a / max(t, 1) for a, t in zip(top1, total)],
            "topk": [a / max(t, 1) for a, t in zip(topk, total)],
            "kl": [a / max(t, 1) for a, t in zip(kl, total)], "positions": total}


def _write_outputs(cfg: HeadsTrainConfig, heads, before, after, history) -> dict:
    import numpy as np

    from specexport.heads.medusa import save_medusa_1

    partial = outputs.output_partial(cfg)
    blocks = [[(b.linear.weight.detach().cpu().numpy(), b.linear.bias.detach().cpu().numpy()) for b in seq]
              for seq in heads.blocks]
    proj = heads.proj.detach().cpu().numpy()
    projections = [proj[k] for k in range(cfg.heads)] if cfg.projection == "own" else [None] * cfg.heads
    save_medusa_1(partial, blocks, projections, base_model=str(cfg.target), dtype=np.dtype(cfg.dtype))
    report = {"kind": cfg.kind, "heads": cfg.heads, "layers": cfg.layers, "projection": cfg.projection,
              "dtype": cfg.dtype, "steps": cfg.steps,
              "first_loss": history[0] if history else None, "final_loss": history[-1] if history else None,
              "top_k": cfg.top_k, "before": before, "after": after,
              "config": outputs.json_config(cfg)}
    (partial / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    outputs.place_outputs(partial, cfg)
    return report
