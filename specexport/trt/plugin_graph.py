"""The graph variant for TensorRT: attention as the tree-attention plugin node, checked on CPU.

TensorRT's ONNX parser cannot import the exported graphs' attention (ONNX Runtime's contrib
GroupQueryAttention, export/gqa.py), so `plugin_graph` rewrites each such node into standard ops
around one plugin node (trt_plugin.plugin_node: op_type `tree_attention`, plugin_namespace
`specexport`, aot 1):

    q [1, T, Hq*D] -> Reshape [T, Hq, D]
    present_k = Concat(past_k, new k as [1, Hkv, T, D])         (likewise v; rows P..P+T-1 are the new ones)
    k, v for the kernel = present [1, Hkv, S, D] -> [S, Hkv, D]  (S = P + T)
    mask = attention_mask [1, T, S] -> [T, S]                    (the tree's ancestor mask over past + new)
    out = tree_attention(q, k, v, mask) [T, Hq, D] -> [1, T, Hq*D]

B = 1, as the runtime drives it. The cache is the plain-run form of the graph contract (each call's
present has P + T rows and is the next call's past): the in-place update into a fixed-capacity buffer
is TensorRT's KV-cache-update layer's job in the engine, which is not written yet. Made from a graph
after quantization (ModelOpt would calibrate a graph with a custom op on TensorRT only).

`cpu_session` runs such a graph in ONNX Runtime with the plugin op implemented by the numpy reference
(tree_attention.reference) as an onnxruntime-extensions Python op, so the rewrite is checked end to end
against PyTorch by the same parity gate as the exported graph. Python ops live in the domain
onnxruntime-extensions fixes (ai.onnx.contrib); the TensorRT parser finds a plugin by op_type and
plugin_namespace, not domain: the CPU check moves the nodes there in its own copy.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.io_spec import ATTENTION_MASK
from specexport.plugins.trt_plugin import NAME, NAMESPACE, plugin_node
from specexport.trt.rewrite import attention_fields, drop_unused_initializers, install, replace_nodes

ATTENTION_OP = "GroupQueryAttention"
PYOP_DOMAIN = "ai.onnx.contrib"


def plugin_graph(model, *, head_dim: int):
    """Rewrite every attention node of `model` (an onnx ModelProto) into the plugin form; returns it."""
    onnx = require("onnx")
    helper = onnx.helper
    graph = model.graph
    mask = _graph_input(graph, ATTENTION_MASK)
    consts: dict[str, str] = {}

    def const(name: str, values) -> str:
        if name not in consts:
            graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(values, np.int64), name))
            consts[name] = name
        return name

    tree_mask = "tree_attention.mask"
    squeeze = helper.make_node("Squeeze", [mask, const("tree_attention.axis0", [0])], [tree_mask],
                               name="tree_attention_mask")

    def layer(node, index: int) -> list:
        """The nodes replacing attention node `index` (`node`)."""
        hq, hkv, scale, (q, k, v, past_k, past_v), (out, present_k, present_v) = attention_fields(node, head_dim)
        p = f"{node.name or 'attention'}.plugin{index}"
        heads = const(f"tree_attention.q_shape{hq}", [-1, hq, head_dim])
        kv_new = const(f"tree_attention.kv_new_shape{hkv}", [1, -1, hkv, head_dim])
        flat = const(f"tree_attention.out_shape{hq}", [1, -1, hq * head_dim])
        return [
            helper.make_node("Reshape", [q, heads], [f"{p}.q"], name=f"{p}.reshape_q"),
            *_append(helper, k, kv_new, past_k, present_k, p, "k"),
            *_append(helper, v, kv_new, past_v, present_v, p, "v"),
            plugin_node([f"{p}.q", f"{p}.k_rows", f"{p}.v_rows", tree_mask], [f"{p}.out"], num_kv_heads=hkv,
                        scale=scale, name=f"{p}.tree_attention", domain=NAMESPACE),
            helper.make_node("Reshape", [f"{p}.out", flat], [out], name=f"{p}.reshape_out"),
        ]

    nodes, count = replace_nodes(graph, ATTENTION_OP, layer, before=[squeeze])
    if not count:
        raise ValueError(f"plugin_graph: the graph has no {ATTENTION_OP} node to replace")
    install(graph, nodes)
    model.opset_import.append(helper.make_opsetid(NAMESPACE, 1))
    return model


def write_plugin_graph(source: Path, dest: Path, *, head_dim: int) -> Path:
    """The plugin form of the graph at `source`, written to `dest` in the same folder. The weights are
    not copied: the new graph refers to `source`'s external-data file, whose tensors it keeps as they are."""
    onnx = require("onnx")
    if Path(source).parent != Path(dest).parent:
        raise ValueError("write_plugin_graph: dest must be beside source (it shares its weights file)")
    model = plugin_graph(onnx.load(str(source), load_external_data=False), head_dim=head_dim)
    drop_unused_initializers(model)
    onnx.save(model, str(dest))
    return dest


