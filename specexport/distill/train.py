"""specexport distill-draft: make a small draft from a target by self-distillation.

    target ──generate (sampled)──► sequences ──► train draft on KL(p_target ‖ q_draft) per position
                                                  (Medusa-2 / EAGLE self-distillation)

State lives beside the output, in .<out name>.distill/: data.pt (prompts and target sequences, made
once) and state.pt (the draft, optimizer and step, saved every `checkpoint_every` steps, atomically).
With --draft-vocab N the draft proposes from the N tokens most frequent in those sequences (EOS
always in): its logits are computed for those rows of its lm_head only, it learns the target's
distribution renormalised over them (the q that maximises acceptance, sum_S min(p, q), when q is
zero elsewhere), and the ids are written as draft_vocab.json beside the weights, which the build
then uses as the draft's output vocabulary. A rerun with the same options resumes from state.pt; the batch order is a function of (seed, step),
so a resumed run ends with the same weights as an uninterrupted one. The output is an ordinary HF
checkpoint folder, written whole into a temporary folder and renamed into place: an interrupted run
never leaves a checkpoint that looks complete. --out is refused when it is a non-empty folder that an
earlier distill-draft did not write (`specexport.owned`); --force writes into it, replacing only
files of the names distill-draft writes.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specexport import owned
from specexport._optional import require
from specexport.distill import data as distill_data
from specexport.distill.outputs import (_progress, _say, _state_dir, atomic_save, command_of, json_config,
                                        output_partial, place_outputs, state_folder)
from specexport.errors import SpecexportError


@dataclass(frozen=True)
class DistillConfig:
    target: Path
    out: Path
    layers: int = 2
    hidden_size: int | None = None          # default: the target's width
    intermediate_size: int | None = None    # default: the target's ratio
    prompts: tuple[Path, ...] = ()          # text files, one prompt per paragraph
    corpus: Path | None = None              # or a folder to draw prompt windows from
    num_prompts: int = 256
    prompt_tokens: int = 32
    new_tokens: int = 96
    heldout: int = 16                       # prompts kept out of training for the agreement figure
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 0
    checkpoint_every: int = 50
    device: str | None = None               # default: cuda when available, else cpu
    draft_vocab: int | None = None          # propose from the N most frequent tokens only (None: all)
    force: bool = False                     # write into a non-empty --out of someone else's (only our files)

    def fingerprint(self) -> str:
        skip = ("steps", "checkpoint_every", "device", "force")
        keep = {k: str(v) for k, v in asdict(self).items() if k not in skip}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


# What the target-generated data depends on (the batch size too: generation batches share a seed), so
# that a rerun with another draft shape, learning rate or --draft-vocab reuses the sequences.
DATA_FIELDS = ("target", "prompts", "corpus", "num_prompts", "prompt_tokens", "new_tokens", "heldout", "batch_size",
               "seed")


def data_fingerprint(cfg) -> str:
    keep = {k: str(getattr(cfg, k)) for k in DATA_FIELDS}
    if _chat(cfg):           # only when on: fingerprints made before the option existed stay valid
        keep["chat_template"] = "on"
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def distill_draft(cfg: DistillConfig, *, on_step=None, console=None) -> dict:
    """Run (or resume) distillation; returns the report written to <out>/distill_report.json."""
    torch = require("torch")
    transformers = require("transformers")
    _check(cfg)
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    state_dir = state_folder(_state_dir(cfg.out), cfg)
    tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.target)
    target = transformers.AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    data = _load_or_make_data(cfg, target, tokenizer, state_dir, console)
    vocab = _vocab_ids(cfg, data, target)
    ids = None if vocab is None else torch.tensor(vocab, device=device)
    draft = _init_draft(cfg, target).to(device)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0)
    step, history = 0, []
    state_path = state_dir / "state.pt"
    if state_path.is_file():
        state = torch.load(state_path, map_location=device, weights_only=False)
        if state["fingerprint"] == cfg.fingerprint():
            draft.load_state_dict(state["draft"])
            opt.load_state_dict(state["opt"])
            step, history = state["step"], state["history"]
            _say(console, f"resuming from step {step}")
    heldout = data["heldout"]
    before = evaluate(target, _init_draft(cfg, target).to(device), heldout, ids)
    train = data["train"]
    total_tokens = 0
    start = time.perf_counter()
    progress = _progress(console, cfg.steps, step)
    try:
        while step < cfg.steps:
            batch = _batch(train, step, cfg, device)
            loss = _kl_step(target, draft, opt, batch, lr=_lr(cfg, step), ids=ids)
            step += 1
            total_tokens += int(batch[1].sum())
            history.append(round(loss, 5))
            progress(step, loss, total_tokens / max(time.perf_counter() - start, 1e-9))
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                _save_state(state_path, draft, opt, step, history, cfg)
            if on_step:
                on_step(step)
    finally:
        progress(None, None, None)
    after = evaluate(target, draft, heldout, ids)
    return _write_outputs(cfg, draft, tokenizer, before, after, history, vocab)


# -- pieces ----------------------------------------------------------------------------------

def _check(cfg: DistillConfig) -> None:
    if not (cfg.target / "config.json").is_file():
        raise SpecexportError(f"target: {cfg.target} has no config.json")
    inputs = [("TARGET", cfg.target), *(("--prompts", f) for f in cfg.prompts),
              *((("--corpus", cfg.corpus),) if cfg.corpus is not None else ())]
    owned.refuse_overlap(cfg.out, inputs, option="--out", hint="write the output into a folder of its own")
    owned.check_destination(cfg.out, by=command_of(cfg), force=cfg.force)    # before hours of training
    if (cfg.corpus is None) == (not cfg.prompts):
        raise SpecexportError("give prompts (--prompts FILE) or a corpus (--corpus DIR), exactly one of them")
    if getattr(cfg, "draft_vocab", None) is not None and cfg.draft_vocab < 2:     # train-heads shares _check
        raise SpecexportError(f"--draft-vocab: expected >= 2 tokens, got {cfg.draft_vocab}")
    for name in ("layers", "steps", "batch_size", "num_prompts", "prompt_tokens", "new_tokens", "checkpoint_every"):
        if getattr(cfg, name) < 1:
            raise SpecexportError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(cfg, name)}")


def _load_or_make_data(cfg, target, tokenizer, state_dir: Path, console) -> dict:
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
    if _chat(cfg):
        prompts = distill_data.render_chat(prompts, tokenizer)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(prompts))
    n_held = min(cfg.heldout, max(1, len(prompts) // 5))
    held, train_p = [prompts[i] for i in order[:n_held]], [prompts[i] for i in order[n_held:]]
    if not train_p:
        raise SpecexportError("prompts: need at least 2 prompts (one is held out for evaluation)")
    eos = tuple(_eos_ids(target))
    _say(console, f"generating {len(train_p)} target continuations of up to {cfg.new_tokens} tokens")
    bar = _progress(console, len(train_p), 0, label="generate")
    try:
        seqs = distill_data.generate_sequences(target, train_p, new_tokens=cfg.new_tokens, batch_size=cfg.batch_size,
                                               seed=cfg.seed, eos_ids=eos, progress=lambda n: bar(n, None, None))
    finally:
        bar(None, None, None)
    data = {"fingerprint": data_fingerprint(cfg), "train": seqs, "heldout": _greedy_heldout(target, held, cfg.new_tokens)}
    atomic_save(data, path)
    return data


def _chat(cfg) -> bool:
    """Prompts rendered with the chat template: train-heads' EAGLE kinds, once "auto" is resolved."""
    return getattr(cfg, "chat_template", "off") == "on"


