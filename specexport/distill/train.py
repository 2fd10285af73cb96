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
from dataclasses import asdict, dataclass
from pathlib import Path


from specexport._optional import require
from specexport.config import DRAFT_VOCAB_FILE
from specexport.distill import core
from specexport.distill.outputs import json_config, output_partial, distill_state_dir, place_outputs, state_folder
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


def distill_draft(cfg: DistillConfig, *, on_step=None, console=None) -> dict:
    """Run (or resume) distillation; returns the report written to <out>/distill_report.json."""
    torch = require("torch")
    core.check(cfg)
    state_dir = state_folder(distill_state_dir(cfg.out), cfg)
    device, tokenizer, target = core.load_target(cfg)
    data = core.load_or_make_data(cfg, target, tokenizer, state_dir=state_dir, console=console)
    vocab = core.vocab_ids(cfg, data, target)
    ids = None if vocab is None else torch.tensor(vocab, device=device)
    draft = _init_draft(cfg, target).to(device)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0)

    def restore(state):
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])

    state_path = state_dir / "state.pt"
    step, history = core.resume(state_path, cfg, device, restore=restore, console=console)
    heldout = data["heldout"]
    before = evaluate(target, _init_draft(cfg, target).to(device), heldout, ids)
    core.train_loop(cfg, step=step, history=history, opt=opt, params=draft.parameters(), console=console,
                    on_step=on_step, batch_at=lambda s: core.text_batch(data["train"], s, cfg, device=device),
                    loss_of=lambda batch: kl_loss(target, draft, batch, ids),
                    save=lambda s, h: core.save_state(state_path, cfg, opt, step=s, history=h,
                                                      draft=draft.state_dict()))
    after = evaluate(target, draft, heldout, ids)
    return _write_outputs(cfg, draft, tokenizer, before, after, history, vocab)


def kl_loss(target, draft, batch, ids=None):
    """Mean KL(p_target ‖ q_draft) over the batch's real positions (p renormalised over `ids` when given)."""
    tokens, mask = batch
    p_log, q_log = _log_probs(target, draft, tokens, attention_mask=mask,
                              ids=ids)                            # [B, S, V|Vd]
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)                                         # [B, S]
    return (kl * mask).sum() / mask.sum()


def draft_logits(draft, input_ids, attention_mask=None, ids=None):
    """The draft's logits, over the rows `ids` of its lm_head only when given ([B, S, len(ids)]):
    the full projection is what a reduced vocabulary saves, in training as in the graph."""
    if ids is None:
        return draft(input_ids, attention_mask=attention_mask).logits
    hidden = getattr(draft, draft.base_model_prefix)(input_ids, attention_mask=attention_mask).last_hidden_state
    head = draft.get_output_embeddings()
    bias = None if head.bias is None else head.bias[ids]
    return require("torch").nn.functional.linear(hidden, head.weight[ids], bias)


def _log_probs(target, draft, input_ids, *, attention_mask, ids):
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


def _write_outputs(cfg, draft, tokenizer, before, after, history, vocab=None) -> dict:
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
