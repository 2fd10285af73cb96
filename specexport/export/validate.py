"""Every build checks itself: the ONNX graph in ONNX Runtime against the Hugging Face model in PyTorch.

The reference is the unmodified HF model on plain token sequences, so the check covers the wrapper,
the exporter and ORT together. Three phases over one seeded sequence:
  prefill  T = prompt length, no past
  decode   several T = 1 steps, each feeding back the K/V the graph itself produced
  tree     a random tree of new tokens with its ancestor mask; node i's reference is the HF model on
           prompt + the tokens on the root-to-i path
The figure is max|Δlogits| / max|logits| over every compared row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport._optional import require
from specexport.io_spec import ModelIO


@dataclass(frozen=True)
class ParityReport:
    max_rel_error: float
    max_abs_error: float
    max_abs_logit: float
    per_phase: dict          # phase -> max rel error

    def describe(self) -> str:
        phases = ", ".join(f"{k} {v:.2e}" for k, v in self.per_phase.items())
        return (f"max|Δlogits|={self.max_abs_error:.3e}, max|logits|={self.max_abs_logit:.3e}, "
                f"relative {self.max_rel_error:.3e} ({phases})")


def random_tree(rng: np.random.Generator, size: int) -> np.ndarray:
    """parents [size]: node 0 is the root (-1), every other node's parent has a smaller index."""
    parents = np.full(size, -1, dtype=np.int64)
    for i in range(1, size):
        parents[i] = rng.integers(0, i)
    return parents


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[T, T] bool: mask[i, j] is True when j is i or an ancestor of i."""
    size = len(parents)
    mask = np.eye(size, dtype=bool)
    for i in range(size):
        j = parents[i]
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def check_parity(model, onnx_path, io: ModelIO, *, max_seq_len: int, max_verify_tokens: int,
                 seed: int = 0) -> ParityReport:
    """Compare ORT and PyTorch logits on a prefill, decode steps and a random tree."""
    torch = require("torch")
    ort = require("onnxruntime")
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    n_prompt, n_decode = max(2, min(12, max_seq_len // 4)), 3
    n_tree = int(min(max_verify_tokens, 8, max_seq_len - n_prompt - n_decode))
    seq = rng.integers(0, io.vocab_size, n_prompt + n_decode + n_tree)

    def reference(tokens) -> np.ndarray:                   # [S, V] HF logits
        with torch.no_grad():
            return model(torch.from_numpy(np.asarray(tokens)[None])).logits[0].float().numpy()

    empty = np.zeros((1, 0, io.num_kv_heads, io.head_dim), np.float32)
    past = [empty] * (2 * io.num_layers)
    pairs = {"prefill": [], "decode": [], "tree": []}

    def run(tokens, positions, mask):
        feeds = {"input_ids": tokens[None].astype(np.int64), "position_ids": positions[None].astype(np.int64),
                 "tree_mask": mask[None]}
        feeds.update(zip(io.input_names[3:], past))
        outs = dict(zip(io.output_names, session.run(None, feeds)))
        new = [outs[n] for i in range(io.num_layers) for n in io.present_names(i)]
        return outs["logits"][0], new

    full_ref = reference(seq[: n_prompt + n_decode])
    logits, new = run(seq[:n_prompt], np.arange(n_prompt), np.tril(np.ones((n_prompt,) * 2, bool)))
    pairs["prefill"].append((logits, full_ref[:n_prompt]))
    past = [np.concatenate([p, n], axis=1) for p, n in zip(past, new)]
    for s in range(n_prompt, n_prompt + n_decode):
        logits, new = run(seq[s: s + 1], np.array([s]), np.ones((1, 1), bool))
        pairs["decode"].append((logits, full_ref[s: s + 1]))
        past = [np.concatenate([p, n], axis=1) for p, n in zip(past, new)]
    if n_tree >= 2:
        parents = random_tree(rng, n_tree)
        mask = ancestor_mask(parents)
        depth = mask.sum(1) - 1
        tree_tokens = seq[n_prompt + n_decode:]
        ctx = n_prompt + n_decode
        logits, _ = run(tree_tokens, ctx + depth, mask)
        for i in range(n_tree):
            path = tree_tokens[np.flatnonzero(mask[i])]        # ancestors in index order = root-to-i order
            ref = reference(np.concatenate([seq[:ctx], path]))[-1:]
            pairs["tree"].append((logits[i: i + 1], ref))
    return _summarize(pairs)


def _summarize(pairs: dict) -> ParityReport:
    max_abs_logit = max(float(np.abs(r).max()) for rows in pairs.values() for _, r in rows)
    max_abs_logit = max(max_abs_logit, 1e-30)
    per_phase = {k: max(float(np.abs(o - r).max()) for o, r in rows) / max_abs_logit
                 for k, rows in pairs.items() if rows}
    max_abs = max(per_phase.values()) * max_abs_logit
    return ParityReport(max(per_phase.values()), max_abs, max_abs_logit, per_phase)