def _eos_ids(model):
    eos = model.generation_config.eos_token_id
    return [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])


def _greedy_heldout(target, prompts, new_tokens):
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


def _vocab_ids(cfg: DistillConfig, data: dict, target) -> tuple[int, ...] | None:
    """--draft-vocab N: the N ids most frequent in the training sequences, EOS always in."""
    if cfg.draft_vocab is None:
        return None
    from specexport.runtime.backends.vocab import most_frequent_ids

    vocab_size = target.config.vocab_size
    if cfg.draft_vocab >= vocab_size:
        raise SpecexportError(f"--draft-vocab: {cfg.draft_vocab} is not smaller than the target's vocabulary "
                              f"({vocab_size})")
    tokens = np.concatenate([np.asarray(s, np.int64) for s in data["train"]])
    return most_frequent_ids(tokens, cfg.draft_vocab, vocab_size, always=_eos_ids(target))


def draft_logits(draft, input_ids, attention_mask=None, ids=None):
    """The draft's logits, over the rows `ids` of its lm_head only when given ([B, S, len(ids)]):
    the full projection is what a reduced vocabulary saves, in training as in the graph."""
    if ids is None:
        return draft(input_ids, attention_mask=attention_mask).logits
    hidden = getattr(draft, draft.base_model_prefix)(input_ids, attention_mask=attention_mask).last_hidden_state
    head = draft.get_output_embeddings()
    bias = None if head.bias is None else head.bias[ids]
    return require("torch").nn.functional.linear(hidden, head.weight[ids], bias)


def _log_probs(target, draft, input_ids, attention_mask, ids):
    """(log p_target, log q_draft) per position; with `ids`, p renormalised over them."""
    torch = require("torch")
    with torch.no_grad():
        p_logits = target(input_ids, attention_mask=attention_mask).logits.float()
    if ids is not None:
        p_logits = p_logits[..., ids]
    q_logits = draft_logits(draft, input_ids, attention_mask, ids).float()
    return torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)


