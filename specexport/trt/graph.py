"""The graph TensorRT engines are built from: KV caches updated in place, attention over the cache.

`engine_graph` rewrites each attention node of an exported graph (ONNX Runtime's contrib
GroupQueryAttention, export/gqa.py, which TensorRT's parser does not import) into TensorRT 11's ONNX
custom ops, keeping the graph contract of io_spec.py (the same inputs and outputs, names and order):

    shared by every layer (once per graph):
      P = width(attention_mask) - T                 the committed rows; write_index = int32 [B] of P
      (native) mask = Concat(attention_mask [B, T, P+T], False [B, T, C-P-T]) -> [B, 1, T, C]
      (plugin) mask = attention_mask [1, T, P+T] -> [T, P+T]
    per layer:
      q [B, T, Hq*D], k / v [B, T, Hkv*D]  (rotary already applied, as GroupQueryAttention receives them)
      k, v -> [B, Hkv, T, D]
      present_k = TRT_KVCacheUpdate(past_k [B, Hkv, C, D], k, write_index)       rows P..P+T-1 written
      present_v = TRT_KVCacheUpdate(past_v, v, write_index)                      (the same buffer in the engine)
      (native) out = TRT_Attention(q [B, Hq, T, D] * scale, present_k, present_v, mask [B, 1, T, C])
      (plugin) out = tree_attention(q [T, Hq, D], present_k rows 0..P+T-1 as [P+T, Hkv, D], same for v,
                                    mask [T, P+T])                             (plugins/trt_plugin.py)
      out -> [B, T, Hq*D]

The caches have a fixed capacity C (`kv_capacity`, written into the graph's input and output shapes):
TensorRT's KV-cache-update layer wants a network input with a static sequence dimension as the cache
and a network output sharing its memory as the result (the runtime binds one device buffer to both,
runtime/backends/trt.py). The two attention options:
  native  TRT_Attention (TensorRT's IAttention) over the whole cache under a [T, C] mask: the committed
          rows, then the tree's ancestor mask, then C - P - T masked rows. An explicit mask over the
          fixed-size cache is what NVIDIA's TensorRT-Model-Connect uses (its key_value_lengths gave wrong
          tokens on 11.1/11.2); it computes over C rows whatever the context, and custom masks may not
          fuse (TRT_decomposable = 1 lets TensorRT fall back to several kernels).
  plugin  the tree-attention plugin (Triton, AOT) over the P + T valid rows only. Its kernel reads
          sequence-major [S, Hkv, D], the cache is head-major: the Slice + Transpose before it copies the
          P + T valid rows of each layer per call (what the plain-run Concat form copied too).

Custom-op spelling (onnx-tensorrt docs/TRT_custom_ops.md): TRT_KVCacheUpdate(past_cache, update,
write_indices int32 [B]) with update_form "padded_bhnd", mode "linear", axis -2; TRT_Attention(Q, K, V,
attn_mask) with query_form / kv_form "padded_bhnd", causal_kind "none" (a mask excludes a causal kind)
and no scaling of its own (Q is scaled here). The parser looks an importer up by op_type; the nodes
carry the domain "trt" (as NVIDIA ModelOpt's TRT_* schemas do), declared in the opset imports.

Neither op runs in ONNX Runtime: `cpu_session` runs an engine graph on CPU with the ops computed by the
numpy references below (onnxruntime-extensions Python ops), and `engine_graph_logits` drives it through
the parity gate's phases (validate.py) with fixed-capacity caches fed back, so the rewrite is checked
end to end against PyTorch on any machine. What it cannot check: TensorRT itself (UNVERIFIED).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.trt.rewrite import attention_fields, drop_unused_initializers, install, replace_nodes
from specexport.io_spec import (
    ATTENTION_MASK,
    INPUT_IDS,
    PAST_KEY,
    PAST_VALUE,
    PRESENT_KEY,
    PRESENT_VALUE,
)

ENGINE_GRAPH = "engine.onnx"                      # the file name beside the precision's model.onnx
ATTENTION_OPTIONS = ("native", "plugin")
TRT_DOMAIN = "trt"
KV_UPDATE_OP, ATTENTION_OP = "TRT_KVCacheUpdate", "TRT_Attention"
SOURCE_OP = "GroupQueryAttention"
PYOP_DOMAIN = "ai.onnx.contrib"                   # onnxruntime-extensions' fixed domain for Python ops

KV_UPDATE_ATTRS = {"update_form": "padded_bhnd", "mode": "linear", "axis": -2}
ATTENTION_ATTRS = {"query_form": "padded_bhnd", "kv_form": "padded_bhnd", "causal_kind": "none",
                   "TRT_decomposable": 1}


# -- the rewrite ---------------------------------------------------------------------------------

def engine_graph(model, *, head_dim: int, kv_capacity: int, attention: str = "native"):
    """Rewrite every GroupQueryAttention node of `model` (an onnx ModelProto, changed in place and
    returned) into the in-place form above, with caches of kv_capacity rows.

    Example: the tiny llama (2 layers, 4/2 heads, D 16) at kv_capacity 128 gets 4 TRT_KVCacheUpdate
    nodes, 2 TRT_Attention nodes, and past_key.0 typed [batch, 2, 128, 16]. Checked on CPU (cpu_session);
    UNVERIFIED: that TensorRT's parser imports it and builds it (no TensorRT where this was written)."""
    onnx = require("onnx")
    if attention not in ATTENTION_OPTIONS:
        raise SpecexportError(f"attention: expected one of {', '.join(ATTENTION_OPTIONS)}, got {attention!r}")
    if not isinstance(kv_capacity, int) or kv_capacity < 1:
        raise SpecexportError(f"kv_capacity: expected a positive integer, got {kv_capacity!r}")
    graph = model.graph
    for name in (INPUT_IDS, ATTENTION_MASK):
        if name not in {i.name for i in graph.input}:
            raise SpecexportError(f"engine graph: the graph has no input {name!r}")
    w = _Writer(graph)
    shared = _shared_nodes(w, attention, kv_capacity)
    nodes, count = replace_nodes(graph, SOURCE_OP, lambda old, index: _attention_nodes(
        w, old, index, head_dim=head_dim, attention=attention), before=shared)
    if not count:
        raise SpecexportError(f"engine graph: the graph has no {SOURCE_OP} node to replace")
    install(graph, nodes)
    _fix_capacity(graph, kv_capacity)
    model.opset_import.append(onnx.helper.make_opsetid(TRT_DOMAIN, 1))
    if attention == "plugin":
        from specexport.plugins.trt_plugin import NAMESPACE

        model.opset_import.append(onnx.helper.make_opsetid(NAMESPACE, 1))
    return model


