"""Run a planned build per model: fp32 export -> parity check against PyTorch, then each quantized
precision made from that fp32 graph -> quality gate against it; then the tokenizer and the manifest.

A build never loses a working output. It holds the output folder's lock throughout. Each stage
writes into a hidden `.partial` folder, renamed to a fresh `<role>/<precision>-<id>` folder once its
gate passes, beside the folders the current manifest points at; the manifest is replaced (atomically)
only when every stage passed. A rebuild that fails its gate, is interrupted or is killed therefore
leaves the previous build loadable and decoding as before. Folders no manifest points at (a failed
or killed build's, a replaced build's; only folders the build marked as its own, see outdir.py) are
removed after the manifest is written and when the next build starts. Stages whose fingerprint is unchanged are reused (`force` redoes them); a model whose
fp32 graph was rebuilt has its quantized graphs rebuilt too.
"""
from __future__ import annotations

import dataclasses
import gc
import platform
import secrets
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from specexport import __version__
from specexport.errors import ParityError, SpecexportError
from specexport.config import GPU_PRECISIONS
from specexport.export.eagle_stage import eagle_stage
from specexport.export.medusa_stage import medusa_stage
from specexport.export.plan import ModelPlan, Plan, tool_versions
from specexport import owned
from specexport.locking import output_lock, work_dir
from specexport.export.outdir import (StageFolders, adopt_previous, check_output, remove_unreferenced,
                                      reusable_tokenizer, tokenizer_digest)
from specexport.gamma import carried_gamma_choices
from specexport.manifest import (MANIFEST_NAME, SCHEMA_VERSION, describe_files, files_intact, read_manifest,
                                 sha256_file, write_json_atomic)


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
    check_output(out)
    with output_lock(out, purpose="specexport build"):
        previous = _previous_manifest(out, reporter)
        adopt_previous(out, previous)                      # a pre-marker build's folders, as its manifest lists
        _, left = remove_unreferenced(out, previous)       # what failed or killed builds left behind
        folders = StageFolders(out)
        try:
            results, plan = _run_stages(plan, previous, force, folders, reporter)   # plan: with measured vocab ids
            heads = {hp.role: (eagle_stage if hp.role == "eagle" else medusa_stage)(plan, hp, previous, force, folders,
                                                                                  reporter, results)
                     for hp in plan.heads}
            with reporter.stage("copy tokenizer"):
                tokenizer = _tokenizer_stage(plan, out, previous, folders)
            manifest = _manifest(plan, results, tokenizer, previous, heads)
            write_json_atomic(out / MANIFEST_NAME, manifest, tmp_dir=work_dir(out))   # the one step that
        except BaseException:                                                        # switches builds
            folders.discard()                              # this build's stages: no manifest points at them
            raise
        left += remove_unreferenced(out, manifest)[1]      # the replaced build's folders
    if left:
        reporter.note(f"[yellow]left alone (not written by specexport build): {', '.join(sorted(set(left)))}[/]")
    return manifest


def _run_stages(plan: Plan, previous: dict, force: bool, folders: StageFolders, reporter: Reporter) -> tuple:
    out = plan.config.output
    results = []
    for i, mp in enumerate(plan.models):
        old = previous.get("models", {}).get(mp.role, {})
        if isinstance(mp.config.vocab, int) and mp.vocab_ids is None:
            mp = _with_measured_vocab(plan, mp, old, results, reporter)
            plan = dataclasses.replace(plan, models=(*plan.models[:i], mp, *plan.models[i + 1:]))
        fp32_rebuilt, samples, fp32_dir = False, {}, None
        for precision in mp.config.precisions:              # fp32 first: the others are made from it
            entry = old.get("precisions", {}).get(precision)
            stage_fp = plan.stage_fingerprint(mp, precision)
            if (not force and not fp32_rebuilt and entry and old.get("fingerprint") == mp.fingerprint
                    and entry.get("stage_fingerprint") == stage_fp and files_intact(out, entry["files"])):
                reporter.note(f"[dim]- {mp.role} {precision}: unchanged, reused ({entry['dir']})[/]")
                result = StageResult(mp.role, precision, entry, skipped=True)
            elif precision == "fp32":
                result = _export_stage(plan, mp, precision, reporter, folders)
                fp32_rebuilt = True
            else:
                result = _quantize_stage(plan, mp, precision, reporter, samples, folders, out / fp32_dir)
            result.entry["stage_fingerprint"] = stage_fp
            if precision == "fp32":
                fp32_dir = result.entry["dir"]
            results.append(result)
    return results, plan


