"""ExportStage: a model's fp32 graph, exported from its checkpoint and checked against PyTorch (the parity
gate), with its TensorRT engine where the build has `backends: [tensorrt]`."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

from specexport import owned
from specexport.builder import export_cache
from specexport.builder.context import StageResult, files_entry   # noqa: F401  (StageResult: for type readers)
from specexport.builder.stage import ModelStage
from specexport.errors import ParityError

# Checkpoints above this size export in a child process: torch.onnx.export keeps about one extra copy
# of the weights alive in the exporting process (measured: ~1 GB retained after exporting a 490 MiB
# Llama), which would otherwise add to the parity check's ONNX Runtime copy.
SUBPROCESS_EXPORT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ExportStage(ModelStage):
    def run(self, ctx) -> dict:
        from specexport.builder.stages.engines import engine
        from specexport.export.to_onnx import load_hf_model
        from specexport.export.validate import compare, onnx_logits, parity_case, reference_logits

        cfg, mp = ctx.config, ctx.model(self.role)
        partial, final = ctx.folders.new(self.role, self.precision)
        start = time.perf_counter()
        try:
            with ctx.reporter.stage(f"export {mp.role} {self.precision} ({mp.config.path.name}, "
                                    f"{mp.arch.model_type}) to ONNX"):
                names, cached = _run_export(mp, partial / "model.onnx")
            if cached:
                ctx.reporter.note(f"  {mp.role} {self.precision}: the graph from the export cache "
                                  f"(${export_cache.ENV})")
            with ctx.reporter.stage(f"check {mp.role} {self.precision} against PyTorch"):
                case = parity_case(mp.io, max_seq_len=cfg.max_seq_len, max_verify_tokens=cfg.max_verify_tokens)
                reference = reference_logits(load_hf_model(mp.config.path), case)
                if mp.vocab_ids is not None:       # a reduced-vocabulary draft: its logits are these columns
                    reference = {k: v[:, list(mp.vocab_ids)] for k, v in reference.items()}
                gc.collect()                   # free the PyTorch weights before ORT loads its copy
                report = compare(reference, onnx_logits(partial / "model.onnx", mp.io, case))
            if not report.max_rel_error <= cfg.parity_tolerance:
                raise ParityError(f"{mp.role} {self.precision}: parity check failed: {report.describe()} "
                                  f"> tolerance {cfg.parity_tolerance:.1e}")
            built = engine(ctx, mp, self.precision, partial, partial / "model.onnx", 1)
            names += built.pop("files") if built else []
            ctx.folders.publish(partial, final)
        finally:
            owned.remove(partial)          # ours: marked when made
        return {**files_entry(ctx.out, final, names), "parity_reference": "pytorch",
                "parity_max_rel_error": report.max_rel_error, "parity_per_phase": report.per_phase,
                "parity_tolerance": cfg.parity_tolerance, **({"engine": built} if built else {}),
                "build_seconds": round(time.perf_counter() - start, 2)}


def _run_export(mp, onnx_path: Path) -> tuple[list[str], bool]:
    weights = sum(p.stat().st_size for p in mp.config.path.iterdir() if p.suffix in (".safetensors", ".bin"))
    if weights <= SUBPROCESS_EXPORT_BYTES:
        return export_model(mp, onnx_path)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(export_model, mp, onnx_path).result()      # exceptions re-raise here


def export_model(mp, onnx_path: Path) -> tuple[list[str], bool]:
    """Load the checkpoint, wrap it and export it (or take its graph from the export cache); returns the
    names of the files written and whether they came from the cache."""
    from specexport.export.registry import get_adapter
    from specexport.export.to_onnx import load_hf_model, onnx_from_module
    from specexport.export.wrapper import StaticKVDecoder

    model = load_hf_model(mp.config.path)
    module = StaticKVDecoder(model, get_adapter(mp.arch.model_type), mp.arch,
                             aux_hidden_layers=mp.io.aux_hidden_layers, vocab_rows=mp.vocab_ids)
    key = export_cache.graph_key("fp32", mp, model.config, name=onnx_path.name, weights=module)
    names = export_cache.fetch(key, onnx_path)
    if names is not None:
        return names, True
    names = [f.name for f in onnx_from_module(module, mp.io, onnx_path)]
    export_cache.store(key, onnx_path.parent, names)
    return names, False
