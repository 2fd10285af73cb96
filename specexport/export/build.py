"""Run a planned build per model: fp32 export -> parity check against PyTorch, then each quantized
precision made from that fp32 graph -> quality gate against it; then the manifest.

Atomicity: the old manifest is removed before any stage rewrites files; each stage writes into a
hidden `.partial` folder that is renamed into place only after its gate passes; the manifest is
written last (atomically). An interrupted or failed build therefore never leaves a manifest that
points at partial or missing files. Stages whose fingerprint is unchanged are reused (`force` redoes
them); a model whose fp32 graph was rebuilt has its quantized graphs rebuilt too.
"""
from __future__ import annotations

import gc
import os
import platform
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from specexport import __version__
from specexport.errors import ParityError
from specexport.export.plan import ModelPlan, Plan, tool_versions
from specexport.manifest import (MANIFEST_NAME, SCHEMA_VERSION, describe_files, files_intact,
                                 read_manifest, write_json_atomic)


@dataclass
class StageResult:
    role: str
    precision: str
    entry: dict          # the manifest's models[role].precisions[precision]
    skipped: bool


class Reporter:
    """Progress lines per stage (rich console). Tests pass `quiet=True`."""

    def __init__(self, *, quiet: bool = False):
        self.quiet = quiet
        if not quiet:
            from rich.console import Console

            self.console = Console(stderr=True)

    @contextmanager
    def stage(self, label: str):
        start = time.perf_counter()
        if self.quiet:
            yield
            return
        with self.console.status(f"[bold]{label}[/] ..."):
            yield
        self.console.print(f"[green]✓[/] {label} [dim]({time.perf_counter() - start:.1f} s)[/]")

    def note(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text)


def run_build(plan: Plan, *, force: bool = False, reporter: Reporter | None = None) -> dict:
    """Build everything in `plan`; returns the manifest that was written."""
    reporter = reporter or Reporter(quiet=True)
    out = plan.config.output
    out.mkdir(parents=True, exist_ok=True)
    previous = _previous_manifest(out)
    manifest_path = out / MANIFEST_NAME
    results = []
    for mp in plan.models:
        old = previous.get("models", {}).get(mp.role, {})
        fp32_rebuilt, samples = False, {}
        for precision in mp.config.precisions:              # fp32 first: the others are made from it
            entry = old.get("precisions", {}).get(precision)
            stage_fp = plan.stage_fingerprint(mp, precision)
            if (not force and not fp32_rebuilt and entry and old.get("fingerprint") == mp.fingerprint
                    and entry.get("stage_fingerprint", mp.fingerprint) == stage_fp
                    and files_intact(out, entry["files"])):
                reporter.note(f"[dim]- {mp.role} {precision}: unchanged, reused[/]")
                results.append(StageResult(mp.role, precision, entry, skipped=True))
                continue
            manifest_path.unlink(missing_ok=True)       # from here on the old manifest may lie
            if precision == "fp32":
                results.append(_export_stage(plan, mp, precision, reporter))
                fp32_rebuilt = True
            else:
                results.append(_quantize_stage(plan, mp, precision, reporter, samples))
            results[-1].entry["stage_fingerprint"] = stage_fp
    with reporter.stage("copy tokenizer"):
        _copy_tokenizer(plan, out)
    manifest = _manifest(plan, results)
    write_json_atomic(manifest_path, manifest)
    return manifest


# Checkpoints above this size export in a child process: torch.onnx.export keeps about one extra copy
# of the weights alive in the exporting process (measured: ~1 GB retained after exporting a 490 MiB
# Llama), which would otherwise add to the parity check's ONNX Runtime copy.
SUBPROCESS_EXPORT_BYTES = 64 * 2**20


