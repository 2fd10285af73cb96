"""fp32 ONNX graph -> fp16 compute graph with the fp32 IO table unchanged (the `fp16` precision).

Every node computes in fp16 (weights stored in fp16, half the bytes) except:
  - the attention nodes (com.microsoft GroupQueryAttention): their KV caches are graph inputs and
    outputs updated in place (io_spec, contract 3), which the IO table keeps fp32; q/k/v are cast to
    fp32 in front of them and the attention output back to fp16 after;
  - the rotary angle computation (position_ids x inv_freq -> Cos/Sin and everything upstream of
    them): in fp16 a position of 2048 has a resolution of 2, so the angles would be wrong past a few
    hundred tokens; the cos/sin values themselves (in [-1, 1]) are cast to fp16 for RotaryEmbedding.
RMSNormalization keeps its fp32 accumulation (stash_type). Graph inputs and outputs stay fp32: a cast
after each float input and before each float output.

Why our own pass: NVIDIA ModelOpt's autocast (`modelopt.onnx.autocast.convert_to_f16`) treats the
GroupQueryAttention node as a TensorRT plugin and needs TensorRT to infer its types (unregistered),
or, with its schema registered, moves it to the default domain and fails its own sanity check;
onnxconverter-common's and onnxruntime.transformers' float16 converters wrap a kept-fp32 node's cache
inputs and outputs in fp32->fp16->fp32 casts (rounding the cache, and ORT then rejects the in-place
buffer reuse: "Shape mismatch attempting to re-use buffer") or refuse the graph outright. Measured with
ModelOpt 0.47, onnxconverter-common 1.16, onnxruntime 1.32.
"""
from __future__ import annotations

import numpy as np

from specexport._optional import require

KEEP_FP32_OPS = ("GroupQueryAttention",)
ANGLE_OPS = ("Cos", "Sin")          # their inputs and everything upstream stay fp32 (rotary angles)
SHAPE_OPS = ("Shape", "Size")       # read only a shape: their inputs are never cast (a cast of a KV cache
                                    # to learn its length would copy the whole cache every call)


def to_fp16(model):
    """The fp16 version of `model` (an onnx ModelProto with its weights loaded); `model` is modified."""
    onnx = require("onnx")
    FLOAT, HALF = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    graph = model.graph
    types = float32_tensors(model)           # the fp32 tensors before the pass
    keep = _fp32_nodes(graph)
    inits = {i.name: i for i in graph.initializer}
    users: dict[str, set] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            users.setdefault(name, set()).add(i in keep)
    # initializers read only by fp16 nodes become fp16; one read by both gets an fp16 copy
    half_init: dict[str, str] = {}
    for name, init in inits.items():
        sides = users.get(name, set())          # {True: read by an fp32 node, False: by an fp16 node}
        if init.data_type != FLOAT or False not in sides:
            continue
        array = _half(onnx.numpy_helper.to_array(init))
        if True in sides:
            copy = onnx.numpy_helper.from_array(array, f"{name}.fp16")
            graph.initializer.append(copy)
            half_init[name] = copy.name
        else:
            init.CopyFrom(onnx.numpy_helper.from_array(array, name))
            half_init[name] = name
    # which float tensors are fp16 after the pass: outputs of fp16 nodes (and converted initializers)
    half = {name for i, node in enumerate(graph.node) if i not in keep for name in node.output if name in types}
    half |= {n for n, h in half_init.items() if h == n}
    casts: dict[tuple[str, int], str] = {}
    new_nodes = []

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            casts[key] = f"{name}.to_{'fp16' if to == HALF else 'fp32'}"
            new_nodes.append(onnx.helper.make_node("Cast", [name], [casts[key]], to=to, name=f"cast_{casts[key]}"))
        return casts[key]

    for i, node in enumerate(graph.node):
        fp16_node = i not in keep
        if node.op_type in SHAPE_OPS:
            new_nodes.append(node)
            continue
        for j, name in enumerate(node.input):
            if not name or name not in types:
                continue
            if fp16_node:
                if name in half_init:
                    node.input[j] = half_init[name]
                elif name not in half:                      # an fp32 graph input, kept node or initializer
                    node.input[j] = cast(name, HALF)
            elif name in half:                              # an fp16 tensor read by a kept node
                node.input[j] = cast(name, FLOAT)
        if fp16_node:
            _retype_node(onnx, node, FLOAT, HALF)
        new_nodes.append(node)
    # float graph outputs made in fp16: the producer writes NAME.fp16, a cast writes NAME
    for out in graph.output:
        if out.name in half:
            inner = f"{out.name}.fp16"
            for node in new_nodes:
                node.output[:] = [inner if o == out.name else o for o in node.output]
                node.input[:] = [inner if o == out.name else o for o in node.input]
            new_nodes.append(onnx.helper.make_node("Cast", [inner], [out.name], to=FLOAT, name=f"cast_{out.name}"))
    graph.ClearField("node")
    graph.node.extend(_toposort(new_nodes, {v.name for v in graph.input} | {i.name for i in graph.initializer}))
    graph.ClearField("value_info")          # stale types; ORT infers them again
    return model


