"""fp32 graph -> explicit Q/DQ graph for TensorRT's strongly typed networks: `fp8` and `int8_sq`.

Made with NVIDIA ModelOpt's ONNX PTQ (`modelopt.onnx.quantization.quantize`), calibrated on CPU in
ONNX Runtime with feeds in the runtime's shapes and real past KV (feeds.py):
  fp8      E4M3 QuantizeLinear/DequantizeLinear on the weights (per tensor) and the activations of the
           weight MatMuls (Ada/Hopper/Thor; Orin has no FP8 tensor cores: int8_sq or int4 there).
  int8_sq  SmoothQuant (quant/smooth.py: ModelOpt's ONNX path has none, its SmoothQuant is the torch
           path's) folded into the graph first, then INT8 Q/DQ (symmetric, per-channel weights,
           per-tensor activations), which is what TensorRT's INT8 kernels take.
Only MatMuls are quantized (`op_types_to_quantize`): ModelOpt's int8 mode otherwise also puts Q/DQ in
front of Add, Mul, Sigmoid and RMSNormalization, and the residual stream through int8 per-tensor scales
destroyed SmolLM2-135M (top-1 agreement with fp32 0.000, KL 40 nats).
The output projection (`logits`) stays fp32 unless `lm_head: quantized` (the 49152-row lm_head of a
small model is where its argmax is decided; Edge-LLM leaves it unquantized too). The rest of the graph
stays fp32 (`high_precision_dtype="fp32"`): ModelOpt's fp16 cast of the rest fails on the in-place KV
attention node (see fp16.py), and ONNX Runtime on CPU runs these graphs only in fp32 around the Q/DQ.

On ONNX Runtime CPU these graphs are an accuracy path, not a speed path, run with basic graph
optimisation (ORT_OPTIMIZATION) so that the Q/DQ nodes compute what they say: full optimisation fuses
FP8 Q/DQ + MatMul into QLinearMatMul, which has no FP8 kernel, and INT8 into ORT's int8 GEMMs, whose
results depend on the number of rows in the call (greedy speculative output then differed from vanilla
on the tiny llama int8_sq); a GPU's int8 GEMM accumulates exactly and has no such dependence.
"""
from __future__ import annotations

import contextlib
import io as io_module
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.io_spec import LOGITS

MODES = {"fp8": "fp8", "int8_sq": "int8"}
ORT_OPTIMIZATION = {"fp16": "all", "fp8": "basic", "int8_sq": "basic"}
TOOL = "modelopt.onnx.quantization.quantize"