_E = "/engine"                  # the prefix of the nodes and constants every layer shares


class _Writer:
    """Makes one graph's nodes, and its integer constants once each."""

    def __init__(self, graph):
        self.onnx = require("onnx")
        self.graph, self.consts = graph, set()

    def const(self, name: str, values, dtype=np.int64) -> str:
        if name not in self.consts:
            self.graph.initializer.append(self.onnx.numpy_helper.from_array(np.asarray(values, dtype), name))
            self.consts.add(name)
        return name

    def node(self, op, inputs, outputs, name, domain="", **attrs):
        return self.onnx.helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs)


def _shared_nodes(w: _Writer, attention: str, kv_capacity: int) -> list:
    """The write position P (from the mask's width: P + T) and the mask, once per graph: `{_E}/write_index`
    [B] int32 and `{_E}/mask` ([B, 1, T, C] bool for the native attention, [T, P + T] for the plugin)."""
    node, e, tensor = w.node, _E, w.onnx.TensorProto
    nodes = [
        node("Shape", [ATTENTION_MASK], [f"{e}/total"], f"{e}/total", start=2, end=3),         # [1] P + T
        node("Shape", [INPUT_IDS], [f"{e}/tokens"], f"{e}/tokens", start=1, end=2),            # [1] T
        node("Shape", [INPUT_IDS], [f"{e}/batch"], f"{e}/batch", start=0, end=1),              # [1] B
        node("Sub", [f"{e}/total", f"{e}/tokens"], [f"{e}/past_length"], f"{e}/past_length"),  # [1] P
        node("Expand", [f"{e}/past_length", f"{e}/batch"], [f"{e}/write_index64"], f"{e}/write_index64"),
        node("Cast", [f"{e}/write_index64"], [f"{e}/write_index"], f"{e}/write_index", to=tensor.INT32),   # [B]
    ]
    if attention != "native":
        return nodes + [node("Squeeze", [ATTENTION_MASK, w.const(f"{e}/axis0", [0])], [f"{e}/mask"], f"{e}/mask")]
    return nodes + [
        node("Sub", [w.const(f"{e}/capacity", [kv_capacity]), f"{e}/total"], [f"{e}/pad_rows"], f"{e}/pad_rows"),
        node("Shape", [ATTENTION_MASK], [f"{e}/batch_tokens"], f"{e}/batch_tokens", start=0, end=2),
        node("Concat", [f"{e}/batch_tokens", f"{e}/pad_rows"], [f"{e}/pad_shape"], f"{e}/pad_shape", axis=0),
        node("ConstantOfShape", [f"{e}/pad_shape"], [f"{e}/mask_pad"], f"{e}/mask_pad",
             value=w.onnx.helper.make_tensor("false", tensor.BOOL, [1], [False])),          # [B, T, C-P-T]
        node("Concat", [ATTENTION_MASK, f"{e}/mask_pad"], [f"{e}/mask_rows"], f"{e}/mask_rows", axis=2),
        node("Unsqueeze", [f"{e}/mask_rows", w.const(f"{e}/axis1", [1])], [f"{e}/mask"], f"{e}/mask"),  # [B,1,T,C]
    ]


