"""QuantizeStage: a quantized graph of a model, made from its fp32 graph (quant/quantize.py) and gated
against it on held-out text: top-1 agreement and mean KL (quality_gates), and for a target, every
token's logits independent of the other tokens of its pass (else verification would disagree with
decoding). GPU precisions also get their TensorRT plugin graph and, with `backends: [tensorrt]`, engine."""
from __future__ import annotations

import time
from dataclasses import dataclass

from specexport import owned
from specexport.builder.context import eval_sequences, files_entry
from specexport.builder.stage import ModelStage
from specexport.config import GPU_PRECISIONS
from specexport.errors import ParityError

CALIBRATION_SEQUENCES = 8


@dataclass(frozen=True)
class QuantizeStage(ModelStage):
    def run(self, ctx) -> dict:
        from specexport.export.to_onnx import check_graph_io
        from specexport.quant.ptq import ORT_OPTIMIZATION
        from specexport.quant.quality import runtime_session
        from specexport.quant.quantize import CALIBRATED, MODELOPT, cpu_graph, describe, quantize_graph

        mp, precision = ctx.model(self.role), self.precision
        source = ctx.stage_dir(f"{self.role}/fp32") / "model.onnx"
        partial, final = ctx.folders.new(self.role, precision)
        start = time.perf_counter()
        scheme = mp.config.quantization[precision]
        options = ", ".join(f"{k} {v}" for k, v in scheme.items() if k != "scheme")
        try:
            reference = runtime_session(source)
            sequences, text = eval_sequences(ctx, mp, reference)
            calibration, calibrated_on, feeds = [], {}, []
            if scheme["scheme"] in CALIBRATED:
                calibration, calibrated_on = calibration_sequences(ctx, mp, reference)
            if scheme["scheme"] in MODELOPT:
                from specexport.quant.feeds import runtime_feeds

                feeds, record = runtime_feeds(reference, mp.io, calibration)
                calibrated_on.update(record)
            with ctx.reporter.stage(f"quantize {mp.role} {precision} from fp32 ({scheme['scheme']}"
                                    f"{', ' + options if options else ''})"):
                names = [f.name for f in quantize_graph(source, partial / "model.onnx", precision, scheme=scheme,
                                                        io=mp.io, calibration=calibration, feeds=feeds)]
                check_graph_io(partial / "model.onnx", mp.io)
            optimization, on_cpu = ORT_OPTIMIZATION.get(precision, "all"), cpu_graph(scheme)
            check_graph_io(partial / on_cpu, mp.io)
            quantized = runtime_session(partial / on_cpu, optimization=optimization)
            with ctx.reporter.stage(f"check {mp.role} {precision} against fp32 on {text['label']}"):
                checks = measure_against(ctx, mp, reference, quantized=quantized, sequences=sequences, source=source,
                                         candidate=partial / on_cpu)
            del reference, quantized
            min_tokens = gate_quality(ctx, mp, precision, scheme=scheme, checks=checks, text=text)
            extras = _gpu_extras(ctx, mp, precision, partial=partial, on_cpu=on_cpu, source=source,
                                 min_tokens=min_tokens)
            names += extras.pop("files")
            ctx.folders.publish(partial, final)
        finally:
            owned.remove(partial)          # ours: marked when made
        quality, rows, parity = checks
        from specexport.quant.quality import tree_rows_for

        return {**files_entry(ctx.out, final, names),
                "quantization": describe(precision, scheme, calibration_sequences=len(calibration),
                                         calibration=calibrated_on),
                "ort_optimization": optimization,      # the session's graph optimisation level (runtime: OrtBackend)
                **({"cpu_graph": on_cpu} if on_cpu != "model.onnx" else {}),   # what ORT CPU runs (gate, runtime)
                **({"instead_of_blocks": dict(mp.instead_of_blocks)[precision]}
                   if precision in dict(mp.instead_of_blocks) else {}),
                **extras,
                "row_dependence": rows,
                "min_tokens": min_tokens if mp.role == "target" else 1,   # the runtime pads smaller target calls
                "trees": tree_rows_for(rows, scheme["scheme"]) if mp.role == "target" else "exact",
                "top1_agreement": quality.top1_agreement, "top1_ties": quality.ties, "mean_kl": quality.mean_kl,
                "quality_gate": dict(ctx.config.quality_gates[precision]),
                "quality_text": {**{k: v for k, v in text.items() if k != "label"}, "sequences": quality.sequences,
                                 "positions": quality.positions},
                "parity_reference": "fp32", "parity_max_rel_error": parity.max_rel_error,
                "parity_per_phase": parity.per_phase,
                "parity_tolerance": None,          # not gated: the quality gate decides for quantized graphs
                "build_seconds": round(time.perf_counter() - start, 2)}