def _with_measured_vocab(plan: Plan, mp: ModelPlan, old: dict, results: list, reporter: Reporter) -> ModelPlan:
    """draft.vocab = N: the N target ids the target produces most often (its previous ids when the
    draft and the target are unchanged)."""
    if old.get("fingerprint") == mp.fingerprint and old.get("vocab_ids"):
        return dataclasses.replace(mp, vocab_ids=tuple(old["vocab_ids"]))
    from specexport.export.quality import runtime_session

    target_dir = next(r.entry["dir"] for r in results if r.role == "target" and r.precision == "fp32")
    with reporter.stage(f"measure the draft's {mp.config.vocab} tokens on the target's continuations"):
        ids = frequent_ids(runtime_session(plan.config.output / target_dir / "model.onnx"), plan.target,
                           mp.config.vocab, plan.eval_ids)
    return dataclasses.replace(mp, vocab_ids=ids)


VOCAB_SEQUENCES, VOCAB_LENGTH, VOCAB_SEED = 32, 128, 2


def frequent_ids(target_session, target: ModelPlan, n: int, eval_ids=None) -> tuple[int, ...]:
    """The n target ids most frequent in sequences sampled from the target graph (32 x 128 tokens,
    temperature 1, seeded) and in eval_text: the EOS ids first, then by count, ties and any shortfall
    by ascending id (a token the draft cannot propose still comes out through the verifier)."""
    from specexport.export.quality import sampled_sequences

    seqs = sampled_sequences(target_session, target.io, start=target.arch.bos_token_id, length=VOCAB_LENGTH,
                             count=VOCAB_SEQUENCES, seed=VOCAB_SEED)
    from specexport.runtime.backends.vocab import most_frequent_ids

    tokens = np.concatenate([*seqs, np.asarray(eval_ids or [], np.int64)])
    return most_frequent_ids(tokens, n, target.io.vocab_size, always=target.eos_token_ids)


# Checkpoints above this size export in a child process: torch.onnx.export keeps about one extra copy
# of the weights alive in the exporting process (measured: ~1 GB retained after exporting a 490 MiB
# Llama), which would otherwise add to the parity check's ONNX Runtime copy.
SUBPROCESS_EXPORT_BYTES = 64 * 2**20


