"""The Backend interface: a model with static KV buffers, driven one call at a time (batch 1).

State is one integer, `length`: the committed positions [0, length) of the KV buffers. `forward`
runs T new tokens at positions length + depth (the scratch rows [length, length + T) receive their
K/V); `commit` keeps some scratch rows, compacting them to contiguous positions; `rollback` forgets
committed positions (a chain's rejected tail needs nothing else: the next forward overwrites it).

              committed                 scratch (this forward)
    KV rows:  [0 ........ length) [length ......... length + T)   ... capacity
    commit(3):         [0 ........ length + 3)  rows length + keep[k] -> length + k
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specexport.errors import SpecexportError


@dataclass(frozen=True)
class StepOutput:
    logits: np.ndarray              # [T, V] float32 ([1, V] after a prefill forward); may be a view of a reused buffer
    hidden: np.ndarray | None       # [T, H] final post-norm hidden state, same caveat
    aux: np.ndarray | None = None   # [T, k*H] the inputs of the graph's aux_hidden_layers (EAGLE-3), same caveat


class Backend:
    """Base class: checks in the public methods, work in the `_*` methods subclasses implement."""

    capacity: int                   # KV buffer rows (max_seq_len)
    max_tokens: int                 # most tokens one forward takes
    vocab_size: int
    check_inputs: bool = True       # benchmarks may turn these checks off; never the capacity checks
    timings: dict | None = None     # set to {} to record {(phase, T): [seconds of each such forward]}
    clock = staticmethod(time.perf_counter)      # what `timings` are measured with (tests inject one)
    exact_trees: bool = True       # False: a tree's sibling rows differ from decoding (the build measured it:
                                    # stage "trees": "chains"); the loop then verifies a tree's first chain only

    @property
    def round_rows(self) -> int:
        """Rows a decode round should take now (the loop cuts its proposals to it): max_tokens here; a
        batch's slot (backends/slots.py) takes its share of the pass."""
        return self.max_tokens

    def __init__(self, *, capacity: int, max_tokens: int, vocab_size: int):
        self.capacity, self.max_tokens, self.vocab_size = capacity, max_tokens, vocab_size
        self.length = 0             # committed KV rows
        self._pending = 0           # scratch rows written by the last forward

    def forward(self, tokens: np.ndarray, *, depths: np.ndarray | None = None,
                tree_mask: np.ndarray | None = None, phase: str = "decode") -> StepOutput:
        """tokens [T]; depths [T] (default 0..T-1, a chain); tree_mask [T, T] (default causal).
        phase: "prefill" or "decode", the tag under which `timings` files this forward. A prefill
        forward computes the logits of its last row only (StepOutput.logits is then [1, V]: the next
        token's); hidden states come for every row either way."""
        T = len(tokens)
        # Always checked, whatever check_inputs says: backends write K/V and logits through raw
        # pointers into fixed buffers, so an overflow would corrupt memory instead of raising.
        if not 1 <= T <= self.max_tokens:
            raise SpecexportError(f"tokens: got {T} tokens in one call, this model takes 1..{self.max_tokens}")
        if self.length + T > self.capacity:
            raise SpecexportError(f"KV capacity exceeded: {self.length} committed + {T} new > "
                                  f"max_seq_len {self.capacity}")
        if self.check_inputs and tree_mask is not None and tree_mask.shape != (T, T):
            raise SpecexportError(f"tree_mask: got shape {tree_mask.shape}, expected ({T}, {T})")
        self._pending = T
        tokens = np.asarray(tokens, dtype=np.int64)
        last_only = phase == "prefill"
        if self.timings is None:
            return self._forward(tokens, depths, tree_mask, last_only)
        start = self.clock()
        out = self._forward(tokens, depths, tree_mask, last_only)
        self.timings.setdefault((phase, T), []).append(self.clock() - start)
        return out

    def commit(self, keep: int | np.ndarray) -> None:
        """Keep scratch rows: an int n keeps the first n (a chain), an array the given rows in order."""
        if isinstance(keep, (int, np.integer)):
            n = int(keep)
            if not 0 <= n <= self._pending:
                raise SpecexportError(f"commit: {n} rows asked, the last forward wrote {self._pending}")
        else:
            keep = np.asarray(keep, dtype=np.int64)
            rows = keep.tolist()            # a round's few rows: Python ints beat numpy's reductions
            if rows and (rows[0] < 0 or rows[-1] >= self._pending or any(b <= a for a, b in zip(rows, rows[1:]))):
                raise SpecexportError(f"commit: rows {rows} must increase within 0..{self._pending - 1}")
            n = len(rows)
            if self._needs_move(rows):
                self._move_rows(keep)
        self.length += n
        self._pending = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise SpecexportError(f"rollback: length {length} outside 0..{self.length}")
        self.length = length
        self._pending = 0

    def reset(self) -> None:
        self.rollback(0)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _needs_move(self, rows: list) -> bool:
        """Whether committing `rows` (Python ints) moves any (here: unless they are the first len(rows) in order)."""
        return rows != list(range(len(rows)))

    # -- what a backend implements --------------------------------------------------------
    def _forward(self, tokens, depths, tree_mask, last_only: bool) -> StepOutput:
        """logits for the last row only when last_only (a backend may return every row then)."""
        raise NotImplementedError

    def _move_rows(self, keep: np.ndarray) -> None:
        """Copy KV rows length + keep[k] -> length + k (keep is increasing, so in-order copies are safe)."""
        raise NotImplementedError


def prefill(backend: "Backend", prompt: np.ndarray, chunk: int, *, features=None) -> np.ndarray:
    """Run the prompt in chunks and commit it; returns the last position's logits [V] (a copy).
    features: called with each chunk's output, rows and first position (_feature_sink)."""
    s = 0
    while s < len(prompt):
        part = prompt[s:s + min(chunk, backend.round_rows)]     # a batch's slot: its share, as it is now
        out = backend.forward(part, phase="prefill")
        if features is not None:
            features(out, slice(None), backend.length)
        backend.commit(len(part))
        s += len(part)
    return np.array(out.logits[-1])