def _export_stage(plan: Plan, mp: ModelPlan, precision: str, reporter: Reporter) -> StageResult:
    from specexport.export.to_onnx import load_hf_model
    from specexport.export.validate import compare, onnx_logits, parity_case, reference_logits

    out = plan.config.output
    final = out / mp.role / precision
    partial = out / mp.role / f".{precision}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    start = time.perf_counter()
    try:
        with reporter.stage(f"export {mp.role} {precision} ({mp.config.path.name}, {mp.arch.model_type}) to ONNX"):
            names = _run_export(mp, partial / "model.onnx")
        with reporter.stage(f"check {mp.role} {precision} against PyTorch"):
            case = parity_case(mp.io, max_seq_len=plan.config.max_seq_len,
                               max_verify_tokens=plan.config.max_verify_tokens)
            reference = reference_logits(load_hf_model(mp.config.path), case)
            gc.collect()                   # free the PyTorch weights before ORT loads its copy
            report = compare(reference, onnx_logits(partial / "model.onnx", mp.io, case))
        tolerance = plan.config.parity_tolerance
        if not report.max_rel_error <= tolerance:
            raise ParityError(f"{mp.role} {precision}: parity check failed: {report.describe()} "
                              f"> tolerance {tolerance:.1e}")
        _publish(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    entry = {
        **_files_entry(out, final, names),
        "parity_reference": "pytorch",
        "parity_max_rel_error": report.max_rel_error,
        "parity_per_phase": report.per_phase,
        "parity_tolerance": tolerance,
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    return StageResult(mp.role, precision, entry, skipped=False)


def _publish(partial: Path, final: Path) -> None:
    """Move a stage's checked output into place (the old folder goes first)."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)


def _files_entry(out: Path, final: Path, names: list[str]) -> dict:
    files = [final / name for name in names]
    return {"backend": "onnxruntime", "files": describe_files(out, files),
            "size_bytes": sum(f.stat().st_size for f in files)}


def _quantize_stage(plan: Plan, mp: ModelPlan, precision: str, reporter: Reporter, samples: dict) -> StageResult:
    """Quantize the model's fp32 graph, check it against that graph (quality gate), rename into place.

    `samples` caches this model's eval sequences between its quantized precisions."""
    from specexport.export.quality import measure_quality, runtime_session
    from specexport.export.quantize import QUANTIZERS, describe, quantize_graph
    from specexport.export.to_onnx import check_graph_io
    from specexport.export.validate import compare, onnx_logits, parity_case

    out = plan.config.output
    source = out / mp.role / "fp32" / "model.onnx"
    final = out / mp.role / precision
    partial = out / mp.role / f".{precision}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    start = time.perf_counter()
    gate, settings = plan.config.quality_gates[precision], QUANTIZERS[precision]
    try:
        with reporter.stage(f"quantize {mp.role} {precision} from fp32 "
                            f"(MatMulNBits {settings['bits']}-bit, block {settings['block_size']})"):
            names = [f.name for f in quantize_graph(source, partial / "model.onnx", precision)]
            check_graph_io(partial / "model.onnx", mp.io)
        reference, quantized = runtime_session(source), runtime_session(partial / "model.onnx")
        sequences, text = _eval_sequences(plan, mp, reference, reporter, samples)
        with reporter.stage(f"check {mp.role} {precision} against fp32 on {text['label']}"):
            quality = measure_quality(reference, quantized, mp.io, sequences)
            case = parity_case(mp.io, max_seq_len=plan.config.max_seq_len,
                               max_verify_tokens=plan.config.max_verify_tokens)
            parity = compare(onnx_logits(source, mp.io, case, session=reference),
                             onnx_logits(partial / "model.onnx", mp.io, case, session=quantized))
        del reference, quantized
        failures = quality.failures(gate)
        if failures:
            raise ParityError(f"{mp.role} {precision}: quality gate against fp32 failed: {'; '.join(failures)}. "
                              f"Measured {quality.describe()}, on {text['description']}. The gate is "
                              f"quality_gates.{precision} in the model.yaml")
        reporter.note(f"  {mp.role} {precision}: {quality.describe()}")
        _publish(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    entry = {
        **_files_entry(out, final, names),
        "quantization": describe(precision),
        "top1_agreement": quality.top1_agreement,
        "mean_kl": quality.mean_kl,
        "quality_gate": dict(gate),
        "quality_text": {**{k: v for k, v in text.items() if k != "label"}, "sequences": quality.sequences,
                         "positions": quality.positions},
        "parity_reference": "fp32",
        "parity_max_rel_error": parity.max_rel_error,
        "parity_per_phase": parity.per_phase,
        "parity_tolerance": None,          # not gated: the quality gate decides for quantized graphs
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    return StageResult(mp.role, precision, entry, skipped=False)


def _eval_sequences(plan: Plan, mp: ModelPlan, fp32_session, reporter: Reporter, samples: dict):
    """The quality gate's token sequences and a record of where they came from (for the manifest)."""
    from specexport.export.quality import (EVAL_LENGTH, SAMPLE_SEED, SAMPLE_TEMPERATURE, sampled_sequences,
                                           text_sequences)

    length = min(EVAL_LENGTH, plan.config.max_seq_len)
    bos = mp.arch.bos_token_id
    if plan.eval_ids is not None:
        text = {"source": "eval_text", "path": str(plan.config.eval_text), "tokens": len(plan.eval_ids),
                "description": f"eval_text {plan.config.eval_text}", "label": f"eval_text {plan.config.eval_text.name}"}
        return text_sequences(plan.eval_ids, bos=bos, length=length), text
    if "sequences" not in samples:
        with reporter.stage(f"sample eval sequences from the {mp.role} fp32 graph"):
            samples["sequences"] = sampled_sequences(fp32_session, mp.io, start=bos, length=length)
    text = {"source": "sampled", "seed": SAMPLE_SEED, "temperature": SAMPLE_TEMPERATURE,
            "description": f"sequences sampled from the {mp.role} fp32 graph (no eval_text; seed {SAMPLE_SEED}, "
                           f"temperature {SAMPLE_TEMPERATURE})", "label": "sampled sequences"}
    return samples["sequences"], text


def _run_export(mp: ModelPlan, onnx_path: Path) -> list[str]:
    weights = sum(p.stat().st_size for p in mp.config.path.iterdir() if p.suffix in (".safetensors", ".bin"))
    if weights <= SUBPROCESS_EXPORT_BYTES:
        return export_model(mp, onnx_path)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(export_model, mp, onnx_path).result()      # exceptions re-raise here


def export_model(mp: ModelPlan, onnx_path: Path) -> list[str]:
    """Load the checkpoint, wrap it and export it; returns the names of the files written."""
    from specexport.export.registry import get_adapter
    from specexport.export.to_onnx import load_hf_model, onnx_from_module
    from specexport.export.wrapper import StaticKVDecoder

    module = StaticKVDecoder(load_hf_model(mp.config.path), get_adapter(mp.arch.model_type), mp.arch,
                             aux_hidden_layers=mp.io.aux_hidden_layers)
    return [f.name for f in onnx_from_module(module, mp.io, onnx_path)]


def _copy_tokenizer(plan: Plan, out: Path) -> None:
    dest = out / "tokenizer"
    partial = out / ".tokenizer.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in plan.tokenizer_files:
        shutil.copy2(f, partial / f.name)
    if not (partial / "tokenizer.json").is_file():
        # The runtime reads tokenizer.json with the `tokenizers` library; slow tokenizers are converted.
        from specexport._optional import require

        require("transformers").AutoTokenizer.from_pretrained(plan.target.config.path).save_pretrained(partial)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)


def _previous_manifest(out: Path) -> dict:
    try:
        return read_manifest(out)
    except Exception:       # no manifest or an unreadable one: nothing can be reused
        return {}


def _manifest(plan: Plan, results: list[StageResult]) -> dict:
    cfg = plan.config
    models = {}
    for mp in plan.models:
        models[mp.role] = {
            "source": str(mp.config.path),
            "model_type": mp.arch.model_type,
            "fingerprint": mp.fingerprint,
            "vocab_size": mp.arch.vocab_size,
            "max_seq_len": cfg.max_seq_len,
            "max_verify_tokens": cfg.max_verify_tokens,
            "special_tokens": {"bos_token_id": mp.arch.bos_token_id, "eos_token_ids": list(mp.eos_token_ids),
                               "pad_token_id": mp.arch.pad_token_id},
            "io": mp.io.to_dict(),
            "precisions": {r.precision: r.entry for r in results if r.role == mp.role},
        }
    return {
        "schema_version": SCHEMA_VERSION,
        "specexport_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "name": cfg.name,
        "config": cfg.to_dict(),
        "max_seq_len": cfg.max_seq_len,
        "max_verify_tokens": cfg.max_verify_tokens,
        "tokenizer": {"dir": "tokenizer", "files": sorted(p.name for p in (cfg.output / "tokenizer").iterdir())},
        "special_tokens": plan.special_tokens,
        "models": models,
        "versions": {**tool_versions(), "python": platform.python_version(), "specexport": __version__},
    }
