"""fp32 ONNX graph -> quantized graph (int8 / int4) with onnxruntime's quantization tools, by scheme.

Schemes (`quantization: {int8: {scheme: ..., ...}}` in model.yaml; SCHEMES has each one's options):
  matmulnbits  every MatMul with a constant weight (attention projections, MLP, lm_head) becomes
               `com.microsoft.MatMulNBits` (MatMulNBitsQuantizer: asymmetric blocks of `block_size`
               along K; `accuracy_level` 4 quantizes activations to int8 per block of each row and
               multiplies in int8, 1 dequantizes the weights and multiplies in fp32). int8 and int4.
               The default for both.
  static_qdq   int8 only: QuantizeLinear/DequantizeLinear around every weight MatMul (`quantize_static`,
               uint8 activations with per-tensor scales calibrated on sequences sampled from the fp32
               graph, int8 per-channel weights); ORT fuses each group into an int8 kernel. Options:
               `calibrate` (minmax, percentile 99.999, entropy: onnxruntime's calibrators),
               `smooth_alpha` (SmoothQuant before calibration, export/smooth.py; 0 = off) and
               `lm_head: fp32` (leave the output projection unquantized).
  dynamic      int8 only: DynamicQuantizeLinear + MatMulInteger (`quantize_dynamic`). One activation
               scale per call, so a token's logits depend on the other tokens of the pass (relative
               9e-2 on the tiny llama): verifying γ+1 tokens disagrees with one-token decoding and
               speculative output differs from the graph's own vanilla output. The build refuses it
               for a target (the row-independence check in build.py); a draft may use it.
Embeddings, norms and attention stay fp32, and so does the IO table.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from specexport._optional import require

BITS = {"int8": 8, "int4": 4}
# scheme -> (precisions it can make, {option: (default, allowed values or a type)})
SCHEMES = {
    "matmulnbits": (("int8", "int4"), {"block_size": (32, (16, 32, 64, 128, 256)), "accuracy_level": (4, (0, 1, 2, 3, 4))}),
    "static_qdq": (("int8",), {"smooth_alpha": (0.0, (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)),
                               "calibrate": ("minmax", ("minmax", "percentile", "entropy")),
                               "lm_head": ("int8", ("int8", "fp32"))}),
    "dynamic": (("int8",), {}),
}
DEFAULT_SCHEME = "matmulnbits"
ROW_INDEPENDENT = {"matmulnbits": True, "static_qdq": True, "dynamic": False}
TOOLS = {
    "matmulnbits": ("onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer", "MatMulNBits"),
    "static_qdq": ("onnxruntime.quantization.quantize_static", "QuantizeLinear/DequantizeLinear + MatMul (U8S8)"),
    "dynamic": ("onnxruntime.quantization.quantize_dynamic", "DynamicQuantizeLinear + MatMulInteger"),
}


def default_scheme(precision: str) -> dict:
    return {"scheme": DEFAULT_SCHEME, **{k: d for k, (d, _) in SCHEMES[DEFAULT_SCHEME][1].items()}}


def quantize_graph(source: Path, dest: Path, precision: str, scheme: dict | None = None, *, io=None,
                   calibration=()) -> list[Path]:
    """Write the `precision` version of the fp32 graph `source` to `dest` (+ `dest`.data); returns the files.
    static_qdq calibrates on `calibration` (token sequences, fed through `io`)."""
    scheme = scheme or default_scheme(precision)
    kind = scheme["scheme"]
    onnx = require("onnx")
    q = require("onnxruntime.quantization")
    with _quiet_quantizer():
        if kind == "matmulnbits":
            nbits = require("onnxruntime.quantization.matmul_nbits_quantizer")
            quantizer = nbits.MatMulNBitsQuantizer(onnx.load(str(source)), bits=BITS[precision], is_symmetric=False,
                                                   block_size=scheme["block_size"],
                                                   accuracy_level=scheme["accuracy_level"])
            quantizer.process()
            # External data keeps the graph under protobuf's 2 GB limit; the runtime loads it by relative path.
            quantizer.model.save_model_to_file(str(dest), use_external_data_format=True)
        elif kind == "dynamic":
            q.quantize_dynamic(str(source), str(dest), op_types_to_quantize=["MatMul"], weight_type=q.QuantType.QInt8,
                               per_channel=False, use_external_data_format=True)
        else:
            _static_qdq(q, source, dest, scheme, [io.feeds(s[None]) for s in calibration])
    return [p for p in (dest, dest.with_name(dest.name + ".data")) if p.exists()]


CALIBRATORS = {"minmax": ("MinMax", {}), "percentile": ("Percentile", {"CalibPercentile": 99.999}),
               "entropy": ("Entropy", {})}


def _static_qdq(q, source: Path, dest: Path, scheme: dict, feeds: list) -> None:
    """quantize_static on the fp32 graph, or on its SmoothQuant rewrite (made in a scratch folder
    beside dest, removed afterwards)."""
    import shutil

    onnx = require("onnx")
    if not feeds:
        raise ValueError("static_qdq needs calibration sequences")
    scratch = dest.parent / f".{dest.name}.smooth"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        exclude = [n.name for n in onnx.load(str(source), load_external_data=False).graph.node
                   if n.op_type == "MatMul" and "logits" in n.output] if scheme.get("lm_head") == "fp32" else []
        if scheme.get("smooth_alpha"):
            from specexport.export import smooth

            model = onnx.load(str(source))
            act_max = smooth.activation_channel_max(source, feeds, list(smooth.weight_matmuls(model)), scratch)
            smooth.smooth(model, act_max, scheme["smooth_alpha"])
            source = scratch / "smoothed.onnx"
            onnx.save(model, str(source), save_as_external_data=True, location="smoothed.onnx.data")
            del model
        method, extra = CALIBRATORS[scheme.get("calibrate", "minmax")]
        q.quantize_static(str(source), str(dest), _Reader(q, feeds), quant_format=q.QuantFormat.QDQ,
                          op_types_to_quantize=["MatMul"], activation_type=q.QuantType.QUInt8,
                          weight_type=q.QuantType.QInt8, per_channel=True, use_external_data_format=True,
                          calibrate_method=getattr(q.CalibrationMethod, method), nodes_to_exclude=exclude,
                          extra_options=extra)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _Reader(q, feeds):
    """onnxruntime's CalibrationDataReader over a list of feed dicts (a factory: the base class needs
    onnxruntime.quantization, imported lazily)."""
    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

    return Reader()


def describe(precision: str, scheme: dict | None = None, *, calibration_sequences: int = 0) -> dict:
    """The manifest's `quantization` record of a precision."""
    scheme = scheme or default_scheme(precision)
    tool, op = TOOLS[scheme["scheme"]]
    out = {"tool": tool, "op": op, "bits": BITS[precision], **scheme, "source_precision": "fp32",
           "row_independent": ROW_INDEPENDENT[scheme["scheme"]]}
    if scheme["scheme"] == "static_qdq":
        method, extra = CALIBRATORS[scheme.get("calibrate", "minmax")]
        out["calibration"] = {"method": method, **extra, "sequences": calibration_sequences,
                              "smoothquant_alpha": scheme.get("smooth_alpha", 0.0)}
    return out


@contextlib.contextmanager
def _quiet_quantizer():
    """The quantizer logs one INFO line per node through its own handler; our stages report progress."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
