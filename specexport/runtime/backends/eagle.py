"""An EAGLE head graph in ONNX Runtime: one decoder layer with a static KV cache of its own.

Buffers (HeadBuffers: allocated once, never resized; B = 1; C = capacity):
    k, v          [1, Hkv, C, D]      float32   rows [0, length) committed; drafts write past them
    ids           [1, max_tokens, K]  int64     each row's top-K draft-vocabulary ids (output)
    logprobs      [1, max_tokens, K]  float32   their log-probabilities, descending
    hidden        [1, max_tokens, H]  float32   each row's output state (what a next level reads)
    features      [1, max_tokens, F]  float32   the target's features of the rows that read them (input)
    own           [1, max_tokens, H]  float32   the head's own states of the rows that read them (input)
    mask          max_tokens x (C + max_tokens) bool, flat: each call's [1, T, length + T] view
They are not the model backends' ModelBuffers (buffers.py): the head's outputs are top-K ids, not
logits, it reads features / draft_hidden, and a draft level's mask says which cached rows it sees.

`draft` runs T rows at `positions`; each row reads either the target's feature (`features`) or the
head's own state (`own`): the graph's other input gets zeros (heads/eagle_graph.py). `past_mask`
[T, length] says which cached rows each new row sees: None is all of them (catching up on committed
text); a draft level passes its rows' ancestors among the earlier levels' rows. The rows' K/V land
at [length, length + T); `commit` keeps them (the committed text, or a level the next one attends
to), `rollback` forgets a draft. State, checks and timings are Backend's (base.py). Open a head with
runtime/backends' `open_eagle_head`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import (ATTENTION_MASK, DRAFT_HIDDEN, FEATURES, HIDDEN_STATES, INPUT_IDS, LOGITS_ROWS,
                                POSITION_IDS, TOPK_IDS, TOPK_LOGPROBS, EagleIO)
from specexport.runtime.backends.base import Backend


@dataclass(frozen=True)
class HeadStep:
    ids: np.ndarray           # [R, K] int64 draft-vocabulary ids, most likely first (view of a reused buffer)
    logprobs: np.ndarray      # [R, K] float32
    hidden: np.ndarray        # [T, H] float32 each row's output state


@dataclass(eq=False)
class HeadBuffers:
    k: np.ndarray             # [1, Hkv, C, D] float32, bound as past_key.0 and present_key.0
    v: np.ndarray             # [1, Hkv, C, D] float32
    ids: np.ndarray           # [1, Tmax, K] int64
    logprobs: np.ndarray      # [1, Tmax, K] float32
    hidden: np.ndarray        # [1, Tmax, H] float32
    features: np.ndarray      # [1, Tmax, F] float32
    own: np.ndarray           # [1, Tmax, H] float32
    mask: np.ndarray          # [Tmax * (C + Tmax)] bool, flat
    arange: np.ndarray        # [Tmax + C] int64, 0.. (logits_rows)
    causal: np.ndarray        # [Tmax, Tmax] bool lower triangle: catch-up rows are a chain
    eye: np.ndarray           # [Tmax, Tmax] bool: draft-level rows see themselves

    @classmethod
    def allocate(cls, io: EagleIO, *, capacity: int, max_tokens: int) -> "HeadBuffers":
        kv = (1, io.num_kv_heads, capacity, io.head_dim)
        return cls(k=np.zeros(kv, np.float32), v=np.zeros(kv, np.float32),
                   ids=np.zeros((1, max_tokens, io.top_k), np.int64),
                   logprobs=np.zeros((1, max_tokens, io.top_k), np.float32),
                   hidden=np.zeros((1, max_tokens, io.hidden_size), np.float32),
                   features=np.zeros((1, max_tokens, io.feature_width), np.float32),
                   own=np.zeros((1, max_tokens, io.hidden_size), np.float32),
                   mask=np.ones(max_tokens * (capacity + max_tokens), dtype=bool),
                   arange=np.arange(max_tokens + capacity, dtype=np.int64),
                   causal=np.tri(max_tokens, dtype=bool), eye=np.eye(max_tokens, dtype=bool))

    def call_mask(self, T: int, P: int, past_mask) -> np.ndarray:
        """[1, T, P + T] view of the flat mask: past_mask [T, P] (None: all visible, the new rows a chain)
        or a draft level's (ancestors, then each row itself)."""
        mask = self.mask[:T * (P + T)].reshape(1, T, P + T)
        if past_mask is None:                                   # catching up: a causal chain after the cache
            mask[0, :, :P] = True
            mask[0, :, P:] = self.causal[:T, :T]
        else:                                                   # a draft level: ancestors, then itself
            mask[0, :, :P] = past_mask
            mask[0, :, P:] = self.eye[:T, :T]
        return mask


