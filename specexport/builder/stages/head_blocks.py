"""EAGLE and Medusa heads on our CPU kernels (issue 46): where a target precision runs on the kernels (gguf,
or int8/int4 as blocks), the heads are built a second time with their weights as Q8_0 blocks
(quant/graph_blocks.py) and our attention, so a draft level reads a quarter of the fp32 head's bytes:
an fp32 EAGLE head's call cost a third of a SmolLM2 target step, and a round makes several.

Gates, as a quantized target's: parity of the exact twin (float activations against the blocks) with the
published heads in PyTorch run on the blocks' dequantized weights (≤ parity_tolerance); the deployed heads
(int8 activations) against the fp32 ones: the top-1 proposal at each held-out position, ≥
quality_gates.int8.min_top1 of positions equal.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from specexport import owned
from specexport.builder.context import files_entry
from specexport.errors import ParityError
from specexport.io_spec import TOPK_IDS

QTYPE, PRECISION = "Q8_0", "q8_0"
GATE = "int8"                     # quality_gates' entry the head's top-1 agreement is held to
SEQUENCES = 4


def kernel_head(ctx, hp, fp32_dir, *, parity, proposals) -> dict | None:
    """The heads as Q8_0 blocks on our kernels, checked (module docstring): their precisions entry, or
    None where no target precision runs on the kernels or the kernels do not load here (said).
    parity(twin graph, session) -> {max_rel_error, per_phase?}: the twin against PyTorch on the blocks'
    dequantized weights (`dequantized`); proposals(session) -> the top-1 ids over held-out positions."""
    from specexport.plugins import cpu
    from specexport.quant.graph_blocks import to_blocks
    from specexport.quant.quality import runtime_session

    if not ctx.model("target").config.on_kernels:
        return None
    if not cpu.status().available:
        ctx.reporter.note(f"  {hp.role} {PRECISION}: not built, the CPU kernels do not load here "
                          f"({cpu.status().line()}); the fp32 heads serve")
        return None
    partial, final = ctx.folders.new(hp.role, PRECISION)
    source, graph, twin = fp32_dir / "model.onnx", partial / "model.onnx", partial / "twin.onnx"
    start, tolerance = time.perf_counter(), ctx.config.parity_tolerance
    try:
        with ctx.reporter.stage(f"quantize the {hp.role} heads into {QTYPE} blocks on the CPU kernels"):
            made = to_blocks(source, graph, QTYPE)
            to_blocks(source, twin, QTYPE, exact=True)
        with ctx.reporter.stage(f"check the {hp.role} heads' blocks against PyTorch on their dequantized weights"):
            report = parity(twin, runtime_session(twin))
        for f in (twin, twin.with_name(twin.name + ".data")):
            f.unlink()
        if not report["max_rel_error"] <= tolerance:
            raise ParityError(f"{hp.role} {PRECISION}: parity with its blocks' dequantized weights failed: relative "
                              f"error {report['max_rel_error']:.3e} > tolerance {tolerance:.1e}")
        with ctx.reporter.stage(f"check the {hp.role} heads' {PRECISION} proposals against their fp32 ones"):
            want, got = (proposals(runtime_session(p)) for p in (source, graph))
        agreement, positions = float(np.mean(want == got)) if want.size else 1.0, int(want.size)
        gate = ctx.config.quality_gates[GATE]["min_top1"]
        ctx.reporter.note(f"  {hp.role} {PRECISION}: top-1 proposal equal to the fp32 heads' at {agreement:.3f} of "
                          f"{positions} positions, parity {report['max_rel_error']:.1e}")
        if not agreement >= gate:
            raise ParityError(f"{hp.role} {PRECISION}: its top-1 proposal equals the fp32 heads' at {agreement:.3f} of "
                              f"{positions} positions < quality_gates.{GATE}.min_top1 {gate}")
        ctx.folders.publish(partial, final)
    finally:
        owned.remove(partial)          # ours: marked when made
    return {**files_entry(ctx.out, final, ["model.onnx", "model.onnx.data"]),
            "quantization": {"scheme": "blocks", "block_types": {QTYPE: len(made["replaced"])},
                             "tool": "quant/graph_blocks.py", "kept_fp32": made["kept_fp32"],
                             "kernels": {"ops": cpu.DOMAIN, "path": cpu.status().path}},
            "parity_reference": "pytorch, the heads on their blocks' dequantized weights, float activations",
            "parity_max_rel_error": report["max_rel_error"], "parity_per_phase": report.get("per_phase", {}),
            "parity_tolerance": tolerance,
            "top1_agreement": agreement, "quality_positions": positions, "quality_reference": "the fp32 heads",
            "quality_gate": {"min_top1": gate}, "build_seconds": round(time.perf_counter() - start, 2)}


def dequantized(a: np.ndarray) -> np.ndarray:
    """A [N, K] weight as to_blocks's blocks hold it (unchanged where it stays fp32)."""
    from specexport.quant.graph_blocks import dequantized as deq, fits

    return deq(a, QTYPE) if fits(a.shape, QTYPE) else a


def eagle_checks(hp, embed, lm_head, *, case) -> dict:
    """kernel_head's parity and proposals for an EAGLE head: head_parity's rows and phases on the
    dequantized weights; each held-out sequence's rows in one call (as a head catches up)."""
    import torch

    from specexport.heads.eagle_graph import head_parity

    w, io = hp.weights, hp.io
    tensors = {k: torch.from_numpy(dequantized(v.numpy())) if v.dtype == torch.float32 and v.ndim == 2 else v
               for k, v in w.tensors.items()}
    e = dequantized(embed)
    lm = None if lm_head is None else (e if lm_head is embed else dequantized(lm_head))
    deq = dataclasses.replace(w, tensors=tensors)

    def parity(twin, session):
        return head_parity(deq, e, lm, io=io, onnx_path=twin, tokens=case["seq"], features=case["target_states"],
                           session=session)

    def proposals(session):
        ids = []
        for tokens, feats in case["sequences"]:
            S = len(feats)
            outs = session.run(None, io.feeds(np.asarray(tokens[1:S + 1], np.int64), features=feats, draft_hidden=None,
                                              positions=np.arange(S), mask=None, past=io.empty_caches()))
            ids.append(dict(zip(io.output_names, outs))[TOPK_IDS][0][:, 0])
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)

    return {"parity": parity, "proposals": proposals}
