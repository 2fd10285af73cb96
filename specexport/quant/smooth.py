"""SmoothQuant (Xiao et al., 2023) on an fp32 ONNX graph, before static Q/DQ quantization.

Per-tensor uint8 activation scales fail on LLMs because a few channels of the MatMul inputs carry
values 10-100x larger than the rest (SmolLM2-135M with MinMax Q/DQ: top-1 agreement with fp32 0.38).
SmoothQuant moves that range into the weights, which are quantized per output channel anyway: for a
MatMul X @ W with X [.., K], W [K, N], and per input channel k

    s_k = max|X_k| ** alpha / max_n |W_kn| ** (1 - alpha),    X' = X / s,   W' = diag(s) W,

so X' @ W' = X @ W exactly in fp32 and X' has a flat range. The division is folded into the norm
that produces X when it can be (RMSNormalization / SimplifiedLayerNormalization with a constant
scale, and X used by nothing but these MatMuls; the norm gets its own copy of the scale, since an
exporter may share one constant between norms); elsewhere (attention output,
the MLP's gated product) a Mul by 1/s is inserted before the MatMuls. MatMuls that read the same X
share one s (from the largest weight of any of them).

Why our own: onnxruntime's `quantize_static(extra_options={"SmoothQuant": True})` hands this to
Intel Neural Compressor's ONNX adaptor, which exists only in neural-compressor 2.x; its wheel
requires numpy < 2 (3.x dropped the ONNX adaptor), and this project runs on numpy 2.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require

FOLDABLE_NORMS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
S_RANGE = (1e-4, 1e4)        # clip s: an all-zero channel (or weight row) must not blow up the other side


def weight_matmuls(model) -> dict[str, list]:
    """{activation tensor: [MatMul nodes X @ W with a 2-D constant W]} of the graph."""
    inits = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list] = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
            groups.setdefault(node.input[0], []).append(node)
    return groups


def activation_channel_max(model_path: Path, feeds, tensors, *, work_dir: Path) -> dict[str, np.ndarray]:
    """max |x| per last-axis channel of each of `tensors`, over every row of every feed: the graph is
    saved again (weights as external data in work_dir) with those tensors as extra outputs."""
    onnx = require("onnx")
    ort = require("onnxruntime")
    model = onnx.load(str(model_path))
    names = list(tensors)
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                              for n in names if n not in have)
    probe = work_dir / "probe.onnx"
    onnx.save(model, str(probe), save_as_external_data=True, location="probe.onnx.data")
    del model
    from specexport.runtime.backends.ort import base_options

    opts = base_options()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL     # the tensors as written
    session = ort.InferenceSession(str(probe), opts, providers=["CPUExecutionProvider"])
    out: dict[str, np.ndarray] = {}
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed)):
            m = np.abs(value.reshape(-1, value.shape[-1])).max(0)
            out[name] = m if name not in out else np.maximum(out[name], m)
    return out


def smooth(model, act_max: dict[str, np.ndarray], alpha: float) -> dict:
    """Rewrite `model` (an onnx ModelProto with its weights loaded) in place; returns counts."""
    onnx = require("onnx")
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    users: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}
    folded = inserted = 0
    for x, matmuls in weight_matmuls(model).items():
        if x not in act_max:
            continue
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in matmuls]          # [K, N] each
        w_max = np.max([np.abs(w).max(1) for w in weights], axis=0)                      # [K]
        a = act_max[x].astype(np.float64)
        s = np.where((a > 0) & (w_max > 0), a ** alpha / np.maximum(w_max, 1e-12) ** (1 - alpha), 1.0)
        s = np.clip(s, *S_RANGE).astype(np.float32)
        for node, w in zip(matmuls, weights):
            name = node.input[1]
            scaled = numpy_helper.from_array(w * s[:, None], _fresh(inits, name + "_smooth"))
            graph.initializer.append(scaled)
            inits[scaled.name] = scaled
            node.input[1] = scaled.name
        norm = producer.get(x)
        scale = norm.input[1] if norm is not None and len(norm.input) > 1 else None
        if (norm is not None and norm.op_type in FOLDABLE_NORMS and scale in inits
                and all(u in matmuls for u in users[x]) and x not in graph_outputs):
            gamma = numpy_helper.to_array(inits[scale])
            new = numpy_helper.from_array((gamma / s).astype(gamma.dtype), _fresh(inits, scale + "_smooth"))
            graph.initializer.append(new)
            inits[new.name] = new
            norm.input[1] = new.name
            folded += 1
        else:
            inv = numpy_helper.from_array((1.0 / s).astype(np.float32), _fresh(inits, x + "_inv_smooth"))
            graph.initializer.append(inv)
            inits[inv.name] = inv
            out = _fresh(inits, x + "_smoothed")
            graph.node.append(onnx.helper.make_node("Mul", [x, inv.name], [out], name=out + "_mul"))
            for node in matmuls:
                node.input[0] = out
            inserted += 1
    _drop_unused_initializers(graph)
    _topological_sort(graph)
    return {"folded_into_norms": folded, "mul_inserted": inserted, "alpha": alpha}


def _fresh(taken, name: str) -> str:
    while name in taken:
        name += "_"
    return name


def _drop_unused_initializers(graph) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def _topological_sort(graph) -> None:
    """Inserted Mul nodes were appended at the end; ONNX needs producers before consumers."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in known for i in n.input)]
        if not ready:
            raise ValueError("smooth: the graph has a cycle or an undefined input")
        for n in ready:
            known.update(n.output)
        ordered += ready
        ready_ids = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in ready_ids]
    copies = [type(n)() for n in ordered]
    for c, n in zip(copies, ordered):
        c.CopyFrom(n)
    del graph.node[:]
    graph.node.extend(copies)