def check_call(head, T: int, features, *, own) -> None:
    """A head call's checks (this head's and a batch slot's): its rows fit, it reads one kind of state."""
    if not 1 <= T <= head.max_tokens:
        raise SpecexportError(f"EAGLE head: {T} rows in one call, it takes 1..{head.max_tokens}")
    if head.length + T > head.capacity:
        raise SpecexportError(f"EAGLE head: KV capacity exceeded: {head.length} cached + {T} new > {head.capacity}")
    if (features is None) == (own is None):
        raise SpecexportError("EAGLE head: each call reads either the target's features or its own states")


class OrtEagleHead(Backend):
    def __init__(self, model_dir, *, io: EagleIO, capacity: int, max_tokens: int, threads: int | None = 1,
                 spin: bool = False, optimization: str = "all", session=None, our_attention: bool = False, **_):
        from specexport.plugins.cpu.graph import with_our_attention
        from specexport.runtime.backends.ort import binding_calls, open_session

        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=0)
        ort = require("onnxruntime")
        self.session = session or open_session(Path(model_dir) / "model.onnx", threads=threads, spin=spin,
                                               optimization=optimization,
                                               model=with_our_attention(Path(model_dir) / "model.onnx", io.head_dim)
                                               if our_attention else None)
        self.io, self.top_k, self.hidden_size = io, io.top_k, io.hidden_size
        self.binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = binding_calls(ort, self.session, self.binding)
        self.buffers = b = HeadBuffers.allocate(io, capacity=capacity, max_tokens=max_tokens)
        self.k, self.v, self.ids, self.logprobs, self.hidden = b.k, b.v, b.ids, b.logprobs, b.hidden
        # the buffers never move: their addresses are taken once, and the caches (fixed shape) bound once
        self._ptrs = tuple(buf.ctypes.data for buf in (b.features, b.own, b.ids, b.logprobs, b.hidden))
        for past, present, buf in zip(io.past_names(0), io.present_names(0), (b.k, b.v)):
            self._bind_in(past, buf.shape, buf.ctypes.data)
            self._bind_out(present, buf.shape, buf.ctypes.data)    # the same memory: updated in place

    def draft(self, tokens, positions, *, features=None, own=None, past_mask=None, last_only: bool = False,
              phase: str = "decode") -> HeadStep:
        """tokens [T] at positions [T]; features [T, F] (the target's) or own [T, H] (the head's own
        states), exactly one; past_mask [T, length] (None: every cached row visible); the new rows see
        themselves only (each is its own node: catch-up rows are a chain, so they see the earlier
        ones too, which `past_mask` None gives them through causal order). last_only: top-K of the
        last row only. phase: the tag `timings` files the call under ("prefill" for the prompt's rows)."""
        T, P, b = len(tokens), self.length, self.buffers
        check_call(self, T, features, own=own)
        self._pending = T
        feats, mine = b.features[:, :T], b.own[:, :T]
        if features is not None:
            feats[0], mine[0] = features, 0.0
        else:
            feats[0], mine[0] = 0.0, own
        mask = b.call_mask(T, P, past_mask)
        R = 1 if last_only else T
        # numpy inputs are bound by address: each must be a live, contiguous local until _run
        ids = np.ascontiguousarray(tokens, dtype=np.int64).reshape(1, T)
        pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(1, T)
        rows = b.arange[T - R:T].reshape(1, R)
        bind_in, bind_out = self._bind_in, self._bind_out
        features_ptr, own_ptr, ids_ptr, logprobs_ptr, hidden_ptr = self._ptrs
        bind_in(INPUT_IDS, ids)
        bind_in(POSITION_IDS, pos)
        bind_in(ATTENTION_MASK, mask)
        bind_in(LOGITS_ROWS, rows)
        bind_in(FEATURES, (1, T, self.io.feature_width), features_ptr)
        bind_in(DRAFT_HIDDEN, (1, T, self.hidden_size), own_ptr)
        bind_out(TOPK_IDS, (1, R, self.top_k), ids_ptr, np.int64)
        bind_out(TOPK_LOGPROBS, (1, R, self.top_k), logprobs_ptr)
        bind_out(HIDDEN_STATES, (1, T, self.hidden_size), hidden_ptr)
        if self.timings is None:
            self._run()
        else:
            start = self.clock()
            self._run()
            self.timings.setdefault((phase, T), []).append(self.clock() - start)
        return HeadStep(b.ids[0, :R], b.logprobs[0, :R], b.hidden[0, :T])

    def sharing(self) -> "OrtEagleHead":
        """A head on this session with a cache, buffers and a binding of its own: a batched request's, which
        may run while another request's head runs (ONNX Runtime's Run is thread-safe; nothing else shared)."""
        return OrtEagleHead(None, io=self.io, capacity=self.capacity, max_tokens=self.max_tokens,
                            session=self.session)

    def _move_rows(self, keep: np.ndarray) -> None:
        raise SpecexportError("EAGLE head: rows are committed in order (the accepted text), never compacted")

    @property
    def kv_bytes(self) -> int:
        return self.buffers.k.nbytes + self.buffers.v.nbytes

