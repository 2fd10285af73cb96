"""Every build checks itself: the ONNX graph in ONNX Runtime against the Hugging Face model in PyTorch.

The reference is the unmodified HF model on plain token sequences, so the check covers the wrapper,
the exporter and ORT together. Three phases over one seeded sequence:
  prefill  T = prompt length, no past
  decode   several T = 1 steps, each feeding back the K/V the graph itself produced
  tree     a random tree of new tokens with its ancestor mask; node i's reference is the HF model on
           prompt + the tokens on the root-to-i path
The figure is max|Δlogits| / max|logits| over every compared row. The prefill also runs once asking
for its last row's logits only (`logits_rows`, what the runtime's prefill does): "prefill_last".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport._optional import require
from specexport.io_spec import LOGITS, ModelIO
from specexport.runtime.tree import Tree


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
    """[T, T] bool: mask[i, j] is True when j is i or an ancestor of i (the runtime's Tree.mask)."""
    return Tree(parents).mask


@dataclass(frozen=True)
class ParityCase:
    """One seeded token sequence: a prompt, decode steps, then the tokens of a random tree."""
    seq: np.ndarray          # [n_prompt + n_decode + n_tree]
    n_prompt: int
    n_decode: int
    parents: np.ndarray      # [n_tree] tree over the last n_tree tokens (may be empty)

    @property
    def context(self) -> int:
        return self.n_prompt + self.n_decode


def parity_case(io: ModelIO, *, max_seq_len: int, max_verify_tokens: int, seed: int = 0) -> ParityCase:
    rng = np.random.default_rng(seed)
    n_prompt, n_decode = max(2, min(12, max_seq_len // 4)), 3
    n_tree = int(min(max_verify_tokens, 8, max_seq_len - n_prompt - n_decode))
    seq = rng.integers(0, io.vocab_size, n_prompt + n_decode + n_tree)
    parents = random_tree(rng, n_tree) if n_tree >= 2 else np.zeros(0, np.int64)
    return ParityCase(seq, n_prompt, n_decode, parents)


def reference_logits(model, case: ParityCase) -> dict:
    """PyTorch logits per phase: {"prefill": [n_prompt, V], "decode": [n_decode, V], "tree": [n_tree, V]}."""
    torch = require("torch")

    def run(tokens) -> np.ndarray:                   # [S, V]
        with torch.no_grad():
            return model(torch.from_numpy(np.asarray(tokens)[None])).logits[0].float().numpy()

    return case_logits(lambda sequences: [run(s) for s in sequences], case)


def case_logits(run_many, case: ParityCase) -> dict:
    """The phases' reference logits from plain sequences: `run_many(list of token arrays)` gives each
    sequence's logits [S, V] (a layer-by-layer reference runs them together: export/gguf_reference.py)."""
    sequences = [case.seq[:case.context]]
    if len(case.parents):
        mask, tree_tokens = ancestor_mask(case.parents), case.seq[case.context:]
        # node i's reference: the context plus the root-to-i path (ancestors in index order)
        sequences += [np.concatenate([case.seq[:case.context], tree_tokens[mask[i]]]) for i in range(len(case.parents))]
    logits = run_many(sequences)
    full = logits[0]
    out = {"prefill": full[:case.n_prompt], "prefill_last": full[case.n_prompt - 1:case.n_prompt],
           "decode": full[case.n_prompt:]}
    if len(case.parents):
        out["tree"] = np.stack([x[-1] for x in logits[1:]])
    return out


def onnx_logits(onnx_path, io: ModelIO, case: ParityCase, *, session=None, kv_capacity: int | None = None) -> dict:
    """The same phases through the ONNX graph in ONNX Runtime, feeding back the K/V it produced.

    `session`: an open session of the graph to use instead (quantized graphs pass one with prepacking
    on, which their MatMulNBits kernels need to compute what the runtime computes). `kv_capacity`: the
    graph's caches have that many rows and the committed length is carried beside them (the TensorRT
    engine graph's fixed-capacity form, trt/graph.py); None: empty caches grown by each call."""
    if session is None:
        from specexport.runtime.backends.ort import base_options

        ort = require("onnxruntime")
        opts = base_options()
        # Prepacking makes a second, transient copy of every weight; the check runs each graph a few
        # times only, so it skips that and keeps the build's peak memory near two copies of the weights.
        opts.add_session_config_entry("session.disable_prepacking", "1")
        from specexport.plugins import cpu

        cpu.register(opts, onnx_path)
        session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        from specexport.runtime.backends.ort import release_freed_heap

        release_freed_heap()
    state = {"past": io.empty_caches(1, kv_capacity or 0), "committed": 0}

    def run(tokens, positions, mask, rows=None, commit=True):
        feeds = io.feeds(tokens[None], positions=positions, mask=mask, past=state["past"], rows=rows,
                         past_length=state["committed"] if kv_capacity else None)
        outs = dict(zip(io.output_names, session.run(None, feeds)))
        if commit:
            state["past"], state["committed"] = io.presents(outs), state["committed"] + len(tokens)
        return outs[LOGITS][0]

    n, seq = case.n_prompt, case.seq
    causal = np.tril(np.ones((n, n), bool))
    out = {"prefill_last": run(seq[:n], np.arange(n), causal, rows=[n - 1], commit=False),
           "prefill": run(seq[:n], np.arange(n), causal)}
    out["decode"] = np.stack([run(seq[s:s + 1], np.array([s]), np.ones((1, 1), bool))[0]
                              for s in range(n, case.context)])
    if len(case.parents):
        mask = ancestor_mask(case.parents)
        out["tree"] = run(seq[case.context:], case.context + mask.sum(1) - 1, mask, commit=False)
    return out


def compare(reference: dict, got: dict) -> ParityReport:
    """max|Δlogits| / max|logits| over every phase."""
    max_abs_logit = max(max(float(np.abs(r).max()) for r in reference.values()), 1e-30)
    per_phase = {k: float(np.abs(got[k] - r).max()) / max_abs_logit for k, r in reference.items()}
    worst = max(per_phase.values())
    return ParityReport(worst, worst * max_abs_logit, max_abs_logit, per_phase)
