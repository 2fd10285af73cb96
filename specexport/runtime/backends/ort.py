"""ONNX Runtime backend (CPU): one session per model, static KV buffers bound without copies.

Buffers (allocated once, never resized; B = 1):
    k[i], v[i]   [1, capacity, Hkv, D] float32   per layer; rows [0, length) are the committed cache
    logits       [1, max_tokens, V]    float32   output rows of the last forward
    hidden       [1, max_tokens, H]    float32
    aux          [1, max_tokens, k*H]  float32   only when the graph exports aux hidden states

Each forward binds the committed prefix k[i][:, :length] as `past_key.i` (a zero-copy view: the
buffers are sequence-major) and binds `present_key.i` to the scratch rows k[i][:, length:length+T],
so the graph writes the new tokens' K/V straight into place. Committing a chain costs nothing;
committing a tree path copies only the accepted rows. Attention costs `length`, not `capacity`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import ModelIO
from specexport.runtime.backends.base import Backend, StepOutput


class OrtBackend(Backend):
    def __init__(self, model_dir, *, io: ModelIO, capacity: int, max_tokens: int, threads: int | None = None,
                 spin: bool = True, session_options: dict | None = None):
        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=io.vocab_size)
        ort = require("onnxruntime")
        path = Path(model_dir) / "model.onnx"
        if not path.is_file():
            raise SpecexportError(f"{path}: missing (the build output is incomplete; rebuild it)")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        if not spin:
            # Idle intra-op threads otherwise spin after each run; with a draft and a target session
            # alternating on few cores, one session's spinning pool steals the other's cores.
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        for key, value in (session_options or {}).items():
            setattr(opts, key, value)
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.io = io
        self.binding = self.session.io_binding()
        kv_shape = (1, capacity, io.num_kv_heads, io.head_dim)
        self.k = [np.zeros(kv_shape, np.float32) for _ in range(io.num_layers)]     # [1, C, Hkv, D]
        self.v = [np.zeros(kv_shape, np.float32) for _ in range(io.num_layers)]     # [1, C, Hkv, D]
        self.row_bytes = io.num_kv_heads * io.head_dim * 4
        self.logits = np.zeros((1, max_tokens, io.vocab_size), np.float32)           # [1, Tmax, V]
        self.hidden = np.zeros((1, max_tokens, io.hidden_size), np.float32)          # [1, Tmax, H]
        aux_width = len(io.aux_hidden_layers) * io.hidden_size
        self.aux = np.zeros((1, max_tokens, aux_width), np.float32) if aux_width else None
        self._causal = np.tril(np.ones((max_tokens, max_tokens), dtype=bool))
        self._arange = np.arange(max_tokens, dtype=np.int64)
        self.last_aux: np.ndarray | None = None                                     # [T, k*H] view

    def _forward(self, tokens, depths, tree_mask) -> StepOutput:
        T, P, b = len(tokens), self.length, self.binding
        positions = P + (self._arange[:T] if depths is None else np.asarray(depths, dtype=np.int64))
        mask = np.ascontiguousarray(self._causal[:T, :T] if tree_mask is None else tree_mask, dtype=bool)
        b.bind_cpu_input("input_ids", tokens.reshape(1, T))
        b.bind_cpu_input("position_ids", positions.reshape(1, T))
        b.bind_cpu_input("tree_mask", mask.reshape(1, T, T))
        kv = self.io.num_kv_heads, self.io.head_dim
        for i in range(self.io.num_layers):
            (pk, pv), (nk, nv) = self.io.past_names(i), self.io.present_names(i)
            for buf, past_name, new_name in ((self.k[i], pk, nk), (self.v[i], pv, nv)):
                ptr = buf.ctypes.data
                b.bind_input(past_name, "cpu", 0, np.float32, (1, P, *kv), ptr)
                b.bind_output(new_name, "cpu", 0, np.float32, (1, T, *kv), ptr + P * self.row_bytes)
        b.bind_output("logits", "cpu", 0, np.float32, (1, T, self.io.vocab_size), self.logits.ctypes.data)
        b.bind_output("hidden_states", "cpu", 0, np.float32, (1, T, self.io.hidden_size), self.hidden.ctypes.data)
        if self.aux is not None:
            b.bind_output("aux_hidden_states", "cpu", 0, np.float32, (1, T, self.aux.shape[-1]), self.aux.ctypes.data)
            self.last_aux = self.aux[0, :T]
        self.session.run_with_iobinding(b)
        return StepOutput(self.logits[0, :T], self.hidden[0, :T])

    def _move_rows(self, keep: np.ndarray) -> None:
        dest = self.length + np.arange(len(keep))
        src = self.length + keep
        for buf in (*self.k, *self.v):
            buf[0, dest] = buf[0, src]          # fancy indexing copies the source rows first

    @property
    def kv_bytes(self) -> int:
        return sum(b.nbytes for b in (*self.k, *self.v))
