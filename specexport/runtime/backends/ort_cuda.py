"""ONNX Runtime on CUDA (onnxruntime-gpu's CUDAExecutionProvider): the same graphs, KV in device memory.

UNVERIFIED: written against onnxruntime's documented Python API (OrtValue on "cuda", IOBinding);
the machines this was written on have no GPU, so it has never run. `benchmarks/gpu_check.py` runs it
on the demo against the CPU backend (greedy speculative output must equal vanilla) where a GPU is.

Buffers (buffers.ModelBuffers, the CPU backend's, with the caches on the device):
    k[i], v[i]   OrtValue [1, Hkv, C, D] float32 on the device: bound as past_key.i and
                 present_key.i (the same memory: GroupQueryAttention's CUDA kernel updates it in place)
    logits, hidden, aux: host arrays, bound as outputs: ONNX Runtime copies them back at the end of
                 each run, the one host synchronisation per forward
The KV buffers are bound once; each forward binds only the small host inputs (token ids, positions,
the mask, logits_rows: ModelBuffers.inputs) and the host outputs.
Committing a tree path moves KV rows on the device by a host round trip of each buffer (OrtValue has
no device-to-device slice copy): chains never move rows; trees pay O(cache) per accepted tree.
What this backend does not change: which graph runs (model.onnx; an fp16 build's real fp16 graph,
not its CPU stand-in) and the Backend contract (base.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import (ATTENTION_MASK, AUX_HIDDEN_STATES, HIDDEN_STATES, INPUT_IDS, LOGITS, LOGITS_ROWS,
                                POSITION_IDS, ModelIO)
from specexport.runtime.backends.base import Backend, StepOutput
from specexport.runtime.backends.buffers import ModelBuffers
from specexport.runtime.backends.ort import OPTIMIZATION_LEVELS


def cuda_provider_problem(ort) -> str | None:
    """Why CUDAExecutionProvider cannot be used here, or None."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"device cuda: this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider (providers: "
                f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu in place of onnxruntime "
                "on a machine with an NVIDIA GPU and CUDA")
    return None


class OrtCudaBackend(Backend):
    def __init__(self, model_dir, *, io: ModelIO, capacity: int, max_tokens: int, device_id: int = 0,
                 min_tokens: int = 1, optimization: str = "all", graph: str = "model.onnx", **unused):
        ort = require("onnxruntime")
        problem = cuda_provider_problem(ort)
        if problem:
            raise SpecexportError(problem)
        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=io.vocab_size)
        path = Path(model_dir) / "model.onnx"       # the GPU graph; `graph` names the CPU stand-in
        self.session = _cuda_session(ort, path, device_id=device_id, optimization=optimization)
        self.model_path, self.io, self.device_id = path, io, device_id
        self.binding = self.session.io_binding()
        new = ort.OrtValue.ortvalue_from_shape_and_type

        def device_caches(shape, layers):
            return ([new(shape, np.float32, "cuda", device_id) for _ in range(layers)],
                    [new(shape, np.float32, "cuda", device_id) for _ in range(layers)])

        self.buffers = b = ModelBuffers.allocate(io, capacity=capacity, max_tokens=max_tokens, min_tokens=min_tokens,
                                                 caches=device_caches)
        self.k, self.v, self.min_tokens, self.kv_shape = b.k, b.v, b.min_tokens, b.kv_shape
        for i, (k, v) in enumerate(zip(b.k, b.v)):
            for past, present, cache in zip(io.past_names(i), io.present_names(i), (k, v)):
                self.binding.bind_ortvalue_input(past, cache)
                self.binding.bind_ortvalue_output(present, cache)      # the same device memory: updated in place

    last_aux = property(lambda self: self.buffers.last_aux)      # [T, k*H] view: the last forward's aux rows
    kv_bytes = property(lambda self: self.buffers.kv_bytes)

    def _forward(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        return self.buffers.run(self._rows, tokens, depths, tree_mask, last_only)

    def _rows(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        T, binding, buf = len(tokens), self.binding, self.buffers
        tokens, positions, mask, rows = buf.inputs(tokens, depths, tree_mask, last_only, length=self.length)
        R = rows.shape[1]
        # binding a name again replaces it; the KV OrtValues were bound once, in __init__
        binding.bind_cpu_input(INPUT_IDS, tokens)
        binding.bind_cpu_input(POSITION_IDS, positions)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        binding.bind_cpu_input(LOGITS_ROWS, rows)
        binding.bind_output(LOGITS, "cpu", 0, np.float32, (1, R, self.io.vocab_size), buf.logits.ctypes.data)
        binding.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, (1, T, self.io.hidden_size), buf.hidden.ctypes.data)
        if buf.aux is not None:
            binding.bind_output(AUX_HIDDEN_STATES, "cpu", 0, np.float32, (1, T, buf.aux.shape[-1]),
                                buf.aux.ctypes.data)
        self.session.run_with_iobinding(binding)
        return buf.output(R, T)

    def _move_rows(self, keep: np.ndarray) -> None:
        dest, src = self.length + np.arange(len(keep)), self.length + keep
        for buf in (*self.buffers.k, *self.buffers.v):
            host = buf.numpy()                        # device -> host copy of the whole buffer
            host[0, :, dest] = host[0, :, src]
            buf.update_inplace(np.ascontiguousarray(host))


def _cuda_session(ort, path: Path, *, device_id: int, optimization: str):
    """An ORT session of `path` on CUDAExecutionProvider (CPU for what it lacks), with one-line errors."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
    try:
        return ort.InferenceSession(str(path), opts, providers=[
            ("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"])
    except Exception as err:       # onnxruntime raises its own exception types
        first = next((x for x in str(err).splitlines() if x.strip()), type(err).__name__)
        raise SpecexportError(f"{path}: ONNX Runtime (CUDA) could not load it ({first.strip()[:300]})") from None
