"""fp32 ONNX graph -> quantized graph, by scheme: int8 / int4 for ONNX Runtime CPU (here, with
onnxruntime's quantization tools), fp16 / fp8 / int8_sq for GPUs (calibrate/: a cast pass and
NVIDIA ModelOpt's Q/DQ).

Schemes (`quantization: {int8: {scheme: ..., ...}}` in model.yaml; config.SCHEMES has each one's options):
  matmulnbits  every MatMul with a constant weight (attention projections, MLP, lm_head) becomes
               `com.microsoft.MatMulNBits` (MatMulNBitsQuantizer: asymmetric blocks of `block_size`
               along K; `accuracy_level` 4 quantizes activations to int8 per block of each row and
               multiplies in int8, 1 dequantizes the weights and multiplies in fp32). int8 and int4.
               The default for both.
  static_qdq   int8 only: QuantizeLinear/DequantizeLinear around every weight MatMul (`quantize_static`,
               uint8 activations with per-tensor scales calibrated on sequences sampled from the fp32
               graph, int8 per-channel weights); ORT fuses each group into an int8 kernel. Options:
               `calibrate` (minmax, percentile 99.999, entropy: onnxruntime's calibrators),
               `smooth_alpha` (SmoothQuant before calibration, quant/smooth.py; 0 = off) and
               `lm_head: fp32` (leave the output projection unquantized).
  dynamic      int8 only: DynamicQuantizeLinear + MatMulInteger (`quantize_dynamic`). One activation
               scale per call, so a token's logits depend on the other tokens of the pass (relative
               9e-2 on the tiny llama): verifying γ+1 tokens disagrees with one-token decoding and
               speculative output differs from the graph's own vanilla output. The build refuses it
               for a target (the row-independence check in build.py); a draft may use it.
  cast         fp16 only: every node in fp16 but attention and the rotary angles (quant/fp16.py).
  modelopt     fp8 only: E4M3 Q/DQ (quant/ptq.py). Options: `calibrate` (max, entropy),
               `lm_head` (fp32: left unquantized; quantized), `smooth_alpha` (SmoothQuant first; 0 = off),
               `keep` (mlp_down: the MLPs' down projections stay fp32; none).
  smoothquant  int8_sq only: SmoothQuant (`smooth_alpha`), then INT8 Q/DQ with ModelOpt (quant/ptq.py).
Embeddings, norms and attention stay fp32 (fp16 in the cast graph), and so does the IO table.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from specexport._optional import require
from specexport.io_spec import LOGITS
from specexport.schemes import default_scheme   # the options a model.yaml may name: schemes.SCHEMES

BITS = {"int8": 8, "int4": 4, "fp16": 16, "fp8": 8, "int8_sq": 8}
MODELOPT = ("modelopt", "smoothquant")                        # made by quant/ptq.py (NVIDIA ModelOpt)
CALIBRATED = ("static_qdq", *MODELOPT)       # need calibration data; they quantize activations with static scales
ROW_INDEPENDENT = {"matmulnbits": True, "static_qdq": True, "dynamic": False, "cast": True, "modelopt": True,
                   "smoothquant": True}
TOOLS = {
    "matmulnbits": ("onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer", "MatMulNBits"),
    "static_qdq": ("onnxruntime.quantization.quantize_static", "QuantizeLinear/DequantizeLinear + MatMul (U8S8)"),
    "dynamic": ("onnxruntime.quantization.quantize_dynamic", "DynamicQuantizeLinear + MatMulInteger"),
    "cast": ("specexport.quant.fp16.to_fp16", "fp16 compute, fp32 IO"),
    "modelopt": ("modelopt.onnx.quantization.quantize (quantize_mode fp8)", "QuantizeLinear/DequantizeLinear E4M3"),
    "smoothquant": ("specexport.quant.smooth + modelopt.onnx.quantization.quantize (quantize_mode int8)",
                    "QuantizeLinear/DequantizeLinear INT8 (symmetric)"),
}


# The graph ONNX Runtime on CPU runs for a scheme, beside model.onnx in the stage folder (the manifest's
# cpu_graph): the fp16 cast graph's CPU stand-in computes in fp32 what the fp16 graph computes on a GPU
# (calibrate/fp16.emulate: ORT's CPU kernels would skip fp16's rounding).
CPU_GRAPHS = {"cast": "cpu.onnx"}


def cpu_graph(scheme: dict | None) -> str:
    return CPU_GRAPHS.get((scheme or {}).get("scheme"), "model.onnx")


def quantize_graph(source: Path, dest: Path, precision: str, *, scheme: dict | None = None, io=None,
                   calibration=(), feeds=()) -> list[Path]:
    """Write the `precision` version of the fp32 graph `source` to `dest` (+ `dest`.data); returns the files.
    static_qdq calibrates on `calibration` (token sequences, fed through `io`), modelopt and
    smoothquant on `feeds` (calibrate.feeds.runtime_feeds: the runtime's shapes with real past KV)."""
    scheme = scheme or _graph_default(precision)
    kind = scheme["scheme"]
    onnx = require("onnx")
    q = require("onnxruntime.quantization")
    with _quiet_quantizer():
        if kind == "cast":
            from specexport.quant.fp16 import emulate, to_fp16

            half = to_fp16(onnx.load(str(source)))
            emulated = dest.with_name(CPU_GRAPHS[kind])
            stand_in = onnx.ModelProto()
            stand_in.CopyFrom(half)                 # saving moves the weights out of the proto it saves
            onnx.save(half, str(dest), save_as_external_data=True, location=dest.name + ".data")
            del half
            onnx.save(emulate(stand_in), str(emulated), save_as_external_data=True, location=emulated.name + ".data")
            return [dest, dest.with_name(dest.name + ".data"), emulated, emulated.with_name(emulated.name + ".data")]
        elif kind in MODELOPT:
            from specexport.quant.ptq import quantize_qdq

            quantize_qdq(source, dest, precision, scheme=scheme, feeds=list(feeds))
        elif kind == "matmulnbits":
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
            _static_qdq(q, source, dest, scheme=scheme, feeds=[io.feeds(s[None]) for s in calibration])
    return [p for p in (dest, dest.with_name(dest.name + ".data")) if p.exists()]


CALIBRATORS = {"minmax": ("MinMax", {}), "percentile": ("Percentile", {"CalibPercentile": 99.999}),
               "entropy": ("Entropy", {})}


def _static_qdq(q, source: Path, dest: Path, *, scheme: dict, feeds: list) -> None:
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
                   if n.op_type == "MatMul" and LOGITS in n.output] if scheme.get("lm_head") == "fp32" else []
        if scheme.get("smooth_alpha"):
            from specexport.quant import smooth

            model = onnx.load(str(source))
            act_max = smooth.activation_channel_max(source, feeds, list(smooth.weight_matmuls(model)), work_dir=scratch)
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


