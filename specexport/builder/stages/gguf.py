"""GgufStage: the `gguf` precision of a model given as a GGUF file: the fp32 graph with the file's own
quantized blocks in place of its weights (quant/gguf_graph.py), nothing dequantized and quantized again.

Its gate is parity, not quality: the graph computed in fp32 (MatMulNBits accuracy_level 0, a twin of
the graph sharing its weights file) must give the fp32 graph's logits, which come from the same blocks
dequantized, within parity_tolerance; every weight of the graph must have come from the file (a weight
left fp32 fails the stage). The graph that is written multiplies as `quantization: {gguf:
{accuracy_level}}` says (default 4: int8 activations per block, as llama.cpp's kernels do): what that
changes is measured like a quantized graph's (top-1 agreement and KL against fp32, gated by
quality_gates.gguf), and a target's rows must stay independent of each other.

Lean (a GGUF model whose precisions leave out fp32): no fp32 graph at all. The graph is exported
without weights and filled from the file by name (export/lean.py, quant/gguf_fill.fill); the parity
reference is transformers' model run one layer at a time from the file's dequantized tensors
(export/gguf_reference.py); the quality figures compare the written graph with its accuracy_level-0
twin (the same blocks computed in fp32, which the parity check has just tied to the reference).
"""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

from specexport import owned
from specexport.builder.context import eval_sequences, files_entry
from specexport.builder.stage import ModelStage
from specexport.builder.stages.gguf_shared import (choose_kernels, choose_layout, exact_twin, kernels_entry, lean_graph,
                                                note_layout, parity_check)
from specexport.builder.stages.quantize import gate_quality, measure_against, row_checks, spill
from specexport.errors import ParityError


@dataclass(frozen=True)
class GgufStage(ModelStage):
    def run(self, ctx) -> dict:
        from specexport.quant.quality import runtime_session, tree_rows_for

        mp, cfg = ctx.model(self.role), ctx.config
        level = mp.config.quantization["gguf"]["accuracy_level"]
        lean = mp.config.lean
        kernels = choose_kernels(mp.config.quantization["gguf"]["kernels"], mp.io.head_dim, self.role)
        layout, why = choose_layout(mp.config.quantization["gguf"]["layout"], kernels, f"{self.role}.quantization.gguf")
        ctx.reporter.note(f"  {self.role} gguf: {kernels.line()}")
        partial, final = ctx.folders.new(self.role, self.precision)
        start = time.perf_counter()
        try:
            graph = partial / "model.onnx"
            report, source = (lean_graph if lean else _rewritten_graph)(ctx, mp, graph, level=level,
                                                                         kernels=kernels.available, layout=layout)
            note_layout(ctx, f"{self.role} gguf", layout, why=why, report=report)
            if report.kept_fp32:
                why = (f"are quantized in {mp.config.gguf.name} but read where no block kernel serves them" if lean
                       else f"equal no tensor of {mp.config.gguf.name}: the file and the graph disagree")
                raise ParityError(f"{self.role} gguf: {len(report.kept_fp32)} weight(s) of the graph "
                                  f"({', '.join(report.kept_fp32[:3])}) {why}")
            twin = exact_twin(graph, level)
            with ctx.reporter.stage(f"check {self.role} gguf against the file's weights dequantized "
                                    f"({'transformers, layer by layer' if lean else 'fp32 graph'})"):
                parity, twin_case = parity_check(ctx, mp, source, twin=twin)
            if not parity.max_rel_error <= cfg.parity_tolerance:
                raise ParityError(f"{self.role} gguf: parity with the file's dequantized weights failed: "
                                  f"{parity.describe()} > tolerance {cfg.parity_tolerance:.1e}")
            if lean:
                source = None              # the file's memory map goes: its pages count in the peak RSS
                gc.collect()
                checks, text = _measure_lean(ctx, mp, graph, twin=twin, twin_case=twin_case, level=level)
            else:
                reference, deployed = runtime_session(source), runtime_session(graph)
                sequences, text = eval_sequences(ctx, mp, reference)
                with ctx.reporter.stage(f"check {self.role} gguf (accuracy_level {level}) against fp32 on "
                                        f"{text['label']}"):
                    checks = measure_against(ctx, mp, reference, quantized=deployed, sequences=sequences,
                                             source=source, candidate=graph)
                del reference, deployed
            if twin != graph:
                twin.unlink()
            min_tokens = gate_quality(ctx, mp, self.precision, scheme={"scheme": "gguf"}, checks=checks, text=text)
            ctx.folders.publish(partial, final)
        finally:
            owned.remove(partial)          # ours: marked when made
        quality, rows, measured = checks
        return {**files_entry(ctx.out, final, ["model.onnx", "model.onnx.data"]),
                "quantization": {"precision": "gguf", "scheme": "gguf", "accuracy_level": level,
                                 "source": str(mp.config.gguf), "block_types": report.types(),
                                 "unmapped_tensors": report.unsupported,
                                 "route": "lean: a weightless graph filled from the file by name" if lean else
                                          "the fp32 graph's weights replaced by the file's blocks",
                                 "tool": "quant/gguf_graph.py (" + ("specexport.cpu GgufMatMul(N), GgufGather"
                                                                    if kernels.available else
                                                                    "MatMulNBits, GatherBlockQuantized") + ")",
                                 "kernels": kernels_entry(kernels, layout, why, report=report)},
                "gguf_file_bytes": mp.config.gguf.stat().st_size,
                "row_dependence": rows, "min_tokens": min_tokens if mp.role == "target" else 1,
                "trees": tree_rows_for(rows, "gguf") if mp.role == "target" else "exact",
                "top1_agreement": quality.top1_agreement, "top1_ties": quality.ties, "mean_kl": quality.mean_kl,
                "quality_reference": "accuracy_level 0 (the same blocks in fp32)" if lean else "fp32",
                "quality_gate": dict(cfg.quality_gates[self.precision]),
                "quality_text": {**{k: v for k, v in text.items() if k != "label"}, "sequences": quality.sequences,
                                 "positions": quality.positions},
                "parity_reference": ("transformers, layer by layer from the file's dequantized tensors" if lean else
                                     "the GGUF file's blocks dequantized (the fp32 graph)") + ", accuracy_level 0",
                "parity_max_rel_error": parity.max_rel_error, "parity_per_phase": parity.per_phase,
                "parity_tolerance": cfg.parity_tolerance,
                "deployed_max_rel_error": measured.max_rel_error,
                "build_seconds": round(time.perf_counter() - start, 2)}


