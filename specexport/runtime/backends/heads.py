"""Heads graphs (Medusa) in ONNX Runtime: the target's final hidden state in, each head's top-K ids out.

No KV and no state: one call per round on one hidden row. Output buffers are allocated once and
bound once, every tensor of the heads IO table to its buffer:
    hidden     [1, 1, H]     float32  the input row
    ids        [1, 1, N, K]  int64    each head's K most likely tokens, most likely first
    logprobs   [1, 1, N, K]  float32  their log-probabilities
`timings` records each call as ("decode", 1) when set to {}, so the bench prices a heads call the way
it prices a draft step. Open heads with runtime/backends' `open_heads`.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specexport.io_spec import HEAD_TOPK_IDS, HEAD_TOPK_LOGPROBS, HIDDEN_STATES, HeadsIO


class OrtHeads:
    timings: dict | None = None
    clock = staticmethod(time.perf_counter)

    def __init__(self, model_dir, *, io: HeadsIO, threads: int | None = 1, spin: bool = False, session=None, **_):
        from specexport.runtime.backends.ort import open_session

        self.session = session or open_session(Path(model_dir) / "model.onnx", threads=threads, spin=spin)
        self.io = io
        self.num_heads, self.top_k = io.num_heads, io.top_k
        self._hidden = np.zeros((1, 1, io.hidden_size), np.float32)                 # [1, 1, H]
        self.ids = np.zeros((1, 1, io.num_heads, io.top_k), np.int64)                # [1, 1, N, K]
        self.logprobs = np.zeros((1, 1, io.num_heads, io.top_k), np.float32)         # [1, 1, N, K]
        self.binding = self.session.io_binding()
        buffers = {HIDDEN_STATES: self._hidden, HEAD_TOPK_IDS: self.ids, HEAD_TOPK_LOGPROBS: self.logprobs}
        for spec in io.inputs:
            buf = buffers[spec.name]
            self.binding.bind_input(spec.name, "cpu", 0, buf.dtype.type, buf.shape, buf.ctypes.data)
        for spec in io.outputs:
            buf = buffers[spec.name]
            self.binding.bind_output(spec.name, "cpu", 0, buf.dtype.type, buf.shape, buf.ctypes.data)

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [H] -> ids [N, K] (a view of a reused buffer: each head's K most likely tokens)."""
        self._hidden[0, 0] = hidden
        if self.timings is None:
            self.session.run_with_iobinding(self.binding)
        else:
            start = self.clock()
            self.session.run_with_iobinding(self.binding)
            self.timings.setdefault(("decode", 1), []).append(self.clock() - start)
        return self.ids[0, 0]

    def sharing(self) -> "OrtHeads":
        """Heads on this session with buffers and a binding of their own: a batched request's, which may
        run while another request's run (ONNX Runtime's Run is thread-safe; the bindings are not shared)."""
        return OrtHeads(None, io=self.io, session=self.session)

    def close(self) -> None:
        """Nothing to release: no buffers outside the session, which goes with the object."""
