"""An EAGLE head graph in ONNX Runtime: one decoder layer with a static KV cache of its own.

Buffers (allocated once, never resized; B = 1):
    k, v          [1, Hkv, capacity, D] float32   rows [0, length) committed; drafts write past them
    ids           [1, max_tokens, K]  int64       each row's top-K draft-vocabulary ids (output)
    logprobs      [1, max_tokens, K]  float32     their log-probabilities, descending
    hidden        [1, max_tokens, H]  float32     each row's output state (what a next level reads)
    mask          max_tokens x (capacity + max_tokens) bool, flat: each call's [1, T, length + T] view

`draft` runs T rows at `positions`; each row reads either the target's feature (`features`) or the
head's own state (`own`): the graph's other input gets zeros (heads/eagle_graph.py). `past_mask`
[T, length] says which cached rows each new row sees: None is all of them (catching up on committed
text); a draft level passes its rows' ancestors among the earlier levels' rows. The rows' K/V land
at [length, length + T); `commit` keeps them (the committed text, or a level the next one attends
to), `rollback` forgets a draft. State, checks and timings are Backend's (base.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.errors import SpecexportError
from specexport.io_spec import EagleIO
from specexport.runtime.backends.base import Backend


@dataclass(frozen=True)
class HeadStep:
    ids: np.ndarray           # [R, K] int64 draft-vocabulary ids, most likely first (view of a reused buffer)
    logprobs: np.ndarray      # [R, K] float32
    hidden: np.ndarray        # [T, H] float32 each row's output state


class OrtEagleHead(Backend):
    def __init__(self, model_dir, *, io: EagleIO, capacity: int, max_tokens: int, threads: int | None = 1,
                 spin: bool = False, optimization: str = "all", **_):
        from specexport.runtime.backends.ort import _binding_calls, open_session
        from specexport._optional import require

        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=0)
        ort = require("onnxruntime")
        self.session = open_session(Path(model_dir) / "model.onnx", threads=threads, spin=spin,
                                    optimization=optimization)
        self.io, self.top_k, self.hidden_size = io, io.top_k, io.hidden_size
        self.binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = _binding_calls(ort, self.session, self.binding)
        kv = (1, io.num_kv_heads, capacity, io.head_dim)
        self.k, self.v = np.zeros(kv, np.float32), np.zeros(kv, np.float32)          # [1, Hkv, C, D]
        self.ids = np.zeros((1, max_tokens, io.top_k), np.int64)                       # [1, Tmax, K]
        self.logprobs = np.zeros((1, max_tokens, io.top_k), np.float32)                # [1, Tmax, K]
        self.hidden = np.zeros((1, max_tokens, io.hidden_size), np.float32)            # [1, Tmax, H]
        self._features = np.zeros((1, max_tokens, io.feature_width), np.float32)       # [1, Tmax, F]
        self._own = np.zeros((1, max_tokens, io.hidden_size), np.float32)              # [1, Tmax, H]
        self._mask = np.ones(max_tokens * (capacity + max_tokens), dtype=bool)
        self._arange = np.arange(max_tokens + capacity, dtype=np.int64)
        self._tri = np.tri(max_tokens, dtype=bool)                                     # catch-up rows: a chain
        self._eye = np.eye(max_tokens, dtype=bool)                                     # draft-level rows: themselves
        # the buffers never move: their addresses are taken once, and the caches (fixed shape) bound once
        self._ptr = {name: buf.ctypes.data for name, buf in (("ids", self.ids), ("logprobs", self.logprobs),
                                                              ("hidden", self.hidden), ("features", self._features),
                                                              ("own", self._own))}
        for past, present, buf in zip(io.past_names(0), io.present_names(0), (self.k, self.v)):
            self._bind_in(past, kv, buf.ctypes.data)
            self._bind_out(present, kv, buf.ctypes.data)           # the same memory: updated in place

    def draft(self, tokens, positions, *, features=None, own=None, past_mask=None, last_only: bool = False,
              phase: str = "decode") -> HeadStep:
        """tokens [T] at positions [T]; features [T, F] (the target's) or own [T, H] (the head's own
        states), exactly one; past_mask [T, length] (None: every cached row visible); the new rows see
        themselves only (each is its own node: catch-up rows are a chain, so they see the earlier
        ones too, which `past_mask` None gives them through causal order). last_only: top-K of the
        last row only. phase: the tag `timings` files the call under ("prefill" for the prompt's rows)."""
        T, P = len(tokens), self.length
        if not 1 <= T <= self.max_tokens:
            raise SpecexportError(f"EAGLE head: {T} rows in one call, it takes 1..{self.max_tokens}")
        if P + T > self.capacity:
            raise SpecexportError(f"EAGLE head: KV capacity exceeded: {P} cached + {T} new > {self.capacity}")
        if (features is None) == (own is None):
            raise SpecexportError("EAGLE head: each call reads either the target's features or its own states")
        self._pending = T
        feats, mine = self._features[:, :T], self._own[:, :T]
        if features is not None:
            feats[0], mine[0] = features, 0.0
        else:
            feats[0], mine[0] = 0.0, own
        mask = self._mask[:T * (P + T)].reshape(1, T, P + T)
        if past_mask is None:                                   # catching up: a causal chain after the cache
            mask[0, :, :P] = True
            mask[0, :, P:] = self._tri[:T, :T]
        else:                                                   # a draft level: ancestors, then itself
            mask[0, :, :P] = past_mask
            mask[0, :, P:] = self._eye[:T, :T]
        R = 1 if last_only else T
        # numpy inputs are bound by address: each must be a live, contiguous local until _run
        ids = np.ascontiguousarray(tokens, dtype=np.int64).reshape(1, T)
        pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(1, T)
        rows = self._arange[T - R:T].reshape(1, R)
        bind_in, bind_out, ptr = self._bind_in, self._bind_out, self._ptr
        bind_in("input_ids", ids)
        bind_in("position_ids", pos)
        bind_in("attention_mask", mask)
        bind_in("logits_rows", rows)
        bind_in("features", (1, T, self.io.feature_width), ptr["features"])
        bind_in("draft_hidden", (1, T, self.hidden_size), ptr["own"])
        bind_out("topk_ids", (1, R, self.top_k), ptr["ids"], np.int64)
        bind_out("topk_logprobs", (1, R, self.top_k), ptr["logprobs"])
        bind_out("hidden_states", (1, T, self.hidden_size), ptr["hidden"])
        if self.timings is None:
            self._run()
        else:
            start = self.clock()
            self._run()
            self.timings.setdefault((phase, T), []).append(self.clock() - start)
        return HeadStep(self.ids[0, :R], self.logprobs[0, :R], self.hidden[0, :T])

    def _move_rows(self, keep: np.ndarray) -> None:
        raise SpecexportError("EAGLE head: rows are committed in order (the accepted text), never compacted")

    @property
    def kv_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def open_eagle_head(kind: str, model_dir, *, io: EagleIO, **options):
    if kind == "onnxruntime":
        return OrtEagleHead(model_dir, io=io, **options)
    raise SpecexportError(f"backend: {kind!r} is not available for EAGLE heads in this version; available: onnxruntime")
