"""TensorRT backend: an engine built from the in-place engine graph (trt/graph.py), device buffers.

UNVERIFIED: written against TensorRT 11's Python runtime API as NVIDIA/TensorRT 11.1's bindings state it
(python/src/infer/pyCore.cpp: Runtime.deserialize_cuda_engine, ICudaEngine.get_tensor_profile_shape /
get_aliased_input_tensor, IExecutionContext.set_optimization_profile_async / set_input_shape /
set_tensor_address / execute_async_v3). The machines this was written on have no GPU: it has run only
against a fake `tensorrt` module whose engine is the engine graph in ONNX Runtime (tests/test_trt_engine.py).

Buffers (allocated once on the device, never resized; B = 1; C = the engine's KV capacity):
    kv        [2L, 1, Hkv, C, D] float32  one tensor; layer i's K is kv[2i], its V kv[2i + 1], each bound as
                                          both past_key.i and present_key.i: the same device address, as
                                          TensorRT's KV-cache-update layer requires (it writes rows
                                          length..length+T-1 in place; TensorRT reports an API error otherwise)
    ids, pos  [max_tokens] int64          device inputs, filled from pinned host staging each forward
    rows      [max_tokens] int64
    mask      [max_tokens * C] bool       each forward's [1, T, length + T] mask, flat
    logits    [max_tokens * V] float32    device outputs; host copies in pinned memory:
    hidden    [max_tokens * H] float32        logits [1, max_tokens, V], hidden [1, max_tokens, H], aux
Addresses are bound once (and again after a profile switch); a forward sets the four small inputs'
shapes, copies them host -> device, enqueues the engine, copies logits / hidden (/ aux) device -> host
and synchronises the stream once: the one host synchronisation per forward.

Profiles: the engine has two (trt/engine.py: prefill, decode/verify); a forward of T tokens runs
on the smallest profile whose token range covers T, switched with set_optimization_profile_async.

Tree commits (`_move_rows`): one advanced-indexing copy over the single [2L, ...] KV tensor,
`kv[:, :, :, dest] = kv[:, :, :, src]` (a gather of the kept rows of every layer into a temporary,
then a scatter): two kernels per commit whatever the layer count, on the engine's stream, so ordered
with the next forward and with no host synchronisation. cudaMemcpy per row would be 2L x kept rows x
Hkv strided copies (head-major rows are Hkv separate D-vectors), each a driver call. torch is
why the buffers are torch tensors: allocation, pinned staging, streams and this gather in one package
the GPU machine has anyway (the plugin's arch probe and the build use it); it is imported lazily.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import ModelIO
from specexport.runtime.backends.base import StepOutput
from specexport.runtime.backends.ort import OrtBackend

ENGINE_FILE = "model.plan"          # trt/engine.py writes it beside the engine graph


def open_trt_backend(model_dir, *, io: ModelIO, capacity: int, max_tokens: int, **options) -> "TrtBackend":
    """A TensorRT Backend for one stage folder of a build (what open_backend calls for kind 'tensorrt').

    options: engine (file name, default model.plan), attention ("native" / "plugin": the manifest's
    engine entry; "plugin" registers the tree-attention plugin first), min_tokens, device ("cuda" or
    "cuda:N"; "cpu" only drives a fake tensorrt in tests). The ONNX Runtime options the pipeline passes
    to every backend (threads, spin, session_options, optimization, graph) are ignored. UNVERIFIED."""
    return TrtBackend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens, **options)


class TrtBackend(OrtBackend):
    """OrtBackend's padding (`min_tokens`, _padded) and input building (_small_inputs) over TensorRT
    buffers; _rows and _move_rows are TensorRT's. UNVERIFIED."""

    def __init__(self, model_dir, *, io: ModelIO, capacity: int, max_tokens: int, engine: str = ENGINE_FILE,
                 attention: str = "native", min_tokens: int = 1, device: str = "cuda", **ignored):
        from specexport._tensorrt import require_tensorrt

        trt = require_tensorrt("backend tensorrt")
        torch = _torch()
        self._init_base(capacity=capacity, max_tokens=max_tokens, vocab_size=io.vocab_size)
        self.io, self.trt, self.torch = io, trt, torch
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SpecexportError(f"backend tensorrt: torch {torch.__version__} sees no CUDA device (a CPU build of "
                                  "torch, or no NVIDIA driver); the engine's buffers live on the GPU")
        path = Path(model_dir) / engine
        if not path.is_file():
            raise SpecexportError(f"{path}: missing (build with backends: [tensorrt] on a machine with TensorRT)")
        if attention == "plugin":
            from specexport.plugins import trt_plugin

            trt_plugin.register()
        self.model_path = path
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise SpecexportError(f"{path}: TensorRT {trt.__version__} could not load it (an engine runs only with "
                                  "the TensorRT version and GPU it was built with: rebuild it here)")
        self._check_engine(io)
        self.context = self.engine.create_execution_context()
        self.min_tokens = max(1, min(int(min_tokens), max_tokens))
        C = self.kv_shape[2]
        if capacity + self.min_tokens - 1 > C:
            raise SpecexportError(f"{path}: the engine's KV caches hold {C} rows; this runtime needs max_seq_len "
                                  f"{capacity} + {self.min_tokens - 1} padding rows (rebuild the engine)")
        self._allocate(io, max_tokens)
        self._causal = np.tril(np.ones((max_tokens, max_tokens), dtype=bool))
        self._arange = np.arange(max_tokens, dtype=np.int64)
        self.last_aux = None
        self._profile = None                       # the context's active profile (bound on first use)
        self._select_profile(self._profiles[0][2])

    # -- setup ------------------------------------------------------------------------------------
    def _init_base(self, **sizes) -> None:
        super(OrtBackend, self).__init__(**sizes)          # Backend's, not the ONNX Runtime session's

    def _check_engine(self, io: ModelIO) -> None:
        """The engine's IO is the tensor table's, its caches are float32 with a static capacity and aliased
        (in place), and its profiles cover 1..max_tokens tokens. UNVERIFIED."""
        trt, engine = self.trt, self.engine
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        expected = set(io.input_names) | set(io.output_names)
        if names != expected:
            raise SpecexportError(f"{self.model_path}: the engine's tensors do not match the manifest's IO table "
                                  f"(missing {sorted(expected - names)}, unexpected {sorted(names - expected)}): "
                                  "rebuild it")
        shape = tuple(engine.get_tensor_shape(io.past_names(0)[0]))
        if len(shape) != 4 or shape[2] < 1:
            raise SpecexportError(f"{self.model_path}: past_key.0 is {shape}; expected [B, Hkv, C, D] with a static "
                                  "capacity C (an engine from the in-place engine graph)")
        self.kv_shape = (1, io.num_kv_heads, int(shape[2]), io.head_dim)
        for i in range(io.num_layers):
            for past, present in zip(io.past_names(i), io.present_names(i)):
                if engine.get_aliased_input_tensor(present) != past:
                    raise SpecexportError(f"{self.model_path}: {present} does not alias {past}: not an in-place "
                                          "engine (build it from the engine graph, trt/graph.py)")
                if engine.get_tensor_dtype(past) != trt.DataType.FLOAT:
                    raise SpecexportError(f"{self.model_path}: {past} is {engine.get_tensor_dtype(past)}; this "
                                          "backend keeps float32 caches")
        ranges = []                                # (max T, min T, profile index), smallest first
        for p in range(engine.num_optimization_profiles):
            lo, _, hi = engine.get_tensor_profile_shape("input_ids", p)
            ranges.append((int(hi[1]), int(lo[1]), p))
        self._profiles = sorted(ranges)
        if not ranges or max(r[0] for r in ranges) < self.max_tokens:
            raise SpecexportError(f"{self.model_path}: the engine's profiles take at most "
                                  f"{max((r[0] for r in ranges), default=0)} tokens a call; this runtime asks up to "
                                  f"{self.max_tokens}")

    def _allocate(self, io: ModelIO, max_tokens: int) -> None:
        """The buffers of the module docstring, on self.device, and the stream the engine runs on. UNVERIFIED
        on a GPU (pinned memory and the CUDA stream are not exercised by the CPU tests)."""
        torch, dev = self.torch, self.device
        pin = dev.type == "cuda"
        L, C, V, H = io.num_layers, self.kv_shape[2], io.vocab_size, io.hidden_size
        aux_width = len(io.aux_hidden_layers) * H
        self.kv = torch.zeros((2 * L, *self.kv_shape), dtype=torch.float32, device=dev)      # [2L, 1, Hkv, C, D]
        self._stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None

        def pair(n: int, dtype):
            """(device buffer [n], pinned host staging [n] as torch, the staging as numpy)."""
            host = torch.empty(n, dtype=dtype, pin_memory=pin)
            return torch.empty(n, dtype=dtype, device=dev), host, host.numpy()

        self._ids, self._ids_h, self._ids_np = pair(max_tokens, torch.int64)
        self._pos, self._pos_h, self._pos_np = pair(max_tokens, torch.int64)
        self._rows_d, self._rows_h, self._rows_np = pair(max_tokens, torch.int64)
        self._mask_d, self._mask_h, self._mask = pair(max_tokens * C, torch.bool)     # _mask: _small_inputs fills it
        self._logits_d, self._logits_h, logits = pair(max_tokens * V, torch.float32)
        self._hidden_d, self._hidden_h, hidden = pair(max_tokens * H, torch.float32)
        self.logits = logits.reshape(1, max_tokens, V)                                # [1, Tmax, V] pinned host
        self.hidden = hidden.reshape(1, max_tokens, H)                                # [1, Tmax, H]
        self.aux = None
        if aux_width:
            self._aux_d, self._aux_h, aux = pair(max_tokens * aux_width, torch.float32)
            self.aux = aux.reshape(1, max_tokens, aux_width)                          # [1, Tmax, k*H]

    def _bind(self) -> None:
        """Every tensor's address (a profile switch invalidates the context's bindings) and the caches'
        static shapes. The caches: one device address for past and present (in place). UNVERIFIED."""
        io, ctx = self.io, self.context
        addresses = {"input_ids": self._ids, "position_ids": self._pos, "attention_mask": self._mask_d,
                     "logits_rows": self._rows_d, "logits": self._logits_d, "hidden_states": self._hidden_d}
        if self.aux is not None:
            addresses["aux_hidden_states"] = self._aux_d
        for i in range(io.num_layers):
            for j, (past, present) in enumerate(zip(io.past_names(i), io.present_names(i))):
                addresses[past] = addresses[present] = self.kv[2 * i + j]
        for name, tensor in addresses.items():
            if not ctx.set_tensor_address(name, tensor.data_ptr()):
                raise SpecexportError(f"backend tensorrt: TensorRT refused the address of {name}")
        for past in io.past_input_names:
            if not ctx.set_input_shape(past, self.kv_shape):
                raise SpecexportError(f"backend tensorrt: the engine refused {past} of shape {self.kv_shape}")

    def _select_profile(self, profile: int) -> None:
        """Make `profile` the context's active one (then bind again). UNVERIFIED."""
        if profile != self._profile:
            self.context.set_optimization_profile_async(profile, self._stream_handle)
            self._profile = profile
            self._bind()

    @property
    def _stream_handle(self) -> int:
        return self._stream.cuda_stream if self._stream is not None else 0

    def _on_stream(self):
        return self.torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    # -- the Backend work -------------------------------------------------------------------------
    def _rows(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        """One engine call on T rows: small inputs host -> device, shapes, enqueue, outputs device -> host,
        one synchronisation. UNVERIFIED."""
        T = len(tokens)
        self._select_profile(next(p for hi, lo, p in self._profiles if lo <= T <= hi))
        tokens, positions, mask, rows = self._small_inputs(tokens, depths, tree_mask, last_only)   # mask: pinned
        R, S = rows.shape[1], mask.shape[2]                                                         # S = length + T
        self._ids_np[:T], self._pos_np[:T], self._rows_np[:R] = tokens[0], positions[0], rows[0]
        ctx, V, H = self.context, self.io.vocab_size, self.io.hidden_size
        with self._on_stream():
            self._ids[:T].copy_(self._ids_h[:T], non_blocking=True)
            self._pos[:T].copy_(self._pos_h[:T], non_blocking=True)
            self._rows_d[:R].copy_(self._rows_h[:R], non_blocking=True)
            self._mask_d[:T * S].copy_(self._mask_h[:T * S], non_blocking=True)
            for name, shape in (("input_ids", (1, T)), ("position_ids", (1, T)), ("attention_mask", (1, T, S)),
                                ("logits_rows", (1, R))):
                if not ctx.set_input_shape(name, shape):
                    raise SpecexportError(f"backend tensorrt: the engine refused {name} of shape {shape} (outside "
                                          f"its profile {self._profile})")
            if not ctx.execute_async_v3(self._stream_handle):
                raise SpecexportError(f"backend tensorrt: TensorRT could not run the engine on {T} tokens "
                                      f"({self.length} committed; its log says why)")
            self._logits_h[:R * V].copy_(self._logits_d[:R * V], non_blocking=True)
            self._hidden_h[:T * H].copy_(self._hidden_d[:T * H], non_blocking=True)
            if self.aux is not None:
                width = self.aux.shape[-1]
                self._aux_h[:T * width].copy_(self._aux_d[:T * width], non_blocking=True)
                self.last_aux = self.aux[0, :T]
        if self._stream is not None:
            self._stream.synchronize()                       # the one host synchronisation of a forward
        return StepOutput(self.logits[0, :R], self.hidden[0, :T], self.last_aux)

    def _move_rows(self, keep: np.ndarray) -> None:
        """KV rows length + keep[k] -> length + k in every cache at once, on the device (module docstring).
        UNVERIFIED on a GPU (tested on CPU tensors against OrtBackend)."""
        torch = self.torch
        with self._on_stream():
            src = torch.as_tensor(self.length + np.asarray(keep, np.int64), device=self.device)
            dest = torch.arange(self.length, self.length + len(keep), device=self.device)
            self.kv[:, :, :, dest] = self.kv[:, :, :, src]     # gather to a temporary, then scatter: overlap-safe

    @property
    def kv_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def close(self) -> None:
        self.context = self.engine = None


def _torch():
    """torch with the buffers' API, or one line saying why the TensorRT backend needs it."""
    try:
        return require("torch")
    except SpecexportError:
        raise SpecexportError("backend tensorrt: keeps its device buffers in torch CUDA tensors, and torch is not "
                              "importable here: install a CUDA build of torch on this GPU machine") from None
