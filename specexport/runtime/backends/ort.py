"""ONNX Runtime backend (CPU): one session per model, static KV buffers updated in place.

Buffers (allocated once, never resized; B = 1):
    k[i], v[i]   [1, Hkv, capacity, D] float32   per layer; rows [0, length) are the committed cache
    logits       [1, max_tokens, V]    float32   output rows of the last forward (1 row after a prefill)
    hidden       [1, max_tokens, H]    float32
    aux          [1, max_tokens, k*H]  float32   only when the graph exports aux hidden states
    mask         max_tokens x (capacity + max_tokens) bool, flat: each forward's [1, T, length + T] view

Each forward binds the same cache k[i] as `past_key.i` and `present_key.i` (graph contract 3): the
graph writes the new tokens' K/V at rows length..length+T-1 in place and attends over length + T rows,
not the capacity. Committing a chain costs nothing; committing a tree path copies only the accepted rows.
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
                 spin: bool = True, session_options: dict | None = None, min_tokens: int = 1,
                 optimization: str = "all", graph: str = "model.onnx"):
        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=io.vocab_size)
        ort = require("onnxruntime")
        path = Path(model_dir) / graph      # the manifest's cpu_graph where the build made one
        self.session = open_session(path, threads=threads, spin=spin, session_options=session_options,
                                    optimization=optimization)
        self.model_path = path
        self.io = io
        self.binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = _binding_calls(ort, self.session, self.binding)
        self._kv_names = [(*io.past_names(i), *io.present_names(i)) for i in range(io.num_layers)]
        # min_tokens > 1: every call runs at least this many rows (padding after the real ones): the build
        # found the graph's one-row kernels compute differently from its multi-row ones (build.py).
        self.min_tokens = max(1, min(int(min_tokens), max_tokens))
        self.kv_shape = (1, io.num_kv_heads, capacity + self.min_tokens - 1, io.head_dim)   # room for the padding
        self.k = [np.zeros(self.kv_shape, np.float32) for _ in range(io.num_layers)]     # [1, Hkv, C, D]
        self.v = [np.zeros(self.kv_shape, np.float32) for _ in range(io.num_layers)]     # [1, Hkv, C, D]
        self.logits = np.zeros((1, max_tokens, io.vocab_size), np.float32)           # [1, Tmax, V]
        self.hidden = np.zeros((1, max_tokens, io.hidden_size), np.float32)          # [1, Tmax, H]
        aux_width = len(io.aux_hidden_layers) * io.hidden_size
        self.aux = np.zeros((1, max_tokens, aux_width), np.float32) if aux_width else None
        self._mask = np.ones(max_tokens * (self.kv_shape[2] + max_tokens), dtype=bool)
        # the buffers never move: their addresses are taken once (arr.ctypes builds an object per use)
        self._kv_ptrs = [(k.ctypes.data, v.ctypes.data) for k, v in zip(self.k, self.v)]
        self._out_ptrs = (self.logits.ctypes.data, self.hidden.ctypes.data,
                          None if self.aux is None else self.aux.ctypes.data)
        self._causal = np.tril(np.ones((max_tokens, max_tokens), dtype=bool))
        self._arange = np.arange(max_tokens, dtype=np.int64)
        self.last_aux: np.ndarray | None = None                                     # [T, k*H] view

    def _forward(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        T = len(tokens)
        if T < self.min_tokens:
            return self._padded(tokens, depths, tree_mask, last_only)
        return self._rows(tokens, depths, tree_mask, last_only)

    def _padded(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        """T real rows + copies of the last token after them. The real rows cannot see the padding (it
        comes later, and the mask below keeps it so for trees); its K/V lands in scratch rows that no
        commit keeps."""
        T, pad = len(tokens), self.min_tokens - len(tokens)
        tokens = np.concatenate([tokens, np.full(pad, tokens[-1], dtype=np.int64)])
        if depths is not None:
            depths = np.concatenate([np.asarray(depths, np.int64), depths[-1] + 1 + np.arange(pad)])
        if tree_mask is not None:
            mask = np.eye(T + pad, dtype=bool)
            mask[:T, :T] = tree_mask
            tree_mask = mask
        out = self._rows(tokens, depths, tree_mask, last_only=False)
        if self.last_aux is not None:
            self.last_aux = self.last_aux[:T]
        return StepOutput(out.logits[T - 1:T] if last_only else out.logits[:T], out.hidden[:T], self.last_aux)

    def _rows(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        T = len(tokens)
        bind_in, bind_out = self._bind_in, self._bind_out
        # numpy inputs are bound by address: each must be a live, contiguous local until _run
        tokens, positions, mask, rows = self._small_inputs(tokens, depths, tree_mask, last_only)
        bind_in("input_ids", tokens)
        bind_in("position_ids", positions)
        bind_in("attention_mask", mask)
        bind_in("logits_rows", rows)
        R = rows.shape[1]
        shape = self.kv_shape
        for (kp, vp), (pk, pv, nk, nv) in zip(self._kv_ptrs, self._kv_names):
            bind_in(pk, shape, kp)
            bind_in(pv, shape, vp)
            bind_out(nk, shape, kp)                     # the same memory: updated in place
            bind_out(nv, shape, vp)
        logits_ptr, hidden_ptr, aux_ptr = self._out_ptrs
        bind_out("logits", (1, R, self.io.vocab_size), logits_ptr)
        bind_out("hidden_states", (1, T, self.io.hidden_size), hidden_ptr)
        if self.aux is not None:
            bind_out("aux_hidden_states", (1, T, self.aux.shape[-1]), aux_ptr)
            self.last_aux = self.aux[0, :T]
        self._run()
        return StepOutput(self.logits[0, :R], self.hidden[0, :T], self.last_aux)

    def _small_inputs(self, tokens, depths, tree_mask, last_only):
        """(input_ids, position_ids, attention_mask, logits_rows) of one call, each [1, ...] and contiguous;
        the mask is a view of the flat buffer."""
        T, P = len(tokens), self.length
        positions = P + (self._arange[:T] if depths is None else np.asarray(depths, dtype=np.int64))
        mask = self._mask[:T * (P + T)].reshape(1, T, P + T)
        mask[0, :, :P] = True
        mask[0, :, P:] = self._causal[:T, :T] if tree_mask is None else tree_mask
        R = 1 if last_only else T                       # prefill: the next token's logits only
        return (np.ascontiguousarray(tokens).reshape(1, T), positions.reshape(1, T), mask,
                self._arange[T - R:T].reshape(1, R))

    def _move_rows(self, keep: np.ndarray) -> None:
        dest = self.length + np.arange(len(keep))
        src = self.length + keep
        for buf in (*self.k, *self.v):
            buf[0, :, dest] = buf[0, :, src]    # fancy indexing copies the source rows first

    @property
    def kv_bytes(self) -> int:
        return sum(b.nbytes for b in (*self.k, *self.v))


# the manifest's ort_optimization -> ORT's level (Q/DQ graphs: basic, so they compute what they say;
# quant/ptq.py)
OPTIMIZATION_LEVELS = {"all": "ORT_ENABLE_ALL", "basic": "ORT_ENABLE_BASIC"}


def open_session(path: Path, *, threads: int | None, spin: bool, session_options: dict | None = None,
                 optimization: str = "all"):
    """An ORT CPU session of a built graph, with one-line errors naming the file."""
    ort = require("onnxruntime")
    if not path.is_file():
        raise SpecexportError(f"{path}: missing (the build output is incomplete; rebuild it)")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    if not spin:
        # Idle intra-op threads otherwise spin after each run; with a draft and a target session
        # alternating on few cores, one session's spinning pool steals the other's cores.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in (session_options or {}).items():
        setattr(opts, key, value)
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as err:        # onnxruntime raises its own Fail/InvalidProtobuf/... types
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise SpecexportError(f"{path}: ONNX Runtime could not load it ({first.strip()[:300]}); the build "
                              f"may be damaged: `specexport inspect {path.parent.parent.parent} --verify`") from None


def _binding_calls(ort, session, binding):
    """(bind_input, bind_output, run) for CPU buffers (float32 unless bind_output is given a dtype) and
    numpy inputs.

    Why not only the public IOBinding methods: each public bind_input/bind_output builds a new
    OrtDevice and checks pinning, and a forward makes 4 x layers + 5 of these calls. On the small
    graphs this runtime targets (a draft step is ~0.2 ms) that wrapper work was ~8 % of decode time.
    The C-level binding object that the public methods delegate to is used when this onnxruntime
    has it; otherwise the public methods are used, with the same effect.
    """
    c_binding, c_session = getattr(binding, "_iobinding", None), getattr(session, "_sess", None)
    make = getattr(getattr(ort, "OrtDevice", None), "make", None)
    if c_binding is not None and c_session is not None and make is not None:
        cpu = make("cpu", 0)._get_c_device()
        f32 = np.float32

        def bind_in(name, arr_or_shape, ptr=None):
            if ptr is None:
                c_binding.bind_input(name, arr_or_shape)
            else:
                c_binding.bind_input(name, cpu, f32, arr_or_shape, ptr)

        def bind_out(name, shape, ptr, dtype=f32):
            c_binding.bind_output(name, cpu, dtype, shape, ptr)

        return bind_in, bind_out, lambda: c_session.run_with_iobinding(c_binding, None)

    def bind_in(name, arr_or_shape, ptr=None):
        if ptr is None:
            binding.bind_cpu_input(name, arr_or_shape)
        else:
            binding.bind_input(name, "cpu", 0, np.float32, arr_or_shape, ptr)

    def bind_out(name, shape, ptr, dtype=np.float32):
        binding.bind_output(name, "cpu", 0, dtype, shape, ptr)

    return bind_in, bind_out, lambda: session.run_with_iobinding(binding)