def _attention_nodes(w: _Writer, old, index: int, *, head_dim: int, attention: str) -> list:
    """The nodes replacing attention node `index` (`old`): K and V written in place, then the attention."""
    hq, hkv, scale, (q, k, v, past_k, past_v), (out, present_k, present_v) = attention_fields(old, head_dim)
    node, e, p = w.node, _E, f"/engine/layers.{index}/attn"
    kv_heads = w.const(f"{e}/kv_heads_shape{hkv}", [0, -1, hkv, head_dim])
    nodes = [
        *_to_heads(node, k, kv_heads, p=f"{p}/k"),                               # [B, Hkv, T, D]
        *_to_heads(node, v, kv_heads, p=f"{p}/v"),
        node(KV_UPDATE_OP, [past_k, f"{p}/k_heads", f"{e}/write_index"], [present_k], f"{p}/{KV_UPDATE_OP}_k",
             domain=TRT_DOMAIN, **KV_UPDATE_ATTRS),
        node(KV_UPDATE_OP, [past_v, f"{p}/v_heads", f"{e}/write_index"], [present_v], f"{p}/{KV_UPDATE_OP}_v",
             domain=TRT_DOMAIN, **KV_UPDATE_ATTRS),
    ]
    if attention == "native":
        return nodes + [
            *_to_heads(node, q, w.const(f"{e}/q_heads_shape{hq}", [0, -1, hq, head_dim]), p=f"{p}/q"),
            node("CastLike", [w.const(f"{e}/scale{index + 1}", scale, np.float32), f"{p}/q_heads"], [f"{p}/scale"],
                 f"{p}/scale"),
            node("Mul", [f"{p}/q_heads", f"{p}/scale"], [f"{p}/q_scaled"], f"{p}/q_scaled"),
            node(ATTENTION_OP, [f"{p}/q_scaled", present_k, present_v, f"{e}/mask"], [f"{p}/out_heads"],
                 f"{p}/{ATTENTION_OP}", domain=TRT_DOMAIN, **ATTENTION_ATTRS),      # [B, Hq, T, D]
            node("Transpose", [f"{p}/out_heads"], [f"{p}/out_tokens"], f"{p}/out_tokens", perm=[0, 2, 1, 3]),
            node("Reshape", [f"{p}/out_tokens", w.const(f"{e}/out_shape{hq}", [0, 0, hq * head_dim])], [out],
                 f"{p}/out"),
        ]
    from specexport.plugins.trt_plugin import NAMESPACE, plugin_node

    return nodes + [
        node("Reshape", [q, w.const(f"{e}/q_rows_shape{hq}", [-1, hq, head_dim])], [f"{p}/q_rows"],
             f"{p}/q_rows"),                                                     # [T, Hq, D]
        *_valid_rows(node, present_k, f"{p}/k", zero=w.const(f"{e}/zero", [0]), axis2=w.const(f"{e}/axis2", [2]),
                     axis0=w.const(f"{e}/axis0", [0])),                                # [P+T, Hkv, D]
        *_valid_rows(node, present_v, f"{p}/v", zero=f"{e}/zero", axis2=f"{e}/axis2", axis0=f"{e}/axis0"),
        plugin_node([f"{p}/q_rows", f"{p}/k_rows", f"{p}/v_rows", f"{e}/mask"], [f"{p}/out_rows"], num_kv_heads=hkv,
                    scale=scale, name=f"{p}/tree_attention", domain=NAMESPACE),
        node("Reshape", [f"{p}/out_rows", w.const(f"{e}/out_shape{hq}", [1, -1, hq * head_dim])], [out],
             f"{p}/out"),
    ]


