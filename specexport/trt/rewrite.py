"""What the two attention rewrites share (trt/graph.py: the engine graph, in-place caches; trt/plugin_graph.py:
the plain-run plugin graph): reading an exported attention node, replacing each such node by the nodes a
rewrite makes for it, dropping what no output reads any more, and the initializers no node reads."""
from __future__ import annotations

import numpy as np


def attention_fields(node, head_dim: int):
    """(heads, kv heads, scale, its 5 inputs q/k/v/past_k/past_v, its 3 outputs out/present_k/present_v) of
    an exported GroupQueryAttention node (export/gqa.py); a missing scale is 1/sqrt(head_dim), as ORT's."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    scale = float(attrs.get("scale", 0.0)) or 1.0 / np.sqrt(head_dim)
    return (int(attrs["num_heads"]), int(attrs["kv_num_heads"]), scale, tuple(node.input[:5]),
            tuple(node.output[:3]))


def replace_nodes(graph, op_type: str, replace, *, before=()) -> tuple[list, int]:
    """(the graph's nodes with each `op_type` node replaced by replace(node, index) (a list of nodes), after
    `before`; how many were replaced). The graph is not changed: install() puts the list in."""
    nodes, count = list(before), 0
    for node in graph.node:
        if node.op_type != op_type:
            nodes.append(node)
            continue
        nodes += replace(node, count)
        count += 1
    return nodes, count


def install(graph, nodes: list) -> None:
    """The graph's nodes become those of `nodes` something downstream of its outputs reads (the old
    attention-bias and length computations are dead after a rewrite); shapes are inferred anew."""
    needed, keep = {o.name for o in graph.output}, []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(node.input)
    graph.ClearField("node")
    graph.node.extend(keep[::-1])
    graph.ClearField("value_info")


def drop_unused_initializers(model) -> None:
    """Keep the initializers some node reads (the attention-bias constants go)."""
    used = {i for n in model.graph.node for i in n.input}
    kept = [i for i in model.graph.initializer if i.name in used]
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(kept)
