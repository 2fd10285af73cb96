"""What a graph stage adds for GPUs: the TensorRT engine (`backends: [tensorrt]`) and, for the GPU
precisions, the plugin graph TensorRT engines are built from. UNVERIFIED where written: no TensorRT or GPU."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport.errors import ParityError


def engine(ctx, mp, precision: str, folder: Path, fp32_graph: Path, min_tokens: int) -> dict | None:
    """backends: [tensorrt]: the stage's TensorRT engine, built and self-checked (trt/engine.py); None
    without that backend. fp32 and the GPU precisions only (int8/int4 are ONNX Runtime's MatMulNBits,
    which TensorRT does not parse)."""
    cfg = ctx.config
    if "tensorrt" not in cfg.backends:
        return None
    from specexport.trt.engine import engine_stage

    with ctx.reporter.stage(f"build and self-check the {mp.role} {precision} TensorRT engine"):
        return engine_stage(folder, io=mp.io, precision=precision, fp32_graph=fp32_graph, max_seq_len=cfg.max_seq_len,
                            max_verify_tokens=cfg.max_verify_tokens, attention=cfg.tensorrt["attention"],
                            min_tokens=min_tokens, parity_tolerance=cfg.parity_tolerance)


def plugin_graph(ctx, mp, precision: str, folder: Path, on_cpu: str, source: Path) -> dict:
    """trt.onnx beside a GPU precision's graph: attention as the tree-attention plugin node, the graph
    TensorRT engines are built from (trt/plugin_graph.py).

    The rewrite is checked where it can be checked exactly: the same rewrite of the model's fp32 graph
    (`source`), run in ONNX Runtime with the plugin op computed by the numpy reference, against the fp32
    graph, within parity_tolerance. The rewritten fp16/FP8/INT8 graph itself is only measured (top-1
    agreement and relative error against the graph it was made from, basic optimisation, fp16 as its
    CPU stand-in): the two attention implementations differ by ~1e-7, and wherever that moves a value
    across a rounding step the difference becomes a whole step and grows through the layers: 2e-7 on the
    2-layer tiny llama, 4.3e-3 on SmolLM2-135M fp16 and 9.7e-2 with FP8's 3-bit mantissa (30 layers)."""
    import onnx

    from specexport.export.validate import compare, onnx_logits, parity_case
    from specexport.plugins.trt_plugin import PLUGIN_ID
    from specexport.quant.fp16 import emulate
    from specexport.quant.quality import runtime_session
    from specexport.trt.plugin_graph import cpu_session, plugin_graph as rewrite, write_plugin_graph

    cfg = ctx.config
    case = parity_case(mp.io, max_seq_len=cfg.max_seq_len, max_verify_tokens=cfg.max_verify_tokens)
    with ctx.reporter.stage(f"write {mp.role} {precision} plugin graph for TensorRT, check the rewrite on fp32"):
        dest = write_plugin_graph(folder / "model.onnx", folder / "trt.onnx", head_dim=mp.io.head_dim)
        wiring = compare(onnx_logits(source, mp.io, case),
                         onnx_logits(None, mp.io, case, session=cpu_session(
                             rewrite(onnx.load(str(source)), head_dim=mp.io.head_dim))))
        candidate = emulate(onnx.load(str(dest))) if on_cpu != "model.onnx" else dest
        made_from = onnx_logits(None, mp.io, case, session=runtime_session(folder / on_cpu, "basic"))
        got = onnx_logits(None, mp.io, case, session=cpu_session(candidate, "basic"))
        measured = compare(made_from, got)
        agree = float(np.mean(np.concatenate([made_from[k].argmax(-1) == got[k].argmax(-1) for k in made_from])))
    if not wiring.max_rel_error <= cfg.parity_tolerance:
        raise ParityError(f"{mp.role} {precision}: the plugin rewrite of the fp32 graph disagrees with it: "
                          f"{wiring.describe()} > parity_tolerance {cfg.parity_tolerance:.1e}")
    return {"file": dest.name, "plugin": PLUGIN_ID, "made_from": "model.onnx", "attention": "plugin",
            "kv_update": "concat (plain-run contract; the engine's in-place update is not written yet)",
            "rewrite_check_fp32_max_rel_error": wiring.max_rel_error, "vs_source_max_rel_error": measured.max_rel_error,
            "vs_source_top1_agreement": agree, "reference": "tree_attention.reference (numpy)"}
