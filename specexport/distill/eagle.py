"""specexport train-heads TARGET --kind eagle3 | eagle1: an EAGLE head for a target, by self-distillation.

    target ──generate (sampled)──► sequences ──► frozen target, once: features f_i (EAGLE-3: inputs of
    layers eagle3_layers(); EAGLE-1: final post-norm state) and the final state h_i, cached in the state
    folder (fp16) ──► head row i (token x_{i+1}, feature f_i) learns KL(p_target(i + 1) ‖ q_head),
    p_target = softmax(lm_head(h_{i+1})), unrolled on its own outputs for --ttt-steps steps (EAGLE-3's
    training-time test; step s weighs 0.8^s; heads/eagle_torch.py has the alignment and the mask)

The data are medusa's (distill/train.py: prompts from --prompts or --corpus, target continuations
sampled at temperature 1, held-out prompts with the greedy continuation); with a chat template
(--chat-template auto: when the tokenizer has one) each prompt is first rendered as a user message
ready for the reply. Resumable like medusa: state in .<out name>.heads/ beside the output, batches a
pure function of (seed, step). --draft-vocab N (EAGLE-3): the N ids most frequent in the training
sequences, EOS always in; lm_head starts as those rows of the target's, p is renormalised over them.

Output: the published layout (config.json + model.safetensors for EAGLE-3, pytorch_model.bin for
EAGLE-1) that heads/eagle.py's load_eagle reads and make_head computes exactly (checked after writing:
report["reference_max_abs_diff"]), and train_report.json: the loss history's ends and, on held-out
prompts before and after training, per-depth top-1 accuracy and the mean acceptance length of greedy
chain drafting (tokens per target pass).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.distill import data as distill_data
from specexport.distill import core, outputs
from specexport.distill.eagle_head import head_config
from specexport.heads.eagle_torch import trainable_head
from specexport.errors import SpecexportError

DECAY = 0.8                          # step s of the training-time test weighs DECAY ** s (EAGLE-3)


def train_eagle(cfg, *, console=None, on_step=None) -> dict:
    """Run (or resume) training of an EAGLE head (cfg: distill.heads.HeadsTrainConfig, kind eagle1 or
    eagle3); returns the report written to <out>/train_report.json."""
    torch = require("torch")
    check(cfg)
    state_dir = outputs.state_folder(cfg.out.parent / f".{cfg.out.name}.heads", cfg)
    device, tokenizer, target = core.load_target(cfg)
    cfg = resolve_chat_template(cfg, tokenizer)
    data = core.load_or_make_data(cfg, target, tokenizer, state_dir=state_dir, console=console)
    ids = core.vocab_ids(cfg, data, target)
    version = _version(cfg)
    aux = _aux_layers(cfg, target.config.num_hidden_layers)
    hcfg = head_config(target.config, version, aux_layers=aux, draft_vocab=None if ids is None else len(ids),
                       intermediate=cfg.intermediate_size, dtype=cfg.dtype, target=str(cfg.target))
    store = _load_or_make_features(cfg, target, data["train"], aux=aux, state_dir=state_dir, console=console)

    def fresh():
        return trainable_head(hcfg, version, lm_head=target.get_output_embeddings().weight, ids=ids, seed=cfg.seed,
                              init_std=getattr(target.config, "initializer_range", 0.02)).to(device)

    head = fresh()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)

    def restore(state):
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])

    state_path = state_dir / "state.pt"
    step, history = core.resume(state_path, cfg, device, restore=restore, console=console)
    before = evaluate(target, fresh(), data["heldout"], aux=aux, depth=cfg.eval_depth)
    core.train_loop(cfg, step=step, history=history, opt=opt, params=head.parameters(), console=console,
                    on_step=on_step, label=f"train-heads {cfg.kind}",
                    batch_at=lambda s: _batch(store, data["train"], s, cfg=cfg, device=device),
                    loss_of=lambda batch: ttt_loss(target, head, batch, cfg.ttt_steps),
                    save=lambda s, h: core.save_state(state_path, cfg, opt, step=s, history=h, head=head.state_dict()))
    after = evaluate(target, head, data["heldout"], aux=aux, depth=cfg.eval_depth)
    return _write_outputs(cfg, head, hcfg, target, data["heldout"], aux, before=before, after=after, history=history)


# -- options -----------------------------------------------------------------------------------

def check(cfg) -> None:
    """The EAGLE kinds' option checks, before anything heavy is loaded."""
    if cfg.draft_vocab is not None and cfg.kind != "eagle3":
        raise SpecexportError("--draft-vocab: EAGLE-1 heads project through the target's lm_head (its whole "
                              "vocabulary); a reduced draft vocabulary is EAGLE-3 only")
    if cfg.chat_template not in ("auto", "on", "off"):
        raise SpecexportError(f"--chat-template: expected auto, on or off, got {cfg.chat_template!r}")
    for name in ("ttt_steps", "eval_depth"):
        if getattr(cfg, name) < 1:
            raise SpecexportError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(cfg, name)}")
    if cfg.intermediate_size is not None and cfg.intermediate_size < 1:
        raise SpecexportError(f"--intermediate-size: expected >= 1, got {cfg.intermediate_size}")
    core.check(cfg)
    tcfg = json.loads((cfg.target / "config.json").read_text())
    if cfg.kind == "eagle3":
        _aux_layers(cfg, tcfg.get("num_hidden_layers", 0))
    if cfg.draft_vocab is not None and cfg.draft_vocab >= tcfg.get("vocab_size", 0):
        raise SpecexportError(f"--draft-vocab: {cfg.draft_vocab} is not smaller than the target's vocabulary "
                              f"({tcfg.get('vocab_size')})")


