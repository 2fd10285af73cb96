"""The trainers' core (distill-draft, train-heads: Medusa and EAGLE): one loop, one optimizer step, the
frozen target, the target-generated data (made once, kept in the state folder), the batches (a pure
function of (seed, step), so a resumed run ends with an uninterrupted run's weights), the learning-rate
schedule and resuming. Each trainer supplies its module, its loss on a batch and what its state holds."""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np

from specexport import owned
from specexport._optional import require
from specexport.distill import data as distill_data
from specexport.distill.outputs import atomic_save, command_of, progress_bar, say
from specexport.errors import SpecexportError


def load_target(cfg):
    """(device, tokenizer, the target in fp32, frozen and in eval mode) for cfg.target."""
    torch = require("torch")
    transformers = require("transformers")
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.target)
    target = transformers.AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return device, tokenizer, target


def optimizer_step(opt, loss, params, lr: float) -> float:
    """One AdamW step on `loss` at learning rate `lr`, gradients clipped to norm 1 over `params`."""
    torch = require("torch")
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.detach())


def resume(path: Path, cfg, device, *, restore, console) -> tuple[int, list]:
    """(step, loss history) of the saved state when it is this run's (its fingerprint; restore(state) loads
    the module and optimizer from it), else (0, [])."""
    torch = require("torch")
    if not path.is_file():
        return 0, []
    state = torch.load(path, map_location=device, weights_only=False)
    if state["fingerprint"] != cfg.fingerprint():
        return 0, []
    restore(state)
    say(console, f"resuming from step {state['step']}")
    return state["step"], state["history"]


def save_state(path: Path, cfg, opt, *, step: int, history: list, **modules) -> None:
    """The state a rerun resumes from: the modules' weights (by name), the optimizer, step and history."""
    atomic_save({**modules, "opt": opt.state_dict(), "step": step, "history": history,
                 "fingerprint": cfg.fingerprint()}, path)


def train_loop(cfg, *, step: int, history: list, batch_at, loss_of, opt, params, save, console=None, on_step=None,
               label: str = "distill") -> list:
    """Steps `step`..cfg.steps: batch_at(step) -> a batch (its [1] the mask), loss_of(batch) -> the loss,
    one optimizer_step over `params`; save(step, history) every cfg.checkpoint_every steps and at the end."""
    params = list(params)               # clipped every step (a generator would be spent after the first)
    progress = progress_bar(console, cfg.steps, step, label=label)
    start, seen = time.perf_counter(), 0
    try:
        while step < cfg.steps:
            batch = batch_at(step)
            loss = optimizer_step(opt, loss_of(batch), params, lr_at(cfg, step))
            step += 1
            seen += int(batch[1].sum())
            history.append(round(loss, 5))
            progress(step, loss, seen / max(time.perf_counter() - start, 1e-9))
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save(step, history)
            if on_step:
                on_step(step)
    finally:
        progress(None, None, None)
    return history


# What the target-generated data depends on (the batch size too: generation batches share a seed), so
# that a rerun with another draft shape, learning rate or --draft-vocab reuses the sequences.
DATA_FIELDS = ("target", "prompts", "corpus", "num_prompts", "prompt_tokens", "new_tokens", "heldout", "batch_size",
               "seed")


def data_fingerprint(cfg) -> str:
    keep = {k: str(getattr(cfg, k)) for k in DATA_FIELDS}
    if chat(cfg):           # only when on: fingerprints made before the option existed stay valid
        keep["chat_template"] = "on"
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def check(cfg) -> None:
    """The options every trainer shares, before anything heavy is loaded (and before hours of training)."""
    if not (cfg.target / "config.json").is_file():
        raise SpecexportError(f"target: {cfg.target} has no config.json")
    inputs = [("TARGET", cfg.target), *(("--prompts", f) for f in cfg.prompts),
              *((("--corpus", cfg.corpus),) if cfg.corpus is not None else ())]
    owned.refuse_overlap(cfg.out, inputs, option="--out", hint="write the output into a folder of its own")
    owned.check_destination(cfg.out, by=command_of(cfg), force=cfg.force)    # before hours of training
    if (cfg.corpus is None) == (not cfg.prompts):
        raise SpecexportError("give prompts (--prompts FILE) or a corpus (--corpus DIR), exactly one of them")
    if getattr(cfg, "draft_vocab", None) is not None and cfg.draft_vocab < 2:     # train-heads shares check
        raise SpecexportError(f"--draft-vocab: expected >= 2 tokens, got {cfg.draft_vocab}")
    for name in ("layers", "steps", "batch_size", "num_prompts", "prompt_tokens", "new_tokens", "checkpoint_every"):
        if getattr(cfg, name) < 1:
            raise SpecexportError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(cfg, name)}")