def _rewritten_graph(ctx, mp, graph, *, level, kernels: bool, layout: str = "file"):
    """The fp32 graph with the file's blocks in place of its weights (matched by content), on our kernels
    in `layout` or on the stock ops."""
    from specexport.quant.gguf_graph import rewrite

    source = ctx.stage_dir(f"{mp.role}/fp32") / "model.onnx"
    with ctx.reporter.stage(f"{mp.role} gguf: the weights from {mp.config.gguf.name}'s own blocks"):
        hf_config = json.loads((mp.config.path / "config.json").read_text())
        report = rewrite(source, mp.config.gguf, graph, hf_config=hf_config, accuracy_level=level,
                         vocab_ids=mp.vocab_ids, kernels=kernels, layout=layout)
    return report, source


def _measure_lean(ctx, mp, graph: Path, *, twin: Path, twin_case: dict, level: int):
    """measure_against's figures with one session at a time (a 3B's two sessions at once were most of
    the lean build's peak): the written graph first (its eval sequences sampled from it when there is
    no eval_text: level 4 decodes 3-4x faster than the twin), its logits kept on disk (4 x 128 positions
    of a 152k vocabulary are 311 MB); then the level-0 twin, a sequence at a time."""
    from specexport.export.validate import compare, parity_case
    from specexport.quant.quality import SpilledLogits, measure_quality, runtime_session
    from specexport.runtime.backends.ort import release_freed_heap

    case = parity_case(mp.io, max_seq_len=ctx.config.max_seq_len, max_verify_tokens=ctx.config.max_verify_tokens)
    deployed = runtime_session(graph)
    sequences, text = eval_sequences(ctx, mp, deployed, graph="gguf graph")
    with ctx.reporter.stage(f"check {mp.role} gguf (accuracy_level {level}) against accuracy_level 0 on "
                            f"{text['label']}"):
        rows = row_checks(deployed, mp.io, sequences[0])
        with SpilledLogits() as written:
            written_case = spill(deployed, graph, mp.io, sequences=sequences, case=case, into=written)
            del deployed
            release_freed_heap()
            reference = runtime_session(twin)
            quality = measure_quality(reference, written, mp.io, sequences=sequences)
            del reference
        release_freed_heap()
    return (quality, rows, compare(twin_case, written_case)), text