def _to_heads(node, x: str, shape: str, *, p: str) -> list:
    """[B, T, H*D] -> [B, H, T, D] (padded_bhnd)."""
    return [node("Reshape", [x, shape], [f"{p}_tokens"], f"{p}_tokens"),
            node("Transpose", [f"{p}_tokens"], [f"{p}_heads"], f"{p}_heads", perm=[0, 2, 1, 3])]


def _valid_rows(node, cache: str, p: str, *, zero: str, axis2: str, axis0: str) -> list:
    """The plugin's operand: rows 0..P+T-1 of the updated cache [1, Hkv, C, D] as [P+T, Hkv, D]."""
    return [node("Slice", [cache, zero, "/engine/total", axis2], [f"{p}_valid"], f"{p}_valid"),
            node("Squeeze", [f"{p}_valid", axis0], [f"{p}_squeezed"], f"{p}_squeezed"),
            node("Transpose", [f"{p}_squeezed"], [f"{p}_rows"], f"{p}_rows", perm=[1, 0, 2])]


CACHE_PREFIXES = tuple(f"{n}." for n in (PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE))   # past_key.{i}, ...


def _fix_capacity(graph, kv_capacity: int) -> None:
    """Write the caches' capacity into the graph's past_* inputs and present_* outputs (dimension 2)."""
    for value in (*graph.input, *graph.output):
        if value.name.startswith(CACHE_PREFIXES):
            dim = value.type.tensor_type.shape.dim[2]
            dim.Clear()
            dim.dim_value = kv_capacity


def write_engine_graph(source: Path, dest: Path, *, head_dim: int, kv_capacity: int, attention: str = "native") -> Path:
    """The engine form of the graph at `source`, written to `dest` in the same folder. The weights are
    not copied: the new graph refers to `source`'s external-data file, whose tensors it keeps as they are."""
    onnx = require("onnx")
    if Path(source).parent != Path(dest).parent:
        raise SpecexportError("write_engine_graph: dest must be beside source (it shares its weights file)")
    model = engine_graph(onnx.load(str(source), load_external_data=False), head_dim=head_dim,
                         kv_capacity=kv_capacity, attention=attention)
    drop_unused_initializers(model)
    partial = Path(dest).with_name(Path(dest).name + ".partial")
    onnx.save(model, str(partial))
    partial.replace(dest)
    return Path(dest)


# -- CPU reference implementations of the two custom ops -------------------------------------------