def evaluate(target, draft, heldout, ids=None) -> dict:
    """On the target's greedy continuations of held-out prompts (teacher-forced):
    agreement = share of positions where the draft's argmax equals the target's (the greedy acceptance
    rate of a one-token proposal); kl = mean KL(p_target ‖ q_draft) per position (with a reduced
    vocabulary p is renormalised over it, and subset_mass is the target's mean probability on it:
    the most a one-token proposal can be accepted under sampling)."""
    torch = require("torch")
    device = next(draft.parameters()).device
    hits = total = 0
    kl_sum = mass_sum = 0.0
    was_training = draft.training
    draft.eval()
    with torch.no_grad():
        for seq, n_prompt in heldout:
            tokens = torch.tensor([seq], device=device)
            p_full = torch.log_softmax(target(tokens).logits[0, n_prompt - 1:-1].float(), -1)     # [S, V]
            q_log = torch.log_softmax(draft_logits(draft, tokens, ids=ids)[0, n_prompt - 1:-1].float(), -1)
            p_log = p_full if ids is None else torch.log_softmax(p_full[:, ids], -1)            # [S, Vd]
            q_top = q_log.argmax(-1) if ids is None else ids[q_log.argmax(-1)]
            hits += int((p_full.argmax(-1) == q_top).sum())
            kl_sum += float((p_log.exp() * (p_log - q_log)).sum())
            mass_sum += float(p_full.exp().sum() if ids is None else p_full[:, ids].exp().sum())
            total += p_full.shape[0]
    draft.train(was_training)
    n = max(total, 1)
    return {"agreement": hits / n, "kl": kl_sum / n, "subset_mass": mass_sum / n}


def _init_draft(cfg: DistillConfig, target):
    """The draft's config and initial weights: the target's first layers when as wide as the target,
    else fresh layers with the target's embeddings projected onto their top singular directions."""
    torch = require("torch")
    transformers = require("transformers")
    tcfg = target.config
    hidden = cfg.hidden_size or tcfg.hidden_size
    conf = tcfg.to_dict()
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    heads = max(1, hidden // head_dim)
    kv = max(1, min(heads, tcfg.num_key_value_heads * heads // tcfg.num_attention_heads))
    while heads % kv:
        kv -= 1
    inter = cfg.intermediate_size or int(tcfg.intermediate_size * hidden / tcfg.hidden_size)
    same_width = hidden == tcfg.hidden_size
    conf.update(num_hidden_layers=cfg.layers, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, dtype="float32",
                tie_word_embeddings=tcfg.tie_word_embeddings if same_width else True)
    conf.pop("layer_types", None)
    draft_cfg = type(tcfg).from_dict(conf)
    torch.manual_seed(cfg.seed)
    draft = transformers.AutoModelForCausalLM.from_config(draft_cfg)
    emb = target.get_input_embeddings().weight.detach().float().cpu()           # [V, Ht]
    with torch.no_grad():
        if same_width:
            sd = {k: v for k, v in target.state_dict().items()
                  if not k.startswith("model.layers.") or int(k.split(".")[2]) < cfg.layers}
            missing, unexpected = draft.load_state_dict(sd, strict=False)
            if unexpected or [k for k in missing if k != "lm_head.weight"]:
                raise SpecexportError(f"draft init: keys differ from the target's: {missing + unexpected}")
        else:
            _, _, vt = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)   # vt [Ht, Ht]
            draft.get_input_embeddings().weight.copy_(emb @ vt[:hidden].T)          # [V, H]
        draft.tie_weights()
    return draft.train()


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


def _batch(train, step: int, cfg: DistillConfig, device):
    """Batch `step` (batch_rows), padded."""
    return pad_batch([train[i] for i in batch_rows(len(train), step, cfg)], device)


def _kl_step(target, draft, opt, batch, *, lr: float, ids=None) -> float:
    torch = require("torch")
    tokens, mask = batch
    p_log, q_log = _log_probs(target, draft, tokens, mask, ids)                            # [B, S, V|Vd]
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)                                         # [B, S]
    loss = (kl * mask).sum() / mask.sum()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def _lr(cfg: DistillConfig, step: int) -> float:
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, cfg.steps - warmup)))


def _save_state(path: Path, draft, opt, step, history, cfg) -> None:
    atomic_save({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                  "fingerprint": cfg.fingerprint()}, path)


def _write_outputs(cfg, draft, tokenizer, before, after, history, vocab=None) -> dict:
    from specexport.config import DRAFT_VOCAB_FILE

    partial = output_partial(cfg)
    draft.eval().save_pretrained(partial)
    if vocab is not None:      # the build reads it as draft.vocab unless model.yaml names another
        (partial / DRAFT_VOCAB_FILE).write_text(json.dumps(list(vocab)))
    tokenizer.save_pretrained(partial)
    gen = cfg.target / "generation_config.json"
    if gen.is_file():
        (partial / "generation_config.json").write_text(gen.read_text())
    report = {"agreement_before": before["agreement"], "agreement_after": after["agreement"],
              "kl_before": before["kl"], "kl_after": after["kl"], "steps": cfg.steps,
              "draft_vocab": None if vocab is None else {"size": len(vocab), "target_mass": after["subset_mass"]},
              "final_loss": history[-1] if history else None, "loss_first": history[:1],
              "draft": {"layers": cfg.layers, "hidden_size": draft.config.hidden_size,
                        "parameters": sum(p.numel() for p in draft.parameters())},
              "config": json_config(cfg)}
    (partial / "distill_report.json").write_text(json.dumps(report, indent=2))
    place_outputs(partial, cfg)
    return report