def measure_against(ctx, mp, reference, *, quantized, sequences, source, candidate):
    """(quality against fp32, row dependence of one- and two-token passes, logits error on the parity case)."""
    from specexport.export.validate import compare, onnx_logits, parity_case
    from specexport.quant.quality import measure_quality

    cfg = ctx.config
    quality = measure_quality(reference, quantized, mp.io, sequences=sequences)
    rows = row_checks(quantized, mp.io, sequences[0])
    case = parity_case(mp.io, max_seq_len=cfg.max_seq_len, max_verify_tokens=cfg.max_verify_tokens)
    parity = compare(onnx_logits(source, mp.io, case, session=reference),
                     onnx_logits(candidate, mp.io, case, session=quantized))
    return quality, rows, parity


def measure_apart(ctx, mp, source, *, candidate, label: str):
    """measure_against's figures (and the eval text's record) with one session open at a time: the fp32
    graph's (the eval sequences sampled from it when there is no eval_text; its logits kept on disk), closed
    before the candidate's opens. Why: both open at once were a large model's build peak (Qwen 1.5B: the
    7.1 GB fp32 graph and the 1.1 GB int4 one together)."""
    from specexport.export.validate import compare, onnx_logits, parity_case
    from specexport.quant.quality import SpilledLogits, measure_quality, runtime_session
    from specexport.runtime.backends.ort import release_freed_heap

    case = parity_case(mp.io, max_seq_len=ctx.config.max_seq_len, max_verify_tokens=ctx.config.max_verify_tokens)
    reference = runtime_session(source)
    sequences, text = eval_sequences(ctx, mp, reference)
    with ctx.reporter.stage(f"{label} on {text['label']}"), SpilledLogits() as expected:
        expected_case = spill(reference, source, mp.io, sequences=sequences, case=case, into=expected)
        del reference
        release_freed_heap()
        deployed = runtime_session(candidate)
        quality = measure_quality(expected, deployed, mp.io, sequences=sequences)
        rows = row_checks(deployed, mp.io, sequences[0])
        parity = compare(expected_case, onnx_logits(candidate, mp.io, case, session=deployed))
        del deployed
    release_freed_heap()
    return (quality, rows, parity), text


def spill(session, path, io, *, sequences, case, into) -> dict:
    """`session`'s prefill logits of each sequence appended to `into` (quant/quality.SpilledLogits) and its
    logits on the parity case (`path`: its graph): what a session is kept for when the one it is measured
    against opens after it closes."""
    from specexport.export.validate import onnx_logits
    from specexport.quant.quality import prefill_logits

    for ids in sequences:
        into.append(prefill_logits(session, io, ids))
    return onnx_logits(path, io, case, session=session)


def row_checks(session, io, ids) -> dict:
    """How a token's logits depend on the other rows of its pass: one- and two-token passes, a tree's
    sibling (quant/quality.py)."""
    from specexport.quant.quality import row_dependence, sibling_row_dependence

    return {"one_token": row_dependence(session, io, ids, last=1), "two_tokens": row_dependence(session, io, ids, last=2),
            "siblings": sibling_row_dependence(session, io, ids)}


