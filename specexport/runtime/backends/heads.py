"""Heads graphs (Medusa) in ONNX Runtime: the target's final hidden state in, each head's top-K ids out.

No KV and no state: one call per round on one hidden row. Output buffers are allocated once and
bound, as in OrtBackend; `timings` records each call as ("decode", 1) when set to {}, so the bench
prices a heads call the way it prices a draft step.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specexport.errors import SpecexportError
from specexport.io_spec import HeadsIO


class OrtHeads:
    timings: dict | None = None
    clock = staticmethod(time.perf_counter)

    def __init__(self, model_dir, *, io: HeadsIO, threads: int | None = 1, spin: bool = False, **_):
        from specexport.runtime.backends.ort import open_session

        self.session = open_session(Path(model_dir) / "model.onnx", threads=threads, spin=spin)
        self.io = io
        self.num_heads, self.top_k = io.num_heads, io.top_k
        self._hidden = np.zeros((1, 1, io.hidden_size), np.float32)                 # [1, 1, H]
        self.ids = np.zeros((1, 1, io.num_heads, io.top_k), np.int64)                # [1, 1, N, K]
        self.logprobs = np.zeros((1, 1, io.num_heads, io.top_k), np.float32)         # [1, 1, N, K]
        self.binding = self.session.io_binding()
        self.binding.bind_input("hidden_states", "cpu", 0, np.float32, self._hidden.shape, self._hidden.ctypes.data)
        self.binding.bind_output("head_topk_ids", "cpu", 0, np.int64, self.ids.shape, self.ids.ctypes.data)
        self.binding.bind_output("head_topk_logprobs", "cpu", 0, np.float32, self.logprobs.shape,
                                 self.logprobs.ctypes.data)

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

    def close(self) -> None:
        """Nothing to release: no buffers outside the session, which goes with the object."""


def open_heads(kind: str, model_dir, *, io: HeadsIO, **options):
    if kind == "onnxruntime":
        return OrtHeads(model_dir, io=io, **options)
    raise SpecexportError(f"backend: {kind!r} is not available for heads in this version; available: onnxruntime")