def resolve_chat_template(cfg, tokenizer):
    """auto -> on when the tokenizer has a chat template, else off; on without one is an error."""
    has = distill_data.has_chat_template(tokenizer)
    if cfg.chat_template == "on" and not has:
        raise SpecexportError(f"--chat-template on: the tokenizer of {cfg.target} has no chat template")
    return dataclasses.replace(cfg, chat_template="on" if cfg.chat_template == "on" or
                               (cfg.chat_template == "auto" and has) else "off")


def _version(cfg) -> int:
    return 3 if cfg.kind == "eagle3" else 1


def _aux_layers(cfg, num_layers: int) -> tuple[int, ...]:
    if cfg.kind != "eagle3":
        return ()
    from specexport.heads.eagle import eagle3_layers

    return eagle3_layers({}, num_layers, where=f"--kind eagle3 on a target of {num_layers} layers")


# -- frozen target features, computed once --------------------------------------------------------

def target_features(target, ids, mask, aux):
    """(features [B, S, F], final post-norm hidden [B, S, H]) of the frozen target; F = 3H for EAGLE-3
    (hidden_states[i] is the input of layer i), H for EAGLE-1 (the final state itself)."""
    torch = require("torch")
    with torch.no_grad():
        out = target.get_decoder()(input_ids=ids, attention_mask=mask, output_hidden_states=bool(aux))
        final = out.last_hidden_state.float()
        feats = torch.cat([out.hidden_states[i] for i in aux], -1).float() if aux else final
    return feats, final


def _load_or_make_features(cfg, target, train, *, aux, state_dir: Path, console) -> dict:
    """{"feats" [N, F], "final" [N, H] (EAGLE-3 only), "offsets" [n + 1]}: every training sequence's
    features back to back, fp16 unless that overflows (then float32), cached in features.pt."""
    torch = require("torch")
    key = hashlib.sha256(json.dumps([core.data_fingerprint(cfg), cfg.kind, list(aux)]).encode()).hexdigest()[:16]
    path = state_dir / "features.pt"
    if path.is_file():
        store = torch.load(path, weights_only=False)
        if store["fingerprint"] == key:
            return store
    device = next(target.parameters()).device
    feats, finals = [], []
    bar = outputs.progress_bar(console, len(train), 0, label="target features")
    try:
        for start in range(0, len(train), cfg.batch_size):
            rows = train[start:start + cfg.batch_size]
            ids, mask = core.pad_batch(rows, device)
            f, h = target_features(target, ids, mask, aux)
            for r, seq in enumerate(rows):
                feats.append(f[r, :len(seq)].cpu())
                finals.append(h[r, :len(seq)].cpu())
            bar(len(feats), None, None)
    finally:
        bar(None, None, None)
    store = {"fingerprint": key, "feats": _compact(torch.cat(feats)),
             "final": _compact(torch.cat(finals)) if aux else None,
             "offsets": torch.tensor(np.cumsum([0] + [len(s) for s in train]))}
    outputs.atomic_save(store, path)
    return store