def _export_stage(plan: Plan, mp: ModelPlan, precision: str, reporter: Reporter,
                  folders: StageFolders) -> StageResult:
    from specexport.export.to_onnx import load_hf_model
    from specexport.export.validate import compare, onnx_logits, parity_case, reference_logits

    out = plan.config.output
    partial, final = folders.new(mp.role, precision)
    start = time.perf_counter()
    try:
        with reporter.stage(f"export {mp.role} {precision} ({mp.config.path.name}, {mp.arch.model_type}) to ONNX"):
            names = _run_export(mp, partial / "model.onnx")
        with reporter.stage(f"check {mp.role} {precision} against PyTorch"):
            case = parity_case(mp.io, max_seq_len=plan.config.max_seq_len,
                               max_verify_tokens=plan.config.max_verify_tokens)
            reference = reference_logits(load_hf_model(mp.config.path), case)
            if mp.vocab_ids is not None:       # a reduced-vocabulary draft: its logits are these columns
                reference = {k: v[:, list(mp.vocab_ids)] for k, v in reference.items()}
            gc.collect()                   # free the PyTorch weights before ORT loads its copy
            report = compare(reference, onnx_logits(partial / "model.onnx", mp.io, case))
        tolerance = plan.config.parity_tolerance
        if not report.max_rel_error <= tolerance:
            raise ParityError(f"{mp.role} {precision}: parity check failed: {report.describe()} "
                              f"> tolerance {tolerance:.1e}")
        engine = _engine(plan, mp, precision, partial, partial / "model.onnx", 1, reporter)
        names += engine.pop("files") if engine else []
        folders.publish(partial, final)
    finally:
        owned.remove(partial)          # ours: marked when made
    entry = {
        **files_entry(out, final, names),
        "parity_reference": "pytorch",
        "parity_max_rel_error": report.max_rel_error,
        "parity_per_phase": report.per_phase,
        "parity_tolerance": tolerance,
        **({"engine": engine} if engine else {}),
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    return StageResult(mp.role, precision, entry, skipped=False)


def _engine(plan: Plan, mp: ModelPlan, precision: str, folder: Path, fp32_graph: Path, min_tokens: int,
            reporter: Reporter) -> dict | None:
    """backends: [tensorrt]: the stage's TensorRT engine, built and self-checked (export/trt_engine.py,
    UNVERIFIED: no TensorRT where this was written); None without that backend. fp32 and the GPU
    precisions only (int8/int4 are ONNX Runtime's MatMulNBits, which TensorRT does not parse)."""
    if "tensorrt" not in plan.config.backends:
        return None
    from specexport.export.trt_engine import engine_stage

    cfg = plan.config
    with reporter.stage(f"build and self-check the {mp.role} {precision} TensorRT engine"):
        return engine_stage(folder, io=mp.io, precision=precision, fp32_graph=fp32_graph, max_seq_len=cfg.max_seq_len,
                            max_verify_tokens=cfg.max_verify_tokens, attention=cfg.tensorrt["attention"],
                            min_tokens=min_tokens, parity_tolerance=cfg.parity_tolerance)


def files_entry(out: Path, final: Path, names: list[str]) -> dict:
    files = [final / name for name in names]
    return {"dir": str(final.relative_to(out)), "backend": "onnxruntime", "files": describe_files(out, files),
            "size_bytes": sum(f.stat().st_size for f in files)}


def _quantize_stage(plan: Plan, mp: ModelPlan, precision: str, reporter: Reporter, samples: dict,
                    folders: StageFolders, fp32_dir: Path) -> StageResult:
    """Quantize the model's fp32 graph, check it against that graph (quality gate), rename into place.

    `samples` caches this model's eval sequences between its quantized precisions."""
    from specexport.calibrate.ptq import ORT_OPTIMIZATION
    from specexport.export.quality import (ROW_TOLERANCE, measure_quality, min_tokens_for, row_dependence,
                                           runtime_session)
    from specexport.export.quantize import CALIBRATED, MODELOPT, cpu_graph, describe, quantize_graph
    from specexport.export.to_onnx import check_graph_io
    from specexport.export.validate import compare, onnx_logits, parity_case

    out = plan.config.output
    source = fp32_dir / "model.onnx"
    partial, final = folders.new(mp.role, precision)
    start = time.perf_counter()
    gate, scheme = plan.config.quality_gates[precision], mp.config.quantization[precision]
    options = ", ".join(f"{k} {v}" for k, v in scheme.items() if k != "scheme")
    try:
        reference = runtime_session(source)
        sequences, text = eval_sequences(plan, mp, reference, reporter, samples)
        calibration, calibrated_on, feeds = [], {}, []
        if scheme["scheme"] in CALIBRATED:
            calibration, calibrated_on = _calibration_sequences(plan, mp, reference)
        if scheme["scheme"] in MODELOPT:
            from specexport.calibrate.feeds import runtime_feeds

            feeds, record = runtime_feeds(reference, mp.io, calibration)
            calibrated_on.update(record)
        with reporter.stage(f"quantize {mp.role} {precision} from fp32 ({scheme['scheme']}"
                            f"{', ' + options if options else ''})"):
            names = [f.name for f in quantize_graph(source, partial / "model.onnx", precision, scheme, io=mp.io,
                                                    calibration=calibration, feeds=feeds)]
            check_graph_io(partial / "model.onnx", mp.io)
        optimization, on_cpu = ORT_OPTIMIZATION.get(precision, "all"), cpu_graph(scheme)
        check_graph_io(partial / on_cpu, mp.io)
        quantized = runtime_session(partial / on_cpu, optimization=optimization)
        with reporter.stage(f"check {mp.role} {precision} against fp32 on {text['label']}"):
            quality = measure_quality(reference, quantized, mp.io, sequences)
            rows = {"one_token": row_dependence(quantized, mp.io, sequences[0], last=1),
                    "two_tokens": row_dependence(quantized, mp.io, sequences[0], last=2)}
            case = parity_case(mp.io, max_seq_len=plan.config.max_seq_len,
                               max_verify_tokens=plan.config.max_verify_tokens)
            parity = compare(onnx_logits(source, mp.io, case, session=reference),
                             onnx_logits(partial / on_cpu, mp.io, case, session=quantized))
        del reference, quantized
        failures = quality.failures(gate)
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
        plugin = _plugin_graph(plan, mp, precision, partial, on_cpu, source, reporter) \
            if precision in GPU_PRECISIONS else None
        if plugin:
            names.append(plugin["file"])
        engine = _engine(plan, mp, precision, partial, source, min_tokens if mp.role == "target" else 1, reporter) \
            if precision in GPU_PRECISIONS else None
        names += engine.pop("files") if engine else []
        reporter.note(f"  {mp.role} {precision}: {quality.describe()}, row dependence {rows['two_tokens']:.1e}"
                      + (f" (one-token passes {rows['one_token']:.1e}: run with 2 rows or more)"
                         if min_tokens > 1 and mp.role == "target" else ""))
        folders.publish(partial, final)
    finally:
        owned.remove(partial)          # ours: marked when made
    entry = {
        **files_entry(out, final, names),
        "quantization": describe(precision, scheme, calibration_sequences=len(calibration),
                                 calibration=calibrated_on),
        "ort_optimization": optimization,      # the session's graph optimisation level (runtime: OrtBackend)
        **({"cpu_graph": on_cpu} if on_cpu != "model.onnx" else {}),   # what ORT CPU runs (gate, runtime)
        **({"plugin_graph": plugin} if plugin else {}),
        **({"engine": engine} if engine else {}),
        "row_dependence": rows,
        "min_tokens": min_tokens if mp.role == "target" else 1,   # the runtime pads smaller target calls
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


def _plugin_graph(plan: Plan, mp: ModelPlan, precision: str, folder: Path, on_cpu: str, source: Path,
                  reporter: Reporter) -> dict:
    """trt.onnx beside a GPU precision's graph: attention as the tree-attention plugin node, the graph
    TensorRT engines are built from (plugins/graph.py).

    The rewrite is checked where it can be checked exactly: the same rewrite of the model's fp32 graph
    (`source`), run in ONNX Runtime with the plugin op computed by the numpy reference, against the fp32
    graph, within parity_tolerance. The rewritten fp16/FP8/INT8 graph itself is only measured (top-1
    agreement and relative error against the graph it was made from, basic optimisation, fp16 as its
    CPU stand-in): the two attention implementations differ by ~1e-7, and wherever that moves a value
    across a rounding step the difference becomes a whole step and grows through the layers: 2e-7 on the
    2-layer tiny llama, 4.3e-3 on SmolLM2-135M fp16 and 9.7e-2 with FP8's 3-bit mantissa (30 layers)."""
    import onnx

    from specexport.calibrate.fp16 import emulate
    from specexport.export.quality import runtime_session
    from specexport.export.validate import compare, onnx_logits, parity_case
    from specexport.plugins.graph import cpu_session, plugin_graph, write_plugin_graph
    from specexport.plugins.trt_plugin import PLUGIN_ID

    case = parity_case(mp.io, max_seq_len=plan.config.max_seq_len, max_verify_tokens=plan.config.max_verify_tokens)
    with reporter.stage(f"write {mp.role} {precision} plugin graph for TensorRT, check the rewrite on fp32"):
        dest = write_plugin_graph(folder / "model.onnx", folder / "trt.onnx", head_dim=mp.io.head_dim)
        wiring = compare(onnx_logits(source, mp.io, case),
                         onnx_logits(None, mp.io, case, session=cpu_session(
                             plugin_graph(onnx.load(str(source)), head_dim=mp.io.head_dim))))
        candidate = emulate(onnx.load(str(dest))) if on_cpu != "model.onnx" else dest
        made_from = onnx_logits(None, mp.io, case, session=runtime_session(folder / on_cpu, "basic"))
        got = onnx_logits(None, mp.io, case, session=cpu_session(candidate, "basic"))
        measured = compare(made_from, got)
        agree = float(np.mean(np.concatenate([made_from[k].argmax(-1) == got[k].argmax(-1) for k in made_from])))
    if not wiring.max_rel_error <= plan.config.parity_tolerance:
        raise ParityError(f"{mp.role} {precision}: the plugin rewrite of the fp32 graph disagrees with it: "
                          f"{wiring.describe()} > parity_tolerance {plan.config.parity_tolerance:.1e}")
    return {"file": dest.name, "plugin": PLUGIN_ID, "made_from": "model.onnx", "attention": "plugin",
            "kv_update": "concat (plain-run contract; the engine's in-place update is not written yet)",
            "rewrite_check_fp32_max_rel_error": wiring.max_rel_error, "vs_source_max_rel_error": measured.max_rel_error,
            "vs_source_top1_agreement": agree, "reference": "tree_attention.reference (numpy)"}


CALIBRATION_SEQUENCES = 8


def _calibration_sequences(plan: Plan, mp: ModelPlan, fp32_session) -> tuple[list, dict]:
    """Activation-range calibration data for static quantization and where it came from: the chunks of
    calibration_text; else eval_text's tokens after the ones the quality gate reads; else sequences
    sampled from the fp32 graph with another seed than the gate's. The gate stays on data the
    calibration never saw."""
    from specexport.export.quality import (EVAL_LENGTH, EVAL_SEQUENCES, SAMPLE_SEED, sampled_sequences,
                                           text_sequences)

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


def eval_sequences(plan: Plan, mp: ModelPlan, fp32_session, reporter: Reporter, samples: dict):
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
            samples["sequences"] = sampled_sequences(fp32_session, mp.io, start=bos, length=length,
                                                     ids=mp.vocab_ids)
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
                             aux_hidden_layers=mp.io.aux_hidden_layers, vocab_rows=mp.vocab_ids)
    return [f.name for f in onnx_from_module(module, mp.io, onnx_path)]


def reused_heads(plan: Plan, hp, previous: dict, force: bool, results: list, reporter: Reporter) -> dict | None:
    """The previous build's record of these heads when it can be reused (same fingerprint, files intact,
    the target graph not rebuilt in this run, no --force), else None."""
    old = previous.get("heads", {}).get(hp.role, {})
    entry = old.get("precisions", {}).get("fp32")
    target_rebuilt = any(r.role == "target" and not r.skipped for r in results)
    if (force or target_rebuilt or not entry or old.get("fingerprint") != hp.fingerprint
            or not files_intact(plan.config.output, entry["files"])):
        return None
    reporter.note(f"[dim]- {hp.role} heads: unchanged, reused ({entry['dir']})[/]")
    return old


def _tokenizer_stage(plan: Plan, out: Path, previous: dict, folders: StageFolders) -> dict:
    """The manifest's tokenizer record: the previous copy when the source files are unchanged, else a
    new folder named by their content (written beside the old one, renamed into place when complete)."""
    digest = tokenizer_digest(plan.tokenizer_files)
    reused = reusable_tokenizer(out, previous, digest)
    if reused is not None:
        return reused
    dest = out / f"tokenizer-{digest[:8]}"
    if dest.exists():                       # the same content, damaged: a name of its own
        dest = out / f"tokenizer-{digest[:8]}-{secrets.token_hex(2)}"
    partial = folders.folder(dest)
    try:
        for f in plan.tokenizer_files:
            shutil.copy2(f, partial / f.name)
        if not (partial / "tokenizer.json").is_file():
            # The runtime reads tokenizer.json with the `tokenizers` library; slow tokenizers are converted.
            from specexport._optional import require

            require("transformers").AutoTokenizer.from_pretrained(plan.target.config.path).save_pretrained(partial)
        folders.publish(partial, dest)
    finally:
        owned.remove(partial)          # ours: marked when made
    files = {f.name: {"sha256": sha256_file(f), "size": f.stat().st_size} for f in sorted(dest.iterdir())}
    return {"dir": dest.name, "source_sha256": digest, "files": files}


def _previous_manifest(out: Path, reporter: Reporter) -> dict:
    if not (out / MANIFEST_NAME).exists():
        return {}
    try:
        return read_manifest(out)
    except SpecexportError as err:          # unreadable, or from another schema: nothing can be reused
        reporter.note(f"[yellow]the previous build in {out} cannot be reused ({err}); building anew[/]")
        return {}


def _manifest(plan: Plan, results: list[StageResult], tokenizer: dict, previous: dict, heads: dict) -> dict:
    cfg = plan.config
    models = {}
    for mp in plan.models:
        models[mp.role] = {
            "source": str(mp.config.path),
            **({"gguf": str(mp.config.gguf)} if mp.config.gguf is not None else {}),
            "model_type": mp.arch.model_type,
            "fingerprint": mp.fingerprint,
            "vocab_size": mp.arch.vocab_size,
            "max_seq_len": cfg.max_seq_len,
            "max_verify_tokens": cfg.max_verify_tokens,
            "special_tokens": {"bos_token_id": mp.arch.bos_token_id, "eos_token_ids": list(mp.eos_token_ids),
                               "pad_token_id": mp.arch.pad_token_id},
            "io": mp.io.to_dict(),
            "precisions": {r.precision: r.entry for r in results if r.role == mp.role},
            **({"vocab_ids": list(mp.vocab_ids),
                "vocab_source": ({"file": str(mp.config.vocab)} if not isinstance(mp.config.vocab, int) else
                                 {"most_frequent": mp.config.vocab, "sequences": VOCAB_SEQUENCES,
                                  "length": VOCAB_LENGTH, "seed": VOCAB_SEED, "eval_text": plan.eval_ids is not None})}
               if mp.vocab_ids is not None else {}),
        }
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "specexport_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_id": secrets.token_hex(8),
        "name": cfg.name,
        "config": cfg.to_dict(),
        "max_seq_len": cfg.max_seq_len,
        "max_verify_tokens": cfg.max_verify_tokens,
        "tokenizer": tokenizer,
        "special_tokens": plan.special_tokens,
        "models": models,
        **({"heads": heads} if heads else {}),
        "versions": {**tool_versions(), "python": platform.python_version(), "specexport": __version__},
    }
    manifest.update(carried_gamma_choices(previous, manifest))     # measured on stages this build reused
    return manifest