def describe(precision: str, scheme: dict | None = None, *, calibration_sequences: int = 0,
             calibration: dict | None = None) -> dict:
    """The manifest's `quantization` record of a precision (`calibration`: what calibrated it)."""
    scheme = scheme or _graph_default(precision)
    tool, op = TOOLS[scheme["scheme"]]
    out = {"tool": tool, "op": op, "bits": BITS[precision], **scheme, "source_precision": "fp32",
           "row_independent": ROW_INDEPENDENT[scheme["scheme"]]}
    if scheme["scheme"] == "static_qdq":
        method, extra = CALIBRATORS[scheme.get("calibrate", "minmax")]
        out["calibration"] = {"method": method, **extra, "sequences": calibration_sequences,
                              "smoothquant_alpha": scheme.get("smooth_alpha", 0.0), **(calibration or {})}
    if scheme["scheme"] in MODELOPT:
        out["calibration"] = {"method": scheme["calibrate"], "sequences": calibration_sequences, **(calibration or {})}
        out["high_precision"] = "fp32"
        from importlib.metadata import version

        out["modelopt_version"] = version("nvidia-modelopt")
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


def _graph_default(precision: str) -> dict:
    """The precision's default scheme among those made here from the fp32 graph (blocks, int8/int4's
    default, is made from the checkpoint by builder/stages/blocks.py): MatMulNBits for int8/int4."""
    scheme = default_scheme(precision)
    return default_scheme(precision, "matmulnbits") if scheme["scheme"] == "blocks" else scheme
