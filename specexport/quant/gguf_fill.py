"""The lean route's graph (no fp32 graph, builder/stages/gguf.py): the weightless export of export/lean.py
with its weight inputs made of the GGUF file's tensors, found by name (export/gguf_weights.py), the
block-quantized nodes built as the fp32 route builds them (quant/gguf_graph.py's _Builder)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.quant.gguf_blocks import SUPPORTED
from specexport.quant.gguf_graph import (
    GgufReport,
    Builder,
    data_file,
    take_block_rows,
    save,
    tensor_codes,
    wide_tensors,
)
from specexport.quant.gguf_raw import tensor_raw


def fill(skeleton: Path, sources: dict, weights, dest: Path, *, accuracy_level: int = 4,
         kernels: bool = False, layout: str = "file") -> GgufReport:
    """Write `dest` (+ dest.data): the weightless graph of export/lean.py with its weight inputs made
    of the file's tensors, found by name (`sources`: input -> ("param", HF name) | ("rows", HF name,
    rows) | ("buffer", values); `weights`: export/gguf_weights.GgufWeights). A weight that a MatMul
    reads through a Transpose, or an embedding Gather reads, keeps the file's blocks; every other one
    (norms, biases: F32 in the file) gets its values dequantized. A quantized file tensor that must
    stay fp32 is named in kept_fp32 (a block type without a mapping: in unsupported). kernels: our ops on
    the file's bytes (quant/gguf_graph.py), in `layout` ("file" or "r8"), else ONNX Runtime's."""
    onnx = require("onnx")
    from onnx import numpy_helper

    model = onnx.load(str(skeleton))
    graph = model.graph
    transposed = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Transpose" and n.input[0] in sources}
    uses: dict = {}                                  # weight input -> [(node, kind)] the blocks can serve
    readers: dict = {}                               # value -> every node reading it
    for node in graph.node:
        for x in node.input:
            readers.setdefault(x, []).append(node)
        if node.op_type == "MatMul" and node.input[1] in transposed:
            uses.setdefault(transposed[node.input[1]], []).append((node, "matmul"))
        elif node.op_type == "Gather" and node.input[0] in sources:
            uses.setdefault(node.input[0], []).append((node, "gather"))
    shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in graph.input}
    wide = wide_tensors(weights.tensors.values())
    report, values = GgufReport(), []
    builder = Builder(model, accuracy_level, wide, data_file(dest), kernels=kernels, layout=layout)
    for name, source in sources.items():
        if source[0] == "buffer":
            values.append(numpy_helper.from_array(np.ascontiguousarray(source[1]), name))
            continue
        hf, rows = source[1], (source[2] if source[0] == "rows" else None)
        t = weights.tensor(hf)
        tname, qtype = t.name, t.tensor_type.name
        served = uses.get(name, [])
        rest = [n for n in readers.get(name, []) if not _served(n, served, readers)]
        if qtype in SUPPORTED and served:
            # kernels: the file's bytes alone (nothing decoded); stock: the codes MatMulNBits reads
            codes = tensor_raw(t, weights.rows(hf)) if kernels else tensor_codes(t, weights.rows(hf))
            prefix = tname if rows is None else f"{tname}.vocab"
            if rows is not None:
                codes = codes.take_rows(rows) if kernels else take_block_rows(codes, rows)
            shape = codes.shape if kernels else codes.codes.shape
            if shapes[name] != shape:
                raise ValueError(f"{name}: the graph wants {list(shapes[name])}, the file's {tname} "
                                 f"gives {list(shape)}")
            for node, kind in served:
                builder.replace(node, kind, None if kernels else codes, prefix=prefix, raw=codes if kernels else None)
            report.replaced[name] = (prefix, qtype)
            if not rest:
                continue
            report.kept_fp32.append(name)            # read elsewhere too: that reader gets fp32 values
        elif qtype not in SUPPORTED and qtype not in ("F32", "F16", "BF16"):
            report.unsupported[tname] = qtype
        elif qtype in SUPPORTED:
            report.kept_fp32.append(name)            # quantized in the file, read where no block kernel serves
        arr = weights.get(hf)
        values.append(numpy_helper.from_array(arr if rows is None else np.ascontiguousarray(arr[rows]), name))
    inputs = [i for i in graph.input if i.name not in sources]
    del graph.input[:]
    graph.input.extend(inputs)
    graph.initializer.extend(values)
    builder.finish({})
    save(model, dest)
    report.tails = builder.tails
    return report


def _served(node, served: list, readers: dict) -> bool:
    """A reader the blocks replace: a served node, or a Transpose only served MatMuls read."""
    done = {id(n) for n, _ in served}
    return id(node) in done or (node.op_type == "Transpose" and all(id(m) in done for m in readers.get(node.output[0], [])))