def gate_quality(ctx, mp, precision: str, *, scheme: dict, checks, text: dict) -> int:
    """Raise ParityError when the quality gate or (a target's) row independence fails; the smallest call
    the runtime makes on this graph (min_tokens)."""
    from specexport.quant.quality import ROW_TOLERANCE, min_tokens_for, tree_rows_for

    quality, rows, _ = checks
    failures = quality.failures(ctx.config.quality_gates[precision])
    if failures:
        raise ParityError(f"{mp.role} {precision}: quality gate against fp32 failed: {'; '.join(failures)}. "
                          f"Measured {quality.describe()}, on {text['description']}. The gate is "
                          f"quality_gates.{precision} in the model.yaml")
    min_tokens = min_tokens_for(rows, scheme["scheme"])
    if mp.role == "target" and rows["two_tokens"] > ROW_TOLERANCE:
        raise ParityError(f"target {precision} ({scheme['scheme']}): a token's logits depend on the other tokens "
                          f"of the same pass (relative {rows['two_tokens']:.1e} > {ROW_TOLERANCE:.0e}), so "
                          f"verifying several tokens would disagree with decoding and speculative output would "
                          f"differ from this graph's own vanilla output. Choose another "
                          f"quantization.{precision}.scheme for the target (a draft may keep it: "
                          f"draft: {{quantization: ...}})")
    chains = mp.role == "target" and tree_rows_for(rows, scheme["scheme"]) == "chains"
    ctx.reporter.note(f"  {mp.role} {precision}: {quality.describe()}, row dependence {rows['two_tokens']:.1e}"
                      + (f" (one-token passes {rows['one_token']:.1e}: run with 2 rows or more)"
                         if min_tokens > 1 and mp.role == "target" else "")
                      + (f" (a tree's sibling rows {rows['siblings']:.1e}: trees are verified as chains)"
                         if chains else ""))
    return min_tokens


def _gpu_extras(ctx, mp, precision, *, partial, on_cpu, source, min_tokens) -> dict:
    """A GPU precision's plugin graph and engine entries ({"files": [...]} plus their records)."""
    from specexport.builder.stages.engines import engine, plugin_graph

    if precision not in GPU_PRECISIONS:
        return {"files": []}
    plugin = plugin_graph(ctx, mp, precision, partial, on_cpu, source)
    built = engine(ctx, mp, precision, partial, source, min_tokens if mp.role == "target" else 1)
    files = [plugin["file"], *(built.pop("files") if built else [])]
    return {"files": files, "plugin_graph": plugin, **({"engine": built} if built else {})}


def calibration_sequences(ctx, mp, fp32_session) -> tuple[list, dict]:
    """Activation-range calibration data for static quantization and where it came from: the chunks of
    calibration_text; else eval_text's tokens after the ones the quality gate reads; else sequences
    sampled from the fp32 graph with another seed than the gate's. The gate stays on data the
    calibration never saw."""
    from specexport.quant.quality import EVAL_LENGTH, EVAL_SEQUENCES, SAMPLE_SEED, sampled_sequences, text_sequences

    plan = ctx.plan
    length, bos = min(EVAL_LENGTH, plan.config.max_seq_len), mp.arch.bos_token_id
    if plan.calibration_ids is not None:
        return (text_sequences(plan.calibration_ids, bos=bos, length=length, count=CALIBRATION_SEQUENCES),
                {"source": "calibration_text", "path": str(plan.config.calibration_text)})
    if plan.eval_ids is not None:
        rest = plan.eval_ids[EVAL_SEQUENCES * (length - (bos is not None)):]
        chunks = text_sequences(rest, bos=bos, length=length, count=CALIBRATION_SEQUENCES)
        if chunks:
            return chunks, {"source": "eval_text, after the tokens the quality gate reads",
                            "path": str(plan.config.eval_text)}
    seqs = sampled_sequences(fp32_session, mp.io, start=bos, ids=mp.vocab_ids, length=length,
                             count=CALIBRATION_SEQUENCES, seed=SAMPLE_SEED + 1)
    return seqs, {"source": "sampled from the fp32 graph", "seed": SAMPLE_SEED + 1}