def load_or_make_data(cfg, target, tokenizer, *, state_dir: Path, console) -> dict:
    torch = require("torch")
    path = state_dir / "data.pt"
    if path.is_file():
        data = torch.load(path, weights_only=False)
        if data["fingerprint"] == data_fingerprint(cfg):
            return data
    if cfg.corpus is not None:
        prompts = distill_data.prompts_from_corpus(cfg.corpus, tokenizer, count=cfg.num_prompts + cfg.heldout,
                                                   tokens=cfg.prompt_tokens, seed=cfg.seed)
    else:
        prompts = distill_data.prompts_from_files(cfg.prompts, tokenizer, max_tokens=cfg.prompt_tokens)
    if chat(cfg):
        prompts = distill_data.render_chat(prompts, tokenizer)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(prompts))
    n_held = min(cfg.heldout, max(1, len(prompts) // 5))
    held, train_p = [prompts[i] for i in order[:n_held]], [prompts[i] for i in order[n_held:]]
    if not train_p:
        raise SpecexportError("prompts: need at least 2 prompts (one is held out for evaluation)")
    eos = tuple(eos_ids(target))
    say(console, f"generating {len(train_p)} target continuations of up to {cfg.new_tokens} tokens")
    bar = progress_bar(console, len(train_p), 0, label="generate")
    try:
        seqs = distill_data.generate_sequences(target, train_p, new_tokens=cfg.new_tokens, batch_size=cfg.batch_size,
                                               seed=cfg.seed, eos_ids=eos, progress=lambda n: bar(n, None, None))
    finally:
        bar(None, None, None)
    data = {"fingerprint": data_fingerprint(cfg), "train": seqs, "heldout": greedy_heldout(target, held, cfg.new_tokens)}
    atomic_save(data, path)
    return data


def chat(cfg) -> bool:
    """Prompts rendered with the chat template: train-heads' EAGLE kinds, once "auto" is resolved."""
    return getattr(cfg, "chat_template", "off") == "on"


def eos_ids(model):
    eos = model.generation_config.eos_token_id
    return [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])


def greedy_heldout(target, prompts, new_tokens):
    """Held-out prompts with the target's greedy continuation: (sequence, prompt length) pairs."""
    torch = require("torch")
    out = []
    device = next(target.parameters()).device
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        out.append((seq[0].cpu().tolist(), len(p)))
    return out


def vocab_ids(cfg, data: dict, target) -> tuple[int, ...] | None:
    """--draft-vocab N: the N ids most frequent in the training sequences, EOS always in."""
    if cfg.draft_vocab is None:
        return None
    from specexport.runtime.backends.vocab import most_frequent_ids

    vocab_size = target.config.vocab_size
    if cfg.draft_vocab >= vocab_size:
        raise SpecexportError(f"--draft-vocab: {cfg.draft_vocab} is not smaller than the target's vocabulary "
                              f"({vocab_size})")
    tokens = np.concatenate([np.asarray(s, np.int64) for s in data["train"]])
    return most_frequent_ids(tokens, cfg.draft_vocab, vocab_size, always=eos_ids(target))


#----


def batch_rows(count: int, step: int, cfg) -> list[int]:
    """The training sequences of batch `step`: a pure function of (seed, step), so resuming reproduces
    the same batches (an epoch is a fresh permutation)."""
    epoch_len = max(1, count // cfg.batch_size)
    perm = np.random.default_rng([cfg.seed, step // epoch_len]).permutation(count)
    return [int(i) for i in perm[(step % epoch_len) * cfg.batch_size:][:cfg.batch_size]]


def pad_batch(rows, device):
    """Right-padded token ids and attention mask [B, S] of token lists (padding comes after every real
    token, so a causal model's real rows never see it)."""
    torch = require("torch")
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, seq in enumerate(rows):
        ids[r, :len(seq)] = torch.tensor(seq)
        mask[r, :len(seq)] = 1
    return ids.to(device), mask.to(device)


def text_batch(train, step: int, cfg, *, device):
    """Batch `step` (batch_rows), padded."""
    return pad_batch([train[i] for i in batch_rows(len(train), step, cfg)], device)


#----


def lr_at(cfg, step: int) -> float:
    """The learning rate of `step`: linear warm-up over the first 5%, then a cosine to zero."""
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, cfg.steps - warmup)))


#----
