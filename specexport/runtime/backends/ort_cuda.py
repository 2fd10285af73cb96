"""ONNX Runtime on CUDA (onnxruntime-gpu's CUDAExecutionProvider): the same graphs, KV in device memory.

UNVERIFIED: written against onnxruntime's documented Python API (OrtValue on "cuda", IOBinding);
the machines this was written on have no GPU, so it has never run. `benchmarks/gpu_check.py` runs it
on the demo against the CPU backend (greedy speculative output must equal vanilla) where a GPU is.

Buffers:
    k[i], v[i]   OrtValue [1, Hkv, capacity, D] float32 on the device: bound as past_key.i and
                 present_key.i (the same memory: GroupQueryAttention's CUDA kernel updates it in place)
    logits, hidden, aux: host arrays, bound as outputs: ONNX Runtime copies them back at the end of
                 each run, the one host synchronisation per forward
The KV buffers are bound once; each forward binds only the small host inputs (token ids, positions,
the mask, logits_rows: OrtBackend._small_inputs) and the host outputs.
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
from specexport.io_spec import ModelIO
from specexport.runtime.backends.ort import OPTIMIZATION_LEVELS, OrtBackend


def cuda_provider_problem(ort) -> str | None:
    """Why CUDAExecutionProvider cannot be used here, or None."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"device cuda: this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider (providers: "
                f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu in place of onnxruntime "
                "on a machine with an NVIDIA GPU and CUDA")
    return None


class OrtCudaBackend(OrtBackend):
    def __init__(self, model_dir, *, io: ModelIO, capacity: int, max_tokens: int, device_id: int = 0,
                 min_tokens: int = 1, optimization: str = "all", graph: str = "model.onnx", **unused):
        ort = require("onnxruntime")
        problem = cuda_provider_problem(ort)
        if problem:
            raise SpecexportError(problem)
        self._init_base(capacity=capacity, max_tokens=max_tokens, vocab_size=io.vocab_size)
        path = Path(model_dir) / "model.onnx"       # the GPU graph; `graph` names the CPU stand-in
        opts = ort.SessionOptions()
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=[
                ("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"])
        except Exception as err:       # onnxruntime raises its own exception types
            first = next((x for x in str(err).splitlines() if x.strip()), type(err).__name__)
            raise SpecexportError(f"{path}: ONNX Runtime (CUDA) could not load it ({first.strip()[:300]})") from None
        self.model_path, self.io, self.device_id = path, io, device_id
        self.binding = self.session.io_binding()
        self._kv_names = [(*io.past_names(i), *io.present_names(i)) for i in range(io.num_layers)]
        self.min_tokens = max(1, min(int(min_tokens), max_tokens))
        self.kv_shape = (1, io.num_kv_heads, capacity + self.min_tokens - 1, io.head_dim)
        new = ort.OrtValue.ortvalue_from_shape_and_type
        self.k = [new(self.kv_shape, np.float32, "cuda", device_id) for _ in range(io.num_layers)]
        self.v = [new(self.kv_shape, np.float32, "cuda", device_id) for _ in range(io.num_layers)]
        self.logits = np.zeros((1, max_tokens, io.vocab_size), np.float32)
        self.hidden = np.zeros((1, max_tokens, io.hidden_size), np.float32)
        aux_width = len(io.aux_hidden_layers) * io.hidden_size
        self.aux = np.zeros((1, max_tokens, aux_width), np.float32) if aux_width else None
        self._mask = np.ones(max_tokens * (self.kv_shape[2] + max_tokens), dtype=bool)
        self._causal = np.tril(np.ones((max_tokens, max_tokens), dtype=bool))
        self._arange = np.arange(max_tokens, dtype=np.int64)
        self.last_aux = None
        for k, v, (pk, pv, nk, nv) in zip(self.k, self.v, self._kv_names):
            self.binding.bind_ortvalue_input(pk, k)
            self.binding.bind_ortvalue_input(pv, v)
            self.binding.bind_ortvalue_output(nk, k)      # the same device memory: updated in place
            self.binding.bind_ortvalue_output(nv, v)

    def _init_base(self, **sizes) -> None:
        super(OrtBackend, self).__init__(**sizes)          # Backend's, not the CPU backend's buffers

    def _rows(self, tokens, depths, tree_mask, last_only):
        from specexport.runtime.backends.base import StepOutput

        T, b = len(tokens), self.binding
        tokens, positions, mask, rows = self._small_inputs(tokens, depths, tree_mask, last_only)
        R = rows.shape[1]
        # binding a name again replaces it; the KV OrtValues were bound once, in __init__
        b.bind_cpu_input("input_ids", tokens)
        b.bind_cpu_input("position_ids", positions)
        b.bind_cpu_input("attention_mask", mask)
        b.bind_cpu_input("logits_rows", rows)
        b.bind_output("logits", "cpu", 0, np.float32, (1, R, self.io.vocab_size), self.logits.ctypes.data)
        b.bind_output("hidden_states", "cpu", 0, np.float32, (1, T, self.io.hidden_size), self.hidden.ctypes.data)
        if self.aux is not None:
            b.bind_output("aux_hidden_states", "cpu", 0, np.float32, (1, T, self.aux.shape[-1]), self.aux.ctypes.data)
            self.last_aux = self.aux[0, :T]
        self.session.run_with_iobinding(b)
        return StepOutput(self.logits[0, :R], self.hidden[0, :T], self.last_aux)

    def _move_rows(self, keep: np.ndarray) -> None:
        dest, src = self.length + np.arange(len(keep)), self.length + keep
        for buf in (*self.k, *self.v):
            host = buf.numpy()                        # device -> host copy of the whole buffer
            host[0, :, dest] = host[0, :, src]
            buf.update_inplace(np.ascontiguousarray(host))

    @property
    def kv_bytes(self) -> int:
        return 2 * len(self.k) * int(np.prod(self.kv_shape)) * 4
