"""BlocksStage: int8 / int4 of a Hugging Face checkpoint as ggml blocks on our CPU kernels (scheme `blocks`).

The checkpoint is written as a GGUF file quantized as llama-quantize quantizes (quant/gguf_write.py:
int8 Q8_0, int4 the Q4_K_M mix; the file's tensors are llama-quantize's bytes), then built as a lean GGUF
graph is (builder/stages/gguf.py): a weightless export filled from that file's blocks, GgufMatMul(N) on our
kernels where they run here (else ONNX Runtime's block ops, said in one line). The file stays beside the
graph (model.gguf), so llama.cpp runs the same bytes.

Gates: parity of the graph computed in fp32 (its exact twin) with transformers run from the file's
dequantized tensors; quality (top-1, KL) of the written graph against the fp32 graph, gated by
quality_gates.<precision>; row independence as every quantized target.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from specexport import owned
from specexport.builder.context import files_entry
from specexport.builder.stage import ModelStage
from specexport.builder.stages.gguf_shared import (choose_kernels, choose_layout, exact_twin, kernels_entry, lean_graph,
                                                note_layout, parity_check)
from specexport.builder.stages.quantize import gate_quality, measure_apart
from specexport.errors import ParityError, SpecexportError
from specexport.manifest import describe_files

LEVEL = 4                     # int8 activations per block, as llama.cpp multiplies


@dataclass(frozen=True)
class BlocksStage(ModelStage):
    def run(self, ctx) -> dict:
        from specexport.quant.gguf_write import write_gguf
        from specexport.quant.quality import tree_rows_for
        from specexport.runtime.backends.ort import release_freed_heap

        mp, cfg, precision = ctx.model(self.role), ctx.config, self.precision
        settings = mp.config.quantization[precision]
        mix = _mix(settings, precision, self.role)
        kernels = choose_kernels(settings["kernels"], mp.io.head_dim, f"{self.role} {precision}")
        layout, why = choose_layout(settings["layout"], kernels, f"{self.role}.quantization.{precision}")
        ctx.reporter.note(f"  {self.role} {precision}: {kernels.line()}")
        partial, final = ctx.folders.new(self.role, precision)
        start = time.perf_counter()
        try:
            gguf = partial / "model.gguf"
            importance, seen = _importance(ctx, mp, settings)
            with ctx.reporter.stage(f"write {self.role} as a GGUF file of {precision} blocks") as steps:
                written = write_gguf(mp.config.path, gguf, mix, importance=importance, steps=steps)
            del importance
            graph = partial / "model.onnx"
            report, weights = lean_graph(ctx, mp, graph, level=LEVEL, kernels=kernels.available, gguf=gguf,
                                         layout=layout)
            note_layout(ctx, f"{self.role} {precision}", layout, why=why, report=report)
            if report.kept_fp32:
                raise ParityError(f"{self.role} {precision}: {len(report.kept_fp32)} weight(s) of the graph "
                                  f"({', '.join(report.kept_fp32[:3])}) are read where no block kernel serves them")
            twin = exact_twin(graph, LEVEL)
            with ctx.reporter.stage(f"check {self.role} {precision} against its blocks dequantized (transformers)"):
                parity, _ = parity_check(ctx, mp, weights, twin=twin)
            if not parity.max_rel_error <= cfg.parity_tolerance:
                raise ParityError(f"{self.role} {precision}: parity with the GGUF's dequantized weights failed: "
                                  f"{parity.describe()} > tolerance {cfg.parity_tolerance:.1e}")
            weights.release()              # the file's pages read so far leave the RSS (export/gguf_weights.py)
            del weights
            gc.collect()
            release_freed_heap()
            twin.unlink()
            checks, text = measure_apart(ctx, mp, ctx.stage_dir(f"{mp.role}/fp32") / "model.onnx", candidate=graph,
                                         label=f"check {self.role} {precision} (blocks) against fp32")
            min_tokens = gate_quality(ctx, mp, precision, scheme=settings, checks=checks, text=text)
            ctx.folders.publish(partial, final)
        finally:
            owned.remove(partial)          # ours: marked when made
        quality, rows, measured = checks
        types = written["types"]
        return {**files_entry(ctx.out, final, ["model.onnx", "model.onnx.data"]),
                "gguf_file": {"path": str((final / "model.gguf").relative_to(ctx.out)),
                              **describe_files(ctx.out, [final / "model.gguf"]), "pre_tokenizer": written["pre"],
                              "file_type": written["file_type"]},
                "quantization": {"precision": precision, "scheme": "blocks", "mix": mix, "accuracy_level": LEVEL,
                                 "importance": seen,
                                 "block_types": {t: sum(1 for v in types.values() if v == t) for t in sorted(set(types.values()))},
                                 "tensor_types": types,
                                 "quantizer": f"quant/gguf_write.py (llama-quantize's {mix.upper()} types and bytes)",
                                 "route": "the checkpoint written as GGUF blocks, a weightless graph filled from them",
                                 "tool": "quant/gguf_graph.py (" + ("specexport.cpu GgufMatMul(N), GgufGather"
                                                                    if kernels.available else
                                                                    "MatMulNBits, GatherBlockQuantized") + ")",
                                 "kernels": kernels_entry(kernels, layout, why, report=report)},
                "row_dependence": rows, "min_tokens": min_tokens if mp.role == "target" else 1,
                "trees": tree_rows_for(rows, "blocks") if mp.role == "target" else "exact",
                "top1_agreement": quality.top1_agreement, "top1_ties": quality.ties, "mean_kl": quality.mean_kl,
                "quality_reference": "fp32",
                "quality_gate": dict(cfg.quality_gates[precision]),
                "quality_text": {**{k: v for k, v in text.items() if k != "label"}, "sequences": quality.sequences,
                                 "positions": quality.positions},
                "parity_reference": "transformers, layer by layer from the GGUF's dequantized tensors, accuracy_level 0",
                "parity_max_rel_error": parity.max_rel_error, "parity_per_phase": parity.per_phase,
                "parity_tolerance": cfg.parity_tolerance,
                "deployed_max_rel_error": measured.max_rel_error,
                "build_seconds": round(time.perf_counter() - start, 2)}


def _mix(settings: dict, precision: str, role: str) -> str:
    from specexport.quant.gguf_write import PRECISION_MIXES

    mixes = PRECISION_MIXES[precision]
    mix = mixes[0] if settings["mix"] == "auto" else settings["mix"]
    if mix not in mixes:
        raise SpecexportError(f"{role}.quantization.{precision}.mix: {mix!r} makes another precision; "
                              f"{precision} takes {', '.join(mixes)}")
    return mix


def _importance(ctx, mp, settings: dict) -> tuple[dict | None, dict | str]:
    """The imatrix `importance: imatrix` asks for (quant/imatrix.py, on the calibration sequences a static
    scheme would take) and what it was collected on; (None, "none") otherwise."""
    if settings["importance"] != "imatrix":
        return None, "none"
    from specexport.builder.stages.quantize import calibration_sequences
    from specexport.quant.imatrix import collect
    from specexport.quant.quality import runtime_session

    sequences, on = calibration_sequences(ctx, mp, runtime_session(ctx.stage_dir(f"{mp.role}/fp32") / "model.onnx"))
    with ctx.reporter.stage(f"collect {mp.role}'s importance matrix (PyTorch, {len(sequences)} sequences)") as steps:
        importance = collect(mp.config.path, sequences, steps=steps)
    return importance, {"method": "imatrix (mean squared activation per input column)", "sequences": len(sequences),
                        "tokens": int(sum(len(s) for s in sequences)), **on}