def _compact(x):
    half = x.half()
    return half if bool(half.isfinite().all()) else x


def _batch(store, train, step: int, *, cfg, device):
    """Batch `step` (the rows core.text_batch takes: a pure function of (seed, step)): token ids and mask
    [B, S], features [B, S, F] and final states [B, S, H], float32."""
    torch = require("torch")
    rows = core.batch_rows(len(train), step, cfg)
    ids, mask = core.pad_batch([train[i] for i in rows], device)
    off = store["offsets"]

    def gather(flat):
        out = torch.zeros((len(rows), ids.shape[1], flat.shape[1]))
        for r, i in enumerate(rows):
            out[r, :off[i + 1] - off[i]] = flat[off[i]:off[i + 1]].float()
        return out.to(device)

    feats = gather(store["feats"])
    return ids, mask, feats, (feats if store["final"] is None else gather(store["final"]))


# -- training ------------------------------------------------------------------------------------

def ttt_loss(target, head, batch, steps: int):
    """Mean over steps (weights DECAY^s, normalised) of the mean KL(p_target ‖ q_head) over the valid
    rows: row i (token x_{i+1}, feature f_i) against the target's distribution at i + 1, valid when
    x_{i+1} is a real token and i >= s."""
    torch = require("torch")
    ids, mask, feats, final = batch
    lm = target.get_output_embeddings()
    emb = target.get_input_embeddings()(ids[:, 1:])                                  # [B, T, H], T = S - 1
    outs = head.unroll(emb, feats[:, :-1], steps, lm_head=None if head.shape.version == 3 else lm.weight)
    with torch.no_grad():
        if head.shape.version == 3 and head.shape.draft_vocab < head.shape.vocab:
            # only the draft vocabulary's rows of the target's lm_head: the whole projection would cost
            # V / Vd times more (49152 / 8192 on SmolLM2) for columns p is renormalised without
            ids = head.target_ids()
            p_logits = torch.nn.functional.linear(final[:, 1:], lm.weight[ids],
                                                  None if lm.bias is None else lm.bias[ids]).float()   # [B, T, Vd]
        else:
            p_logits = lm(final[:, 1:]).float()                                       # [B, T, V]
        p_log = torch.log_softmax(p_logits, -1)
    loss, total = 0.0, 0.0
    for s, (logits, _) in enumerate(outs):
        q_log = torch.log_softmax(logits.float(), -1)
        kl = (p_log.exp() * (p_log - q_log)).sum(-1)                                   # [B, T]
        valid = mask[:, 1:].float()
        valid[:, :s] = 0
        loss = loss + DECAY ** s * (kl * valid).sum() / valid.sum().clamp(min=1)
        total += DECAY ** s
    return loss / total


# -- evaluation ----------------------------------------------------------------------------------

def evaluate(target, head, heldout, *, aux, depth: int) -> dict:
    """On the target's greedy continuations of held-out prompts, from every root r (the target has
    committed x_0..x_r and emitted x_{r+1}; r from the last prompt token on):
      acceptance_length  mean over roots of 1 + the number of leading drafts of a greedy chain of up to
                         `depth` (the head run on its own tokens and hidden, as inference does) that
                         equal the target's next tokens: tokens per target pass
      top1[d]            share of roots whose depth-(d+1) draft is right when the tokens before it are
                         the true ones (teacher forcing, own hidden: the training-time test's accuracy)
      accept_rate[d]     share of the chains that reached depth d+1 whose draft there is right."""
    torch = require("torch")
    device = next(head.parameters()).device
    emb_layer, lm = target.get_input_embeddings(), target.get_output_embeddings()
    lm_head = None if head.shape.version == 3 else lm.weight
    to_target = head.target_ids()
    accepted, top1, live_n = [], np.zeros(depth), np.zeros(depth)
    reached, right = np.zeros(depth), np.zeros(depth)
    with torch.no_grad():
        for seq, n_prompt in heldout:
            if len(seq) - 2 < n_prompt:
                continue
            ids = torch.tensor([seq], device=device)
            feats, _ = target_features(target, ids, torch.ones_like(ids), aux)
            emb, f = emb_layer(ids[:, 1:]), feats[:, :-1]
            chain = head.unroll(emb, f, depth, lm_head=lm_head,
                                embed_next=lambda logits: emb_layer(to_target[logits.argmax(-1)]))
            forced = head.unroll(emb, f, depth, lm_head=lm_head)
            roots = torch.arange(n_prompt - 1, len(seq) - 2, device=device)          # [R]
            ok = torch.zeros((depth, len(roots)), dtype=torch.bool, device=device)   # [D, R] draft d right
            for s in range(depth):
                rows = roots + s
                live = rows + 2 < len(seq)
                rows = rows.clamp(max=len(seq) - 3)
                truth = ids[0, rows + 2]
                ok[s] = live & (to_target[chain[s][0][0, rows].argmax(-1)] == truth)
                top1[s] += float((live & (to_target[forced[s][0][0, rows].argmax(-1)] == truth)).sum())
                live_n[s] += float(live.sum())
                right[s] += float((ok[:s + 1].all(0)).sum())
                reached[s] += float((ok[:s].all(0) & live).sum())
            accepted.append(ok.int().cumprod(0).sum(0).cpu().numpy())
    counts = np.concatenate(accepted) if accepted else np.zeros(0)
    return {"acceptance_length": float((counts + 1).mean()) if len(counts) else None,
            "top1": [round(float(a) / max(float(b), 1.0), 4) for a, b in zip(top1, live_n)],
            "accept_rate": [round(float(a) / max(float(b), 1.0), 4) for a, b in zip(right, reached)],
            "roots": len(counts), "depth": depth}


