"""fp32 ONNX graph -> weight-only quantized graph (int8 / int4) with onnxruntime's quantization tools.

Both precisions replace every MatMul with a constant weight (attention projections, MLP, lm_head) by
`com.microsoft.MatMulNBits` (MatMulNBitsQuantizer, blocks of 32 along K, asymmetric, accuracy_level 4:
activations are quantized to int8 per block of each row and multiplied in int8). Embeddings, norms
and attention stay fp32, and so does the IO table.

Why MatMulNBits for int8 too, not `quantize_dynamic`: dynamic quantization computes one activation
scale per tensor (DynamicQuantizeLinear), so a token's logits depend on the other tokens in the same
call. A verification pass over γ+1 tokens then disagrees with one-token decoding (measured on the tiny
llama: relative logit change 9e-2 for a row computed alone vs with 4 others; greedy speculative output
differed from vanilla greedy in 15 of 20 runs). MatMulNBits quantizes each row on its own (row
dependence 5e-7, as fp32), so greedy speculative decoding stays token-for-token equal to vanilla
decoding on the same graph. Its speed at T = 1..5 matched dynamic int8 in our CPU measurement.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from specexport._optional import require

QUANTIZERS = {   # MatMulNBitsQuantizer keyword arguments per precision (also recorded in the manifest)
    "int8": {"bits": 8, "block_size": 32, "is_symmetric": False, "accuracy_level": 4},
    "int4": {"bits": 4, "block_size": 32, "is_symmetric": False, "accuracy_level": 4},
}
TOOL = "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer"


def quantize_graph(source: Path, dest: Path, precision: str) -> list[Path]:
    """Write the `precision` version of the fp32 graph `source` to `dest` (+ `dest`.data); returns the files."""
    onnx = require("onnx")
    nbits = require("onnxruntime.quantization.matmul_nbits_quantizer")
    model = onnx.load(str(source))                  # with its external weights
    with _quiet_quantizer():
        quantizer = nbits.MatMulNBitsQuantizer(model, **QUANTIZERS[precision])
        quantizer.process()
        # External data keeps the graph under protobuf's 2 GB limit; the runtime loads it by relative path.
        quantizer.model.save_model_to_file(str(dest), use_external_data_format=True)
    return [p for p in (dest, dest.with_name(dest.name + ".data")) if p.exists()]


def describe(precision: str) -> dict:
    """The manifest's `quantization` record of a precision."""
    return {"tool": TOOL, "op": "MatMulNBits", **QUANTIZERS[precision], "source_precision": "fp32"}


@contextlib.contextmanager
def _quiet_quantizer():
    """The quantizer logs one INFO line per node through its own handler; our stages report progress."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
