"""ONNX Runtime backend (CPU): one session per model, and its buffers (buffers.ModelBuffers: static KV
caches updated in place, host logits / hidden / aux, the flat mask), allocated once in host memory.

Each forward binds the same cache k[i] as `past_key.i` and `present_key.i` (graph contract 3): the
graph writes the new tokens' K/V at rows length..length+T-1 in place and attends over length + T rows,
not the capacity. Committing a chain costs nothing; committing a tree path copies only the accepted rows.
The calls bind through onnxruntime's C-level IOBinding where it has one (_binding_calls).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import (ATTENTION_MASK, AUX_HIDDEN_STATES, HIDDEN_STATES, INPUT_IDS, LOGITS, LOGITS_ROWS,
                                POSITION_IDS, ModelIO)
from specexport.plugins import cpu
from specexport.runtime.backends.base import Backend, StepOutput
from specexport.runtime.backends.buffers import ModelBuffers


class OrtBackend(Backend):
    def __init__(self, model_dir, *, io: ModelIO, capacity: int, max_tokens: int, threads: int | None = None,
                 spin: bool = True, stop_spin: bool = False, session_options: dict | None = None,
                 min_tokens: int = 1, optimization: str = "all", graph: str = "model.onnx"):
        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=io.vocab_size)
        ort = require("onnxruntime")
        path = Path(model_dir) / graph      # the manifest's cpu_graph where the build made one
        self.session = open_session(path, threads=threads, spin=spin, stop_spin=stop_spin,
                                    session_options=session_options, optimization=optimization)
        self.model_path, self.io = path, io
        self.binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = binding_calls(ort, self.session, self.binding)
        self.buffers = b = ModelBuffers.allocate(io, capacity=capacity, max_tokens=max_tokens, min_tokens=min_tokens)
        self.k, self.v, self.min_tokens, self.kv_shape = b.k, b.v, b.min_tokens, b.kv_shape
        # the buffers never move: their addresses are taken once (arr.ctypes builds an object per use)
        self._kv_binds = [(*io.past_names(i), *io.present_names(i), k.ctypes.data, v.ctypes.data)
                          for i, (k, v) in enumerate(zip(b.k, b.v))]
        self._out_ptrs = (b.logits.ctypes.data, b.hidden.ctypes.data, None if b.aux is None else b.aux.ctypes.data)

    last_aux = property(lambda self: self.buffers.last_aux)      # [T, k*H] view: the last forward's aux rows
    kv_bytes = property(lambda self: self.buffers.kv_bytes)

    def _forward(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        return self.buffers.run(self._rows, tokens, depths, tree_mask, last_only)

    def _rows(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        T, b = len(tokens), self.buffers
        bind_in, bind_out = self._bind_in, self._bind_out
        # numpy inputs are bound by address: each must be a live, contiguous local until _run
        tokens, positions, mask, rows = b.inputs(tokens, depths, tree_mask, last_only, length=self.length)
        bind_in(INPUT_IDS, tokens)
        bind_in(POSITION_IDS, positions)
        bind_in(ATTENTION_MASK, mask)
        bind_in(LOGITS_ROWS, rows)
        R = rows.shape[1]
        shape = b.kv_shape
        for pk, pv, nk, nv, kp, vp in self._kv_binds:
            bind_in(pk, shape, kp)
            bind_in(pv, shape, vp)
            bind_out(nk, shape, kp)                     # the same memory: updated in place
            bind_out(nv, shape, vp)
        logits_ptr, hidden_ptr, aux_ptr = self._out_ptrs
        bind_out(LOGITS, (1, R, self.io.vocab_size), logits_ptr)
        bind_out(HIDDEN_STATES, (1, T, self.io.hidden_size), hidden_ptr)
        if aux_ptr is not None:
            bind_out(AUX_HIDDEN_STATES, (1, T, b.aux.shape[-1]), aux_ptr)
        self._run()
        return b.output(R, T)

    def _move_rows(self, keep: np.ndarray) -> None:
        dest = self.length + np.arange(len(keep))
        src = self.length + keep
        for buf in (*self.buffers.k, *self.buffers.v):
            buf[0, :, dest] = buf[0, :, src]    # fancy indexing copies the source rows first


# the manifest's ort_optimization -> ORT's level (Q/DQ graphs: basic, so they compute what they say;
# quant/ptq.py)
OPTIMIZATION_LEVELS = {"all": "ORT_ENABLE_ALL", "basic": "ORT_ENABLE_BASIC"}


THREADS_ENV = "SPECEXPORT_THREADS"


def default_threads() -> int | None:
    """$SPECEXPORT_THREADS: the intra-op threads of every ONNX Runtime CPU session specexport opens without a
    thread count of its own (processes that share the cores, a test suite's workers or a server's, each take
    a share: ORT's default takes every core, and on a busy core a pool's slowest thread sets each op's pace).
    None when unset: ONNX Runtime's default, all cores."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SpecexportError(f"${THREADS_ENV}: expected a whole number of threads >= 1, got {value!r}")
    return int(value)


def default_pool() -> str:
    """What a session opened without a thread count gets, in words."""
    threads = default_threads()
    return f"{threads} (${THREADS_ENV})" if threads else "ONNX Runtime's default (all cores)"


def base_options():
    """onnxruntime.SessionOptions with default_threads()' intra-op threads where it names some."""
    opts = require("onnxruntime").SessionOptions()
    threads = default_threads()
    if threads:
        opts.intra_op_num_threads = threads
    return opts


def open_session(path: Path, *, threads: int | None, spin: bool, stop_spin: bool = False,
                 session_options: dict | None = None, optimization: str = "all", model=None):
    """An ORT CPU session of a built graph, with one-line errors naming the file. stop_spin: the pool's
    threads spin within a run but stop at its end (sessions that take turns: a target and its draft).
    model: the graph at `path` as rewritten in memory (an onnx ModelProto whose weights stay in the data
    file beside `path`), run instead of the file's."""
    ort = require("onnxruntime")
    if not path.is_file():
        raise SpecexportError(f"{path}: missing (the build output is incomplete; rebuild it)")
    opts = base_options()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    if not spin:
        # Idle intra-op threads otherwise spin after each run; with a draft and a target session
        # alternating on few cores, one session's spinning pool steals the other's cores.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif stop_spin:
        # Spinning pays within a run (hundreds of parallel ops back to back); after it, a pool that spins
        # on takes the cores from the next session's run (Qwen 1.5B + 0.5B draft on 2 cores, both on 2
        # threads: draft γ 2 10.1-11.3 tok/s spinning on, 14.9-16.0 stopped at each run's end).
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    for key, value in (session_options or {}).items():
        setattr(opts, key, value)
    if model is None:
        cpu.register(opts, path)
    else:                               # external weights are read from the file's folder
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        if any(o.domain == cpu.DOMAIN for o in model.opset_import):
            opts.register_custom_ops_library(str(cpu.status().library))
    try:
        session = ort.InferenceSession(model.SerializeToString() if model is not None else str(path), opts,
                                       providers=["CPUExecutionProvider"])
    except Exception as err:        # onnxruntime raises its own Fail/InvalidProtobuf/... types
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise SpecexportError(f"{path}: ONNX Runtime could not load it ({first.strip()[:300]}); the build "
                              f"may be damaged: `specexport inspect {path.parent.parent.parent} --verify`") from None
    release_freed_heap()
    return session


def release_freed_heap() -> None:
    """Give the heap memory freed so far back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Why our own call: loading a graph, ONNX Runtime folds its constants and prepacks its weights, and
    frees gigabytes of temporaries that glibc keeps mapped to the process (below its mmap threshold,
    they go back to the heap, not the OS). ORT has no option for it. Measured, Qwen2.5-Coder-1.5B's gguf
    graph in one session: 4.4 GiB resident after loading, 2.0 GiB after this call."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None. By its soname: ctypes.util.find_library would run a subprocess
    (ldconfig), a fork of a process that may hold gigabytes."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):           # not glibc (musl, macOS): nothing to trim this way
        return None


def binding_calls(ort, session, binding):
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