def _append(helper, new, shape, past, present, p: str, which: str) -> list:
    """present = Concat(past [1, Hkv, P, D], new [1, T, Hkv*D] as [1, Hkv, T, D]); the kernel's
    [S, Hkv, D] rows from it."""
    return [
        helper.make_node("Reshape", [new, shape], [f"{p}.{which}_new"], name=f"{p}.reshape_{which}"),
        helper.make_node("Transpose", [f"{p}.{which}_new"], [f"{p}.{which}_heads"], perm=[0, 2, 1, 3],
                         name=f"{p}.heads_{which}"),
        helper.make_node("Concat", [past, f"{p}.{which}_heads"], [present], axis=2, name=f"{p}.append_{which}"),
        helper.make_node("Squeeze", [present, "tree_attention.axis0"], [f"{p}.{which}_squeezed"],
                         name=f"{p}.squeeze_{which}"),
        helper.make_node("Transpose", [f"{p}.{which}_squeezed"], [f"{p}.{which}_rows"], perm=[1, 0, 2],
                         name=f"{p}.rows_{which}"),
    ]


def _graph_input(graph, name: str) -> str:
    if name not in {i.name for i in graph.input}:
        raise ValueError(f"plugin_graph: the graph has no input {name!r}")
    return name


def cpu_session(graph, optimization: str = "all"):
    """An ONNX Runtime CPU session of a plugin graph (a path, or a ModelProto with its weights loaded),
    the plugin op computed by tree_attention.reference (`optimization`: the manifest's ort_optimization
    of the graph it was made from)."""
    from specexport.runtime.backends.ort import OPTIMIZATION_LEVELS, base_options

    onnx = require("onnx")
    ort = require("onnxruntime")
    ext = require("onnxruntime_extensions")
    register_reference_op(ext)
    model = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph))
    for node in model.graph.node:
        if node.op_type == NAME:
            node.domain = PYOP_DOMAIN
    model.opset_import.append(onnx.helper.make_opsetid(PYOP_DOMAIN, 1))
    opts = base_options()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
    opts.log_severity_level = 3                 # not one warning per initializer the rewrite left unused
    opts.register_custom_ops_library(ext.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


_REGISTERED = []


def register_reference_op(ext) -> None:
    """The plugin op as an onnxruntime-extensions Python op (once per process)."""
    if _REGISTERED:
        return
    from specexport.plugins.tree_attention import reference

    d = ext.PyCustomOpDef

    @ext.onnx_op(op_type=NAME, inputs=[d.dt_float, d.dt_float, d.dt_float, d.dt_bool], outputs=[d.dt_float],
                 attrs={"plugin_namespace": d.dt_string, "aot": d.dt_int64, "num_kv_heads": d.dt_int64,
                        "scale": d.dt_float})
    def tree_attention(q, k, v, mask, plugin_namespace="", aot=1, num_kv_heads=0, scale=0.0):
        return reference(q, k, v, mask, scale=scale).astype(np.float32)

    _REGISTERED.append(tree_attention)
