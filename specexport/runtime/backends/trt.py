"""TensorRT backend: an engine built from the in-place engine graph (trt/graph.py), device buffers.

UNVERIFIED: written against TensorRT 11's Python runtime API as NVIDIA/TensorRT 11.1's bindings state it
(python/src/infer/pyCore.cpp: Runtime.deserialize_cuda_engine, ICudaEngine.get_tensor_profile_shape /
get_aliased_input_tensor, IExecutionContext.set_optimization_profile_async / set_input_shape /
set_tensor_address / execute_async_v3). The machines this was written on have no GPU: it has run only
against a fake `tensorrt` module whose engine is the engine graph in ONNX Runtime (tests/test_trt_engine.py).

Buffers (allocated once, never resized; B = 1; C = the engine's KV capacity): buffers.ModelBuffers, with
    k[i], v[i]  views of kv   [2L, 1, Hkv, C, D] float32 on the device, one tensor: layer i's K is kv[2i], its
                              V kv[2i + 1], each bound as both past_key.i and present_key.i: the same device
                              address, as TensorRT's KV-cache-update layer requires (it writes rows
                              length..length+T-1 in place; TensorRT reports an API error otherwise)
    logits, hidden, aux, mask host buffers in pinned memory (the staging of the device copies below)
and the device side of each call, this backend's own:
    ids, pos, rows            [max_tokens] int64 device inputs, filled from pinned host staging each forward
    mask                      [max_tokens * C] bool each forward's [1, T, length + T] mask, flat
    logits, hidden, aux       [max_tokens * V | H | k*H] float32 device outputs, copied to the host buffers
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
from specexport.io_spec import (ATTENTION_MASK, AUX_HIDDEN_STATES, HIDDEN_STATES, INPUT_IDS, LOGITS, LOGITS_ROWS,
                                POSITION_IDS, ModelIO)
from specexport.runtime.backends.base import Backend, StepOutput
from specexport.runtime.backends.buffers import ModelBuffers

ENGINE_FILE = "model.plan"          # trt/engine.py writes it beside the engine graph


def open_trt_backend(model_dir, *, io: ModelIO, capacity: int, max_tokens: int, **options) -> "TrtBackend":
    """A TensorRT Backend for one stage folder of a build (what open_backend calls for kind 'tensorrt').

    options: engine (file name, default model.plan), attention ("native" / "plugin": the manifest's
    engine entry; "plugin" registers the tree-attention plugin first), min_tokens, device ("cuda" or
    "cuda:N"; "cpu" only drives a fake tensorrt in tests). The ONNX Runtime options the pipeline passes
    to every backend (threads, spin, session_options, optimization, graph) are ignored. UNVERIFIED."""
    return TrtBackend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens, **options)


class TrtBackend(Backend):
    """An engine and its buffers (buffers.ModelBuffers: the padding to `min_tokens` and the small inputs
    are theirs); _rows and _move_rows are TensorRT's. UNVERIFIED."""

    def __init__(self, model_dir, *, io: ModelIO, capacity: int, max_tokens: int, engine: str = ENGINE_FILE,
                 attention: str = "native", min_tokens: int = 1, device: str = "cuda", **ignored):
        from specexport._tensorrt import require_tensorrt

        trt = require_tensorrt("backend tensorrt")
        torch = _torch()
        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=io.vocab_size)
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
        C = self._check_engine(io)
        self.context = self.engine.create_execution_context()
        self.min_tokens = max(1, min(int(min_tokens), max_tokens))
        if capacity + self.min_tokens - 1 > C:
            raise SpecexportError(f"{path}: the engine's KV caches hold {C} rows; this runtime needs max_seq_len "
                                  f"{capacity} + {self.min_tokens - 1} padding rows (rebuild the engine)")
        self._allocate(io, rows=C)
        self._profile = None                       # the context's active profile (bound on first use)
        self._select_profile(self._profiles[0][2])

    last_aux = property(lambda self: self.buffers.last_aux)      # [T, k*H] view: the last forward's aux rows
    kv_bytes = property(lambda self: self.buffers.kv_bytes)

    # -- setup ------------------------------------------------------------------------------------
    def _check_engine(self, io: ModelIO) -> int:
        """The engine's IO is the tensor table's, its caches are float32 with a static capacity and aliased
        (in place), and its profiles cover 1..max_tokens tokens; returns the caches' rows. UNVERIFIED."""
        trt, engine = self.trt, self.engine
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        expected = set(io.input_names) | set(io.output_names)
        if names != expected:
            raise SpecexportError(f"{self.model_path}: the engine's tensors do not match the manifest's IO table "
                                  f"(missing {sorted(expected - names)}, unexpected {sorted(names - expected)}): "
                                  "rebuild it")
        first = io.past_names(0)[0]
        shape = tuple(engine.get_tensor_shape(first))
        if len(shape) != 4 or shape[2] < 1:
            raise SpecexportError(f"{self.model_path}: {first} is {shape}; expected [B, Hkv, C, D] with a static "
                                  "capacity C (an engine from the in-place engine graph)")
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
            lo, _, hi = engine.get_tensor_profile_shape(INPUT_IDS, p)
            ranges.append((int(hi[1]), int(lo[1]), p))
        self._profiles = sorted(ranges)
        if not ranges or max(r[0] for r in ranges) < self.max_tokens:
            raise SpecexportError(f"{self.model_path}: the engine's profiles take at most "
                                  f"{max((r[0] for r in ranges), default=0)} tokens a call; this runtime asks up to "
                                  f"{self.max_tokens}")
        return int(shape[2])

    def _allocate(self, io: ModelIO, *, rows: int) -> None:
        """The buffers of the module docstring on self.device (the host ones pinned), and the stream the
        engine runs on. UNVERIFIED on a GPU (pinned memory and the CUDA stream are not exercised by the CPU
        tests)."""
        torch, dev = self.torch, self.device
        pin = dev.type == "cuda"
        self._stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        staging = {}                               # tensor name -> the pinned torch tensor of its host buffer

        def device_caches(shape, layers):
            self.kv = torch.zeros((2 * layers, *shape), dtype=torch.float32, device=dev)     # [2L, 1, Hkv, C, D]
            return list(self.kv[0::2]), list(self.kv[1::2])

        def pinned(name, shape, dtype):
            staging[name] = torch.empty(int(np.prod(shape)), dtype=getattr(torch, np.dtype(dtype).name),
                                        pin_memory=pin)
            return staging[name].numpy().reshape(shape)

        self.buffers = b = ModelBuffers.allocate(io, capacity=self.capacity, max_tokens=self.max_tokens,
                                                 min_tokens=self.min_tokens, rows=rows, caches=device_caches,
                                                 host=pinned)
        self.kv_shape = b.kv_shape

        def pair(n: int, dtype):
            """(device buffer [n], pinned host staging [n] as torch, the staging as numpy)."""
            host = torch.empty(n, dtype=dtype, pin_memory=pin)
            return torch.empty(n, dtype=dtype, device=dev), host, host.numpy()

        def on_device(name):
            """(a device buffer for the tensor `name`, the pinned staging of its host buffer)."""
            host = staging[name]
            return torch.empty(host.numel(), dtype=host.dtype, device=dev), host

        T = self.max_tokens
        self._ids, self._ids_h, self._ids_np = pair(T, torch.int64)
        self._pos, self._pos_h, self._pos_np = pair(T, torch.int64)
        self._rows_d, self._rows_h, self._rows_np = pair(T, torch.int64)
        self._mask_d, self._mask_h = on_device(ATTENTION_MASK)                 # b.mask: ModelBuffers.inputs fills it
        self._logits_d, self._logits_h = on_device(LOGITS)
        self._hidden_d, self._hidden_h = on_device(HIDDEN_STATES)
        if b.aux is not None:
            self._aux_d, self._aux_h = on_device(AUX_HIDDEN_STATES)

    def _bind(self) -> None:
        """Every tensor's address (a profile switch invalidates the context's bindings) and the caches'
        static shapes, for each name of the tensor table. The caches: one device address for past and
        present (in place). UNVERIFIED."""
        io, ctx = self.io, self.context
        addresses = {INPUT_IDS: self._ids, POSITION_IDS: self._pos, ATTENTION_MASK: self._mask_d,
                     LOGITS_ROWS: self._rows_d, LOGITS: self._logits_d, HIDDEN_STATES: self._hidden_d}
        if self.buffers.aux is not None:
            addresses[AUX_HIDDEN_STATES] = self._aux_d
        for i in range(io.num_layers):
            for j, (past, present) in enumerate(zip(io.past_names(i), io.present_names(i))):
                addresses[past] = addresses[present] = self.kv[2 * i + j]
        for name in (*io.input_names, *io.output_names):
            if not ctx.set_tensor_address(name, addresses[name].data_ptr()):
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
    def _forward(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        return self.buffers.run(self._rows, tokens, depths, tree_mask, last_only)

    def _small_inputs(self, tokens, depths, tree_mask, last_only):
        """ModelBuffers.inputs after this backend's committed rows (the mask is a view of pinned staging)."""
        return self.buffers.inputs(tokens, depths, tree_mask, last_only, length=self.length)

    def _rows(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        """One engine call on T rows: small inputs host -> device, shapes, enqueue, outputs device -> host,
        one synchronisation. UNVERIFIED."""
        T = len(tokens)
        self._select_profile(next(p for hi, lo, p in self._profiles if lo <= T <= hi))
        tokens, positions, mask, rows = self._small_inputs(tokens, depths, tree_mask, last_only)
        R, S = rows.shape[1], mask.shape[2]                                                         # S = length + T
        self._ids_np[:T], self._pos_np[:T], self._rows_np[:R] = tokens[0], positions[0], rows[0]
        ctx, V, H, aux = self.context, self.io.vocab_size, self.io.hidden_size, self.buffers.aux
        with self._on_stream():
            self._ids[:T].copy_(self._ids_h[:T], non_blocking=True)
            self._pos[:T].copy_(self._pos_h[:T], non_blocking=True)
            self._rows_d[:R].copy_(self._rows_h[:R], non_blocking=True)
            self._mask_d[:T * S].copy_(self._mask_h[:T * S], non_blocking=True)
            for name, shape in ((INPUT_IDS, (1, T)), (POSITION_IDS, (1, T)), (ATTENTION_MASK, (1, T, S)),
                                (LOGITS_ROWS, (1, R))):
                if not ctx.set_input_shape(name, shape):
                    raise SpecexportError(f"backend tensorrt: the engine refused {name} of shape {shape} (outside "
                                          f"its profile {self._profile})")
            if not ctx.execute_async_v3(self._stream_handle):
                raise SpecexportError(f"backend tensorrt: TensorRT could not run the engine on {T} tokens "
                                      f"({self.length} committed; its log says why)")
            self._logits_h[:R * V].copy_(self._logits_d[:R * V], non_blocking=True)
            self._hidden_h[:T * H].copy_(self._hidden_d[:T * H], non_blocking=True)
            if aux is not None:
                width = aux.shape[-1]
                self._aux_h[:T * width].copy_(self._aux_d[:T * width], non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()                       # the one host synchronisation of a forward
        return self.buffers.output(R, T)

    def _move_rows(self, keep: np.ndarray) -> None:
        """KV rows length + keep[k] -> length + k in every cache at once, on the device (module docstring).
        UNVERIFIED on a GPU (tested on CPU tensors against OrtBackend)."""
        torch = self.torch
        with self._on_stream():
            src = torch.as_tensor(self.length + np.asarray(keep, np.int64), device=self.device)
            dest = torch.arange(self.length, self.length + len(keep), device=self.device)
            self.kv[:, :, :, dest] = self.kv[:, :, :, src]     # gather to a temporary, then scatter: overlap-safe

    def close(self) -> None:
        self.context = self.engine = None


def _torch():
    """torch with the buffers' API, or one line saying why the TensorRT backend needs it."""
    try:
        return require("torch")
    except SpecexportError:
        raise SpecexportError("backend tensorrt: keeps its device buffers in torch CUDA tensors, and torch is not "
                              "importable here: install a CUDA build of torch on this GPU machine") from None