# -- output --------------------------------------------------------------------------------------

def _write_outputs(cfg, head, hcfg, target, heldout, aux, *, before, after, history) -> dict:
    torch = require("torch")
    partial = outputs.output_partial(cfg)
    dtype = getattr(torch, cfg.dtype)
    tensors = {k: (v if v.dtype in (torch.int64, torch.bool) else v.to(dtype)).detach().cpu().contiguous()
               for k, v in head.state_dict().items()}
    (partial / "config.json").write_text(json.dumps(hcfg, indent=2) + "\n")
    if head.shape.version == 3:
        from safetensors.torch import save_file

        save_file(tensors, str(partial / "model.safetensors"))
    else:
        torch.save(tensors, partial / "pytorch_model.bin")
    report = {"kind": cfg.kind, "dtype": cfg.dtype, "steps": cfg.steps, "ttt_steps": cfg.ttt_steps,
              "aux_layers": list(aux), "draft_vocab": head.shape.draft_vocab if head.shape.version == 3 else None,
              "chat_template": cfg.chat_template,
              "first_loss": history[0] if history else None, "final_loss": history[-1] if history else None,
              "loss_first": history[:5], "loss_last": history[-5:],
              "before": before, "after": after,
              "reference_max_abs_diff": reference_diff(partial, head, target, heldout=heldout, aux=aux,
                                                       dtype=cfg.dtype),
              "config": outputs.json_config(cfg)}
    (partial / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    outputs.place_outputs(partial, cfg)
    return report


def reference_diff(folder, head, target, *, heldout, aux, dtype: str = "float32") -> float | None:
    """Max |logits - logits'| and |hidden - hidden'| of make_head(load_eagle(folder)) against `head` on
    the first held-out sequence (causal, step 0), `head`'s weights rounded to the written dtype first
    (so fp16 files compare like for like): 0 up to float32 rounding when the files hold what was trained."""
    torch = require("torch")
    from specexport.heads.eagle import load_eagle
    from specexport.heads.eagle_torch import make_head

    if not heldout:
        return None
    if dtype != "float32":
        head = copy.deepcopy(head)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(p.to(getattr(torch, dtype)).float())
    tc = target.config
    ref = make_head(load_eagle(folder, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                               num_layers=tc.num_hidden_layers))
    device = next(head.parameters()).device
    ids = torch.tensor([heldout[0][0]], device=device)
    feats, _ = target_features(target, ids, torch.ones_like(ids), aux)
    emb = target.get_input_embeddings()(ids[:, 1:])
    T = emb.shape[1]
    mask, pos = torch.ones(T, T, dtype=torch.bool).tril(), torch.arange(T)
    lm = target.get_output_embeddings().weight.detach().cpu()
    with torch.no_grad():
        a = head(emb, feats[:, :-1], pos.to(device), mask.to(device), lm.to(device))
        b = ref(emb.cpu(), feats[:, :-1].cpu(), pos, mask, lm)
    return max(float((x.cpu() - y).abs().max()) for x, y in zip(a, b))
