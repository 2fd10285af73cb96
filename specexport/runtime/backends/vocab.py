"""A draft that projects onto a subset of the target's vocabulary (issue 14: the draft's lm_head is a
large share of a small draft's cost when the vocabulary is large).

The draft's graph computes logits for `ids` only ([T, Vd], Vd = len(ids)); ReducedVocab scatters them
into the target's vocabulary ([T, V], -inf elsewhere), so every proposer sees target ids and a
distribution over the target's vocabulary in which the excluded tokens have probability 0. That is
all losslessness needs: rejection sampling accepts x with min(1, p(x)/q(x)) and draws the recovered
token from max(0, p - q) over the *whole* vocabulary, so a token outside the subset still comes out
at its exact target probability, through the residual; greedy verification is unaffected (the target
decides). Mapping once, here, is the whole contract: the ids proposers return are already target ids.
"""
from __future__ import annotations

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.backends.base import StepOutput


def most_frequent_ids(tokens, n: int, vocab_size: int, always=()) -> tuple[int, ...]:
    """The n ids most frequent in `tokens`, sorted: `always` (e.g. the EOS ids) first, then by count,
    ties and any shortfall by ascending id. Shared by the build (draft.vocab: N) and distill-draft."""
    counts = np.bincount(np.asarray(tokens, np.int64).ravel(), minlength=vocab_size).astype(np.float64)
    counts[list(always)] = np.inf
    order = np.lexsort((np.arange(len(counts)), -counts))               # by count desc, then id
    return tuple(sorted(int(i) for i in order[:n]))


class ReducedVocab:
    """Wraps a Backend whose logits cover `ids`; everything else (KV state, commit, rollback, timings)
    is the wrapped backend's."""

    _own = ("inner", "ids", "vocab_size", "_full")

    def __init__(self, inner, ids, vocab_size: int):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) != inner.vocab_size:
            raise SpecexportError(f"draft vocabulary: {len(ids)} ids for a graph of {inner.vocab_size} logits")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids)):
            raise SpecexportError(f"draft vocabulary: ids must be distinct target ids in 0..{vocab_size - 1}")
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "vocab_size", int(vocab_size))
        object.__setattr__(self, "_full", np.full((inner.max_tokens, vocab_size), -np.inf, np.float32))

    def forward(self, tokens, *, depths=None, tree_mask=None, phase: str = "decode") -> StepOutput:
        out = self.inner.forward(tokens, depths=depths, tree_mask=tree_mask, phase=phase)
        full = self._full[:len(out.logits)]
        full[:, self.ids] = out.logits          # the other columns stay -inf: probability 0 after any warp
        return StepOutput(full, out.hidden, out.aux)

    def __getattr__(self, name):                # length, capacity, commit, rollback, reset, timings, ...
        return getattr(self.inner, name)

    def __setattr__(self, name, value):         # the bench sets timings / check_inputs on what it holds
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()
