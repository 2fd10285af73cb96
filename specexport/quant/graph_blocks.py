"""Any fp32 graph's weights as ggml blocks on our kernels (a head, or a graph no GGUF file describes):

    MatMul(A, W [K, N])        ->  specexport.cpu.GgufMatMul(A, blocks of W^T)    K a multiple of the block
    Gather(E [V, H], ids)      ->  specexport.cpu.GgufGather(blocks of E, ids)     H likewise
    attention                  ->  ours (plugins/cpu/graph.kernel_attention)

The blocks are quantize_row's (quant/kquant.py: ggml's bits), made here from the graph's own weights, so
`dequantized` gives the exact float weights the blocks hold: what a parity check runs the reference on.
A weight whose rows are not whole blocks stays fp32 (named in the result). `exact`: float activations
against the blocks (GgufMatMul exact=1, a parity twin); else int8 activations, the kernels' fast rows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.quant.gguf_raw import RawBlocks

BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}


def quantized(w: np.ndarray, qtype: str) -> RawBlocks:
    """w [N, K] float32 as `qtype` blocks."""
    from specexport.quant.kquant import quantize

    return RawBlocks(qtype, quantize(np.ascontiguousarray(w, np.float32), qtype), int(w.shape[1]))


def dequantized(w: np.ndarray, qtype: str) -> np.ndarray:
    """w [N, K]'s float values as `qtype` blocks hold them (ggml's dequantization, the gguf package's)."""
    gguf = require("gguf")
    raw = quantized(w, qtype).raw
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(w.shape).astype(np.float32)


def fits(shape, qtype: str) -> bool:
    """Whether a [N, K] weight is whole blocks of `qtype` along K."""
    return len(shape) == 2 and shape[1] % BLOCK_WEIGHTS[qtype] == 0


def to_blocks(src: Path, dest: Path, qtype: str = "Q8_0", *, exact: bool = False, layout: str = "file") -> dict:
    """Write dest (+ dest.data): the graph at `src` with each MatMul/Gather weight of whole `qtype` rows as
    blocks on our kernels (in `layout`: "file" or "r8"), attention ours. Returns {"replaced": {initializer: qtype}, "kept_fp32": [...]}."""
    onnx = require("onnx")
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    from specexport.quant.gguf_graph import Builder, data_file, read_initializer, weight_users, save

    if qtype not in BLOCK_WEIGHTS:
        raise ValueError(f"to_blocks: qtype {qtype!r} is not one of {', '.join(BLOCK_WEIGHTS)}")
    model = onnx.load(str(src), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    builder = Builder(model, 0 if exact else 4, data=data_file(dest), kernels=True, layout=layout)
    replaced, kept = {}, []
    for init, node, kind in weight_users(model, inits):
        shape = tuple(inits[init].dims)
        rows = shape[::-1] if kind == "matmul" else shape            # [N, K]: MatMul's B is [K, N]
        if not fits(rows, qtype):
            kept.append(init)
            continue
        arr = read_initializer(inits[init], src.parent)
        raw = quantized(arr.T if kind == "matmul" else arr, qtype)
        builder.replace(node, "gather" if kind == "gather" else "matmul", None, prefix=init, raw=raw)
        replaced[init] = qtype
    builder.finish(replaced)
    ours = {t.name for t in builder.inits}
    for t in model.graph.initializer:                  # norms, biases, weights kept fp32: into dest's own data
        if t.name not in ours and uses_external_data(t):
            load_external_data_for_tensor(t, str(src.parent))
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    save(model, dest)
    return {"replaced": replaced, "kept_fp32": sorted(set(kept) - set(replaced))}