def quantize_qdq(source: Path, dest: Path, precision: str, *, scheme: dict, feeds: list[dict]) -> None:
    """Write the `precision` Q/DQ version of the fp32 graph `source` to `dest` (+ `dest`.data)."""
    onnx = require("onnx")
    if not feeds:
        raise ValueError(f"{precision} needs calibration feeds")
    # ModelOpt names its intermediate files with path.replace(".onnx", "_extended.onnx"): no ".onnx"
    # may appear in the folder's name
    scratch = dest.parent / f".{dest.stem}-ptq"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        model = onnx.load(str(source))
        _declare_attention_types(onnx, model)
        exclude = kept_high_precision(model, scheme)          # named before smoothing inserts its Muls
        if scheme.get("smooth_alpha"):
            from specexport.quant import smooth

            act_max = smooth.activation_channel_max(source, feeds, list(smooth.weight_matmuls(model)), work_dir=scratch)
            smooth.smooth(model, act_max, scheme["smooth_alpha"])
        prepared = scratch / "prepared.onnx"
        onnx.save(model, str(prepared), save_as_external_data=True, location="prepared.onnx.data")
        del model
        np.savez(scratch / "feeds.npz", **{f"{i}/{k}": v for i, feed in enumerate(feeds) for k, v in feed.items()})
        job = {"graph": str(prepared), "output": str(scratch / "quantized.onnx"), "feeds": str(scratch / "feeds.npz"),
               "mode": MODES[precision], "method": scheme.get("calibrate", "max"), "exclude": exclude}
        _in_child(job)
        # written again under dest's name: the external-data file is named after the graph
        quantized = onnx.load(str(scratch / "quantized.onnx"))
        onnx.save(quantized, str(dest), save_as_external_data=True, location=dest.name + ".data")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def kept_high_precision(model, scheme: dict) -> list[str]:
    """Names of the MatMuls left unquantized: the output projection unless `lm_head: quantized`, and with
    `keep: mlp_down` the MLPs' down projections (a MatMul on a gated product, act(gate) * up). On
    SmolLM2-135M their inputs have the widest ranges of the model (one channel 4000x the median
    channel's) and FP8 there cost most of the accuracy: top-1 agreement with fp32 0.848 with them
    quantized, 0.930 without."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type != "MatMul" or n.input[1] not in inits:
            continue
        if LOGITS in n.output:
            if scheme.get("lm_head", "fp32") == "fp32":
                out.append(n.name)
        elif scheme.get("keep", "none") == "mlp_down" and n.input[0] in producer \
                and producer[n.input[0]].op_type == "Mul":
            out.append(n.name)
    return out


def _declare_attention_types(onnx, model) -> None:
    """ModelOpt skips a MatMul whose input type it cannot infer ("failed to infer the type of tensor"),
    and ONNX has no type inference for the contrib attention node: the attention projections after it
    (o_proj) went unquantized. Declare its outputs float."""
    known = {v.name for v in (*model.graph.value_info, *model.graph.output)}
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            model.graph.value_info.extend(onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None)
                                          for o in node.output if o and o not in known)


def _in_child(job: dict) -> None:
    """Run ModelOpt in a child process. Importing modelopt.onnx.quantization patches onnxruntime's
    calibrators in the importing process (modelopt/onnx/quantization/ort_patching.py): afterwards
    onnxruntime's own quantize_static with percentile calibration failed in the same process
    ("Histogram has not been collected"), which the static_qdq int8 scheme uses."""
    done = subprocess.run([sys.executable, "-m", "specexport.quant.ptq", json.dumps(job)], capture_output=True,
                          text=True, check=False)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise RuntimeError(f"ModelOpt quantization ({job['mode']}) failed:\n{tail}")


def _quantize(job: dict) -> None:
    """The child's work: ModelOpt's PTQ on the prepared graph with the saved feeds."""
    with _quiet():
        mo = require("modelopt.onnx.quantization")
    from specexport.export.gqa import register_gqa_schema

    register_gqa_schema()                   # the onnx checker ModelOpt runs must know the attention op
    stored = np.load(job["feeds"])
    feeds: list[dict] = []
    for key in stored.files:
        i, name = key.split("/", 1)
        while len(feeds) <= int(i):
            feeds.append({})
        feeds[int(i)][name] = stored[key]
    with _quiet():
        mo.quantize(job["graph"], quantize_mode=job["mode"], calibration_data_reader=_Reader(feeds),
                    calibration_method=job["method"], calibration_eps=["cpu"], op_types_to_quantize=["MatMul"],
                    high_precision_dtype="fp32", nodes_to_exclude=job["exclude"], use_external_data_format=True,
                    dq_only=True, output_path=job["output"], log_level="ERROR")


def _Reader(feeds: list[dict]):
    """The calibration reader ModelOpt takes: onnxruntime's CalibrationDataReader plus get_first()
    (ModelOpt runs one feed ahead to find the tensors to calibrate) and rewind()."""
    q = require("onnxruntime.quantization")

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

        def get_first(self):
            return feeds[0]

        def rewind(self):
            self._it = iter(feeds)

    return Reader()


@contextlib.contextmanager
def _quiet():
    """ModelOpt and ORT's calibrators print per-tensor lines and warnings, and ModelOpt logs an ERROR when
    it finds no GPU ("Failed to get GPU count"), which is expected here; our stages report progress."""
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io_module.StringIO()):
            yield
    finally:
        logging.disable(previous)


if __name__ == "__main__":
    _quantize(json.loads(sys.argv[1]))