def emulate(model):
    """The fp32 graph that computes what the fp16 graph `model` computes on a GPU, for ONNX Runtime on
    CPU (`model` is modified). ORT's CPU kernels for most fp16 ops are fp32 ones behind casts it
    inserts, and it drops the casts between two such ops: an fp16 Mul feeding an fp16 Add is computed
    without rounding in between (measured: 1.5 * (1 + 2^-10) - 1.5 gives fp32's 0.00146, not fp16's
    0.00195), so neither rounding nor overflow past 65504 would show in the quality gate. Here every
    fp16 tensor becomes fp32 holding fp16 values: the weights are the fp16 weights, and each fp16 node
    output is rounded by an explicit Cast to fp16 and back, which ORT keeps. Products are accumulated
    in fp32 and rounded once, as GPU fp16 GEMMs do."""
    onnx = require("onnx")
    FLOAT, HALF = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    graph = model.graph
    types = tensor_types(model)
    for init in graph.initializer:
        if init.data_type == HALF:
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init).astype(np.float32), init.name))
    nodes = []
    for node in graph.node:
        for a in node.attribute:
            if node.op_type in ("Constant", "ConstantOfShape") and a.name == "value" and a.t.data_type == HALF:
                a.t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
        rounded = [o for o in node.output if types.get(o) == HALF]
        if node.op_type == "Cast":                      # a cast to fp16 rounds, then the value goes on in fp32
            for a in node.attribute:
                if a.name == "to" and a.i == HALF:
                    a.i = FLOAT
            if not rounded:
                nodes.append(node)
                continue
        node.output[:] = [f"{o}.exact" if o in rounded else o for o in node.output]
        nodes.append(node)
        for o in rounded:
            nodes += [onnx.helper.make_node("Cast", [f"{o}.exact"], [f"{o}.half"], to=HALF, name=f"round_{o}"),
                      onnx.helper.make_node("Cast", [f"{o}.half"], [o], to=FLOAT, name=f"widen_{o}")]
    graph.ClearField("node")
    graph.node.extend(nodes)
    graph.ClearField("value_info")
    return model


def float32_tensors(model) -> set[str]:
    """Names of the graph's fp32 tensors (inputs, initializers, node outputs)."""
    onnx = require("onnx")
    return {name for name, t in tensor_types(model).items() if t == onnx.TensorProto.FLOAT}


def tensor_types(model) -> dict[str, int]:
    """{tensor name: ONNX elem_type} of the graph's inputs, initializers and node outputs, from ONNX type
    inference. The contrib attention node has no inference function here: its outputs are declared float."""
    onnx = require("onnx")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for init in probe.graph.initializer:            # inference needs types and small constants, not weights
        if int(np.prod(init.dims)) <= 64:
            continue
        init.ClearField("raw_data")
        init.ClearField("float_data")
        init.ClearField("external_data")
        init.data_location = onnx.TensorProto.DEFAULT
    declared = {v.name for v in probe.graph.value_info}
    for node in probe.graph.node:
        if node.op_type in KEEP_FP32_OPS:
            probe.graph.value_info.extend(onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None)
                                          for o in node.output if o and o not in declared)
    g = onnx.shape_inference.infer_shapes(probe).graph
    out = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)}
    out.update({i.name: i.data_type for i in g.initializer})
    for node in g.node:                              # Constant nodes: typed by their value
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    out[node.output[0]] = a.t.data_type
    return out


def _fp32_nodes(graph) -> set[int]:
    """Indices of the nodes that stay fp32: attention, and Cos/Sin with everything upstream of them."""
    producer = {o: i for i, node in enumerate(graph.node) for o in node.output}
    keep = {i for i, node in enumerate(graph.node) if node.op_type in KEEP_FP32_OPS}
    stack = [i for i, node in enumerate(graph.node) if node.op_type in ANGLE_OPS]
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        stack.extend(producer[n] for n in graph.node[i].input if n in producer)
    return keep


def _retype_node(onnx, node, FLOAT: int, HALF: int) -> None:
    """A node moved to fp16: casts to float cast to fp16, float constants become fp16."""
    for a in node.attribute:
        if node.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
            a.i = HALF
        elif node.op_type in ("Constant", "ConstantOfShape") and a.name == "value" and a.t.data_type == FLOAT:
            array = _half(onnx.numpy_helper.to_array(a.t))
            a.t.CopyFrom(onnx.numpy_helper.from_array(array, a.t.name))


def _half(array: np.ndarray) -> np.ndarray:
    """fp16 copy, clipped to its finite range (a mask fill of float32's min would become -inf)."""
    limit = float(np.finfo(np.float16).max)
    return np.clip(array, -limit, limit).astype(np.float16)


def _toposort(nodes: list, available: set[str]) -> list:
    """Nodes in an order where each one's inputs are produced before it (the inserted casts)."""
    done, out, pending = set(available) | {""}, [], list(nodes)
    while pending:
        rest = []
        for node in pending:
            if all(n in done for n in node.input):
                out.append(node)
                done.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ValueError(f"fp16 pass: the graph has a cycle or a missing input at {rest[0].name}")
        pending = rest
    return out
