"""GgufStage: the `gguf` precision of a model given as a GGUF file: the fp32 graph with the file's own
quantized blocks in place of its weights (quant/gguf_graph.py), nothing dequantized and quantized again.

Its gate is parity, not quality: the graph computed in fp32 (MatMulNBits accuracy_level 0, a twin of
the graph sharing its weights file) must give the fp32 graph's logits, which come from the same blocks
dequantized, within parity_tolerance; every weight of the graph must have come from the file (a weight
left fp32 fails the stage). The graph that is written multiplies as `quantization: {gguf:
{accuracy_level}}` says (default 4: int8 activations per block, as llama.cpp's kernels do): what that
changes is measured like a quantized graph's (top-1 agreement and KL against fp32, gated by
quality_gates.gguf), and a target's rows must stay independent of each other.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from specexport import owned
from specexport.build.context import eval_sequences, files_entry
from specexport.build.stage import ModelStage
from specexport.build.stages.quantize import gate_quality, measure_against
from specexport.errors import ParityError


@dataclass(frozen=True)
class GgufStage(ModelStage):
    def run(self, ctx) -> dict:
        from specexport.quant.gguf_graph import rewrite
        from specexport.quant.quality import runtime_session

        mp, cfg = ctx.model(self.role), ctx.config
        level = mp.config.quantization["gguf"]["accuracy_level"]
        source = ctx.stage_dir(f"{self.role}/fp32") / "model.onnx"
        partial, final = ctx.folders.new(self.role, self.precision)
        start = time.perf_counter()
        try:
            with ctx.reporter.stage(f"{self.role} gguf: the weights from {mp.config.gguf.name}'s own blocks"):
                hf_config = json.loads((mp.config.path / "config.json").read_text())
                report = rewrite(source, mp.config.gguf, partial / "model.onnx", hf_config=hf_config,
                                 accuracy_level=level, vocab_ids=mp.vocab_ids)
            if report.kept_fp32:
                raise ParityError(f"{self.role} gguf: {len(report.kept_fp32)} weight(s) of the graph equal no tensor of "
                                  f"{mp.config.gguf.name} ({', '.join(report.kept_fp32[:3])}): the file and the graph "
                                  f"disagree")
            with ctx.reporter.stage(f"check {self.role} gguf against the file's weights dequantized (fp32 graph)"):
                parity = _parity(ctx, mp, source, partial, level)
            if not parity.max_rel_error <= cfg.parity_tolerance:
                raise ParityError(f"{self.role} gguf: parity with the file's dequantized weights failed: "
                                  f"{parity.describe()} > tolerance {cfg.parity_tolerance:.1e}")
            reference = runtime_session(source)
            deployed = runtime_session(partial / "model.onnx")
            sequences, text = eval_sequences(ctx, mp, reference)
            with ctx.reporter.stage(f"check {self.role} gguf (accuracy_level {level}) against fp32 on {text['label']}"):
                checks = measure_against(ctx, mp, reference, deployed, sequences, source, partial / "model.onnx")
            del reference, deployed
            min_tokens = gate_quality(ctx, mp, self.precision, {"scheme": "gguf"}, checks, text)
            ctx.folders.publish(partial, final)
        finally:
            owned.remove(partial)          # ours: marked when made
        quality, rows, measured = checks
        from specexport.quant.quality import tree_rows_for

        return {**files_entry(ctx.out, final, ["model.onnx", "model.onnx.data"]),
                "quantization": {"precision": "gguf", "scheme": "gguf", "accuracy_level": level,
                                 "source": str(mp.config.gguf), "block_types": report.types(),
                                 "unmapped_tensors": report.unsupported,
                                 "tool": "quant/gguf_graph.py (MatMulNBits, GatherBlockQuantized)"},
                "gguf_file_bytes": mp.config.gguf.stat().st_size,
                "row_dependence": rows, "min_tokens": min_tokens if mp.role == "target" else 1,
                "trees": tree_rows_for(rows, "gguf") if mp.role == "target" else "exact",
                "top1_agreement": quality.top1_agreement, "top1_ties": quality.ties, "mean_kl": quality.mean_kl,
                "quality_gate": dict(cfg.quality_gates[self.precision]),
                "quality_text": {**{k: v for k, v in text.items() if k != "label"}, "sequences": quality.sequences,
                                 "positions": quality.positions},
                "parity_reference": "the GGUF file's blocks dequantized (the fp32 graph), accuracy_level 0",
                "parity_max_rel_error": parity.max_rel_error, "parity_per_phase": parity.per_phase,
                "parity_tolerance": cfg.parity_tolerance,
                "deployed_max_rel_error": measured.max_rel_error,
                "build_seconds": round(time.perf_counter() - start, 2)}


def _parity(ctx, mp, source, partial, level: int):
    """The graph computed in fp32 against the fp32 graph on the parity case (prefill, decode, a tree):
    at accuracy_level 0 through a twin graph that shares the written weights file."""
    import onnx

    from specexport.export.validate import compare, onnx_logits, parity_case

    cfg = ctx.config
    case = parity_case(mp.io, max_seq_len=cfg.max_seq_len, max_verify_tokens=cfg.max_verify_tokens)
    twin = partial / "model.onnx"
    if level != 0:
        proto = onnx.load(str(twin), load_external_data=False)
        for node in proto.graph.node:
            for attr in node.attribute:
                if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                    attr.i = 0
        twin = partial / "parity-twin.onnx"
        onnx.save(proto, str(twin))               # its initializers still name model.onnx.data
    try:
        return compare(onnx_logits(source, mp.io, case), onnx_logits(twin, mp.io, case))
    finally:
        if twin.name == "parity-twin.onnx":
            twin.unlink(missing_ok=True)
