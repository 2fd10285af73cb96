"""The preallocated buffers of a model backend, in one object (llama2.c's RunState), and the builder of
each call's small inputs: shared by the ONNX Runtime CPU (ort.py), ONNX Runtime CUDA (ort_cuda.py) and
TensorRT (trt.py) backends, which differ only in where the caches live and how a call is bound.

Buffers (allocated once, never resized; B = 1; C = cache rows = capacity + min_tokens - 1 unless the
engine fixes more; Tmax = max_tokens):
    k[i], v[i]   [1, Hkv, C, D]  float32  layer i's caches: numpy here, OrtValues on CUDA, torch views on
                                          TensorRT (`allocate`'s `caches`); rows [0, length) committed
    logits       [1, Tmax, V]    float32  host: the rows of the last call (1 after a prefill)
    hidden       [1, Tmax, H]    float32  host: final post-norm hidden state per row
    aux          [1, Tmax, k*H]  float32  host, only when the graph exports aux hidden states (EAGLE-3)
    mask         [Tmax * C]      bool     host, flat: each call's [1, T, length + T] attention mask
    causal       [Tmax, Tmax]    bool     lower triangle: a chain's mask among the new rows
    arange       [Tmax]          int64    0..Tmax-1: a chain's depths, and logits_rows

Host buffers come from `allocate`'s `host` (numpy by default; TensorRT passes pinned staging memory).
StepOutputs are views of them, valid until the next call (base.py: the loop copies what it keeps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.io_spec import ATTENTION_MASK, AUX_HIDDEN_STATES, HIDDEN_STATES, LOGITS, ModelIO
from specexport.runtime.backends.base import StepOutput


def _host_zeros(name: str, shape: tuple, dtype) -> np.ndarray:
    return np.zeros(shape, dtype)


def _host_caches(shape: tuple, layers: int) -> tuple[list, list]:
    return ([np.zeros(shape, np.float32) for _ in range(layers)],
            [np.zeros(shape, np.float32) for _ in range(layers)])


@dataclass(eq=False)
class ModelBuffers:
    kv_shape: tuple                 # (1, Hkv, C, D): the shape of every cache
    k: list                         # L x [1, Hkv, C, D] float32, layer i's K cache (bound as past and present)
    v: list                         # L x [1, Hkv, C, D] float32, layer i's V cache
    logits: np.ndarray              # [1, Tmax, V] float32
    hidden: np.ndarray              # [1, Tmax, H] float32
    aux: np.ndarray | None          # [1, Tmax, k*H] float32, or None: the graph has no aux output
    mask: np.ndarray                # [Tmax * C] bool, flat; a call's mask is a [1, T, P + T] view of its start
    causal: np.ndarray              # [Tmax, Tmax] bool, lower triangle
    arange: np.ndarray              # [Tmax] int64, 0..Tmax-1
    min_tokens: int = 1             # every call runs at least this many rows (padding after the real ones)
    last_aux: np.ndarray | None = None      # [T, k*H] view of aux: the last call's rows

    @classmethod
    def allocate(cls, io: ModelIO, *, capacity: int, max_tokens: int, min_tokens: int = 1, rows: int | None = None,
                 caches=_host_caches, host=_host_zeros) -> "ModelBuffers":
        """Buffers for calls of up to max_tokens rows over `capacity` committed positions.
        min_tokens > 1: every call runs at least this many rows (the build found the graph's one-row
        kernels compute differently from its multi-row ones); the caches get room for the padding.
        rows: the caches' rows when something else fixes them (an engine; at least capacity + padding).
        caches(shape, layers) -> (k list, v list); host(name, shape, dtype) -> a host array for the
        tensor `name` (LOGITS, HIDDEN_STATES, AUX_HIDDEN_STATES, ATTENTION_MASK)."""
        min_tokens = max(1, min(int(min_tokens), max_tokens))
        kv_shape = (1, io.num_kv_heads, capacity + min_tokens - 1 if rows is None else rows, io.head_dim)
        k, v = caches(kv_shape, io.num_layers)
        aux_width = len(io.aux_hidden_layers) * io.hidden_size
        return cls(kv_shape=kv_shape, k=k, v=v,
                   logits=host(LOGITS, (1, max_tokens, io.vocab_size), np.float32),
                   hidden=host(HIDDEN_STATES, (1, max_tokens, io.hidden_size), np.float32),
                   aux=host(AUX_HIDDEN_STATES, (1, max_tokens, aux_width), np.float32) if aux_width else None,
                   mask=host(ATTENTION_MASK, (max_tokens * kv_shape[2],), np.bool_),
                   causal=np.tril(np.ones((max_tokens, max_tokens), dtype=bool)),
                   arange=np.arange(max_tokens, dtype=np.int64), min_tokens=min_tokens)

    @property
    def kv_bytes(self) -> int:
        return 2 * len(self.k) * int(np.prod(self.kv_shape)) * 4

    def run(self, rows, tokens, depths, tree_mask, last_only: bool) -> StepOutput:
        """rows(tokens, depths, tree_mask, last_only) -> StepOutput: a backend's call, given at least
        min_tokens rows: fewer are padded with copies of the last token after them. The real rows cannot
        see the padding (it comes later, and the mask keeps it so for trees); its K/V lands in scratch
        rows that no commit keeps. The output is cut back to the real rows."""
        T = len(tokens)
        if T >= self.min_tokens:
            return rows(tokens, depths, tree_mask, last_only)
        pad = self.min_tokens - T
        tokens = np.concatenate([tokens, np.full(pad, tokens[-1], dtype=np.int64)])
        if depths is not None:
            depths = np.concatenate([np.asarray(depths, np.int64), depths[-1] + 1 + np.arange(pad)])
        if tree_mask is not None:
            mask = np.eye(T + pad, dtype=bool)
            mask[:T, :T] = tree_mask
            tree_mask = mask
        out = rows(tokens, depths, tree_mask, last_only=False)
        if self.last_aux is not None:
            self.last_aux = self.last_aux[:T]
        return StepOutput(out.logits[T - 1:T] if last_only else out.logits[:T], out.hidden[:T], self.last_aux)

    def inputs(self, tokens, depths, tree_mask, last_only: bool, *, length: int):
        """(input_ids [1, T], position_ids [1, T], attention_mask [1, T, P + T], logits_rows [1, R]) of one
        call after `length` committed rows, each contiguous; the mask is a view of the flat buffer."""
        T, P = len(tokens), length
        positions = P + (self.arange[:T] if depths is None else np.asarray(depths, dtype=np.int64))
        mask = self.mask[:T * (P + T)].reshape(1, T, P + T)
        mask[0, :, :P] = True
        mask[0, :, P:] = self.causal[:T, :T] if tree_mask is None else tree_mask
        R = 1 if last_only else T                       # prefill: the next token's logits only
        return (np.ascontiguousarray(tokens).reshape(1, T), positions.reshape(1, T), mask,
                self.arange[T - R:T].reshape(1, R))

    def output(self, R: int, T: int) -> StepOutput:
        """The last call's R logits rows and T hidden (and aux) rows, as views."""
        if self.aux is not None:
            self.last_aux = self.aux[0, :T]
        return StepOutput(self.logits[0, :R], self.hidden[0, :T], self.last_aux)