def kv_cache_update_reference(cache: np.ndarray, update: np.ndarray, write_indices: np.ndarray) -> np.ndarray:
    """TRT_KVCacheUpdate (mode linear, padded_bhnd): a copy of cache [B, H, C, D] with update [B, H, S, D]
    written at rows write_indices[b] .. write_indices[b] + S - 1 of each sequence b.

    Example: cache zeros [1, 1, 4, 1], update [[[[7], [8]]]], write_indices [1] -> rows [0, 7, 8, 0]."""
    cache, update = np.asarray(cache), np.asarray(update)
    out = cache.copy()
    s = update.shape[2]
    for b, start in enumerate(np.asarray(write_indices).reshape(-1)):
        if not 0 <= start <= cache.shape[2] - s:
            raise SpecexportError(f"{KV_UPDATE_OP}: rows {start}..{start + s - 1} outside the cache's "
                                  f"{cache.shape[2]} rows")
        out[b, :, start:start + s] = update[b]
    return out


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray) -> np.ndarray:
    """TRT_Attention (padded_bhnd, softmax, no scaling: q comes scaled): q [B, Hq, T, D], k / v
    [B, Hkv, S, D] (query head h reads kv head h // (Hq / Hkv)), mask broadcastable to [B, Hq, T, S]:
    bool True = attend, else added to the scores. float64 inside; returns q's dtype; a row with nothing
    to attend to gives zeros."""
    q, k, v, mask = (np.asarray(a) for a in (q, k, v, mask))
    g = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), g, axis=1)                             # [B, Hq, S, D]
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    scores = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), kk)             # [B, Hq, T, S]
    scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    return np.einsum("bhts,bhsd->bhtd", weights, vv).astype(q.dtype)


# -- running an engine graph on CPU ---------------------------------------------------------------

def cpu_session(graph, optimization: str = "all"):
    """An ONNX Runtime CPU session of an engine graph (a path, or a ModelProto with its weights loaded),
    TRT_KVCacheUpdate / TRT_Attention / tree_attention computed by the numpy references. A plain run
    returns each updated cache as a new array (Python ops cannot write in place): feed it back as the
    next call's past (engine_graph_logits)."""
    from specexport.runtime.backends.ort import OPTIMIZATION_LEVELS, base_options

    onnx = require("onnx")
    ort = require("onnxruntime")
    ext = require("onnxruntime_extensions")
    _register_reference_ops(ext)
    from specexport.plugins.trt_plugin import NAME as PLUGIN_OP

    model = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph))
    for n in model.graph.node:
        if n.op_type in (KV_UPDATE_OP, ATTENTION_OP, PLUGIN_OP):
            n.domain = PYOP_DOMAIN
    model.opset_import.append(onnx.helper.make_opsetid(PYOP_DOMAIN, 1))
    opts = base_options()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
    opts.log_severity_level = 3                 # not one warning per initializer the rewrite left unused
    opts.register_custom_ops_library(ext.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


_REGISTERED: list = []


def _register_reference_ops(ext) -> None:
    """The custom ops as onnxruntime-extensions Python ops (once per process; the tree-attention plugin's
    comes from trt/plugin_graph.py)."""
    if _REGISTERED:
        return
    from specexport.trt.plugin_graph import register_reference_op

    register_reference_op(ext)
    d = ext.PyCustomOpDef

    @ext.onnx_op(op_type=KV_UPDATE_OP, inputs=[d.dt_float, d.dt_float, d.dt_int32], outputs=[d.dt_float],
                 attrs={"update_form": d.dt_string, "mode": d.dt_string, "axis": d.dt_int64})
    def trt_kv_cache_update(cache, update, write_indices, update_form="padded_bhnd", mode="linear", axis=-2):
        return kv_cache_update_reference(cache, update, write_indices).astype(np.float32)

    @ext.onnx_op(op_type=ATTENTION_OP, inputs=[d.dt_float, d.dt_float, d.dt_float, d.dt_bool], outputs=[d.dt_float],
                 attrs={"query_form": d.dt_string, "kv_form": d.dt_string, "causal_kind": d.dt_string,
                        "TRT_decomposable": d.dt_int64})
    def trt_attention(q, k, v, mask, query_form="padded_bhnd", kv_form="padded_bhnd", causal_kind="none",
                      TRT_decomposable=1):
        return attention_reference(q, k, v, mask=mask).astype(np.float32)

    _REGISTERED.extend([trt_kv_cache_update, trt_attention])


def engine_graph_logits(session, io, case, *, kv_capacity: int) -> dict:
    """The parity gate's phases (prefill, prefill_last, decode steps, a tree) through an engine graph's
    CPU session, the caches of kv_capacity rows fed back from each call's present outputs and the
    committed length P carried beside them (the mask's width says P + T): validate.onnx_logits in its
    fixed-capacity form. Returns {phase: logits [rows, V]} to compare with validate.reference_logits."""
    from specexport.export.validate import onnx_logits

    return onnx_logits(None, io, case, session=session, kv_capacity=kv_capacity)
