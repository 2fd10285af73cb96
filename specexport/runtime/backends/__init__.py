"""The one place that opens what a build made, for a backend kind ("onnxruntime" on the CPU or on CUDA,
"tensorrt"): each backend's heavy module is imported here, lazily, and nowhere else in the runtime.

    open_backend(kind, model_dir, ...)      a model's Backend (base.Backend) from its stage folder
    open_heads(kind, model_dir, ...)        Medusa heads (heads.OrtHeads)
    open_eagle_head(kind, model_dir, ...)   an EAGLE head (eagle.OrtEagleHead)
and, from a build's manifest (what specexport.load's Pipeline calls; they check the files first):
    open_model(out_dir, manifest, role, ...)     the target or the draft in one precision
    open_medusa(out_dir, manifest, ...)          the build's Medusa heads
    open_eagle(out_dir, manifest, ...)           the build's EAGLE head
"""
from __future__ import annotations

from pathlib import Path

from specexport.errors import SpecexportError
from specexport.io_spec import EagleIO, HeadsIO, ModelIO
from specexport.manifest import check_files
from specexport.plugins.cpu import DOMAIN

KINDS = ("onnxruntime", "tensorrt")
HEADS_KINDS = ("onnxruntime",)            # kinds with a Medusa-heads and an EAGLE-head implementation


def require_kind(kind: str) -> None:
    """What a kind needs, checked before anything of the build is read ("tensorrt": TensorRT 11 and a
    GPU), in one line."""
    if kind == "tensorrt":
        from specexport._tensorrt import require_engines

        require_engines("backend tensorrt")


# -- one model, head or heads graph, by kind ------------------------------------------------------

def open_backend(kind: str, model_dir, *, io: ModelIO, capacity: int, max_tokens: int, device: str = "cpu", **options):
    """A Backend for one model of a build. kind: 'onnxruntime' or 'tensorrt' (its engine; UNVERIFIED:
    runtime/backends/trt.py); device: 'cpu' or 'cuda' / 'cuda:N' (ONNX Runtime's CUDA execution provider,
    onnxruntime-gpu; engines always run on a GPU)."""
    if kind == "onnxruntime" and device != "cpu":
        if not (device == "cuda" or device.startswith("cuda:") and device[5:].isdigit()):
            raise SpecexportError(f"device: expected cpu, cuda or cuda:N, got {device!r}")
        from specexport.runtime.backends.ort_cuda import OrtCudaBackend

        return OrtCudaBackend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens,
                              device_id=int(device[5:] or 0) if device != "cuda" else 0, **options)
    if kind == "onnxruntime":
        from specexport.runtime.backends.ort import OrtBackend

        return OrtBackend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens, **options)
    if kind == "tensorrt":
        from specexport.runtime.backends.trt import open_trt_backend

        return open_trt_backend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens,
                                device=device if device.startswith("cuda") else "cuda", **options)
    raise SpecexportError(f"backend: {kind!r} is not available in this version; available: {', '.join(KINDS)}")


def open_heads(kind: str, model_dir, *, io: HeadsIO, **options):
    """Medusa heads (a callable hidden [H] -> top-K ids [N, K]) for a heads graph."""
    _check_heads_kind(kind, "Medusa heads")
    from specexport.runtime.backends.heads import OrtHeads

    return OrtHeads(model_dir, io=io, **options)


def open_eagle_head(kind: str, model_dir, *, io: EagleIO, capacity: int, max_tokens: int, **options):
    """An EAGLE head (`draft`, commit, rollback) for an EAGLE head graph."""
    _check_heads_kind(kind, "EAGLE heads")
    from specexport.runtime.backends.eagle import OrtEagleHead

    return OrtEagleHead(model_dir, io=io, capacity=capacity, max_tokens=max_tokens, **options)


def _check_heads_kind(kind: str, what: str) -> None:
    if kind not in HEADS_KINDS:
        raise SpecexportError(f"backend: {kind!r} is not available for {what} in this version; available: "
                              f"{', '.join(HEADS_KINDS)}")


# -- from a build's manifest ------------------------------------------------------------------------

def open_model(out_dir, manifest: dict, role: str, *, precision: str, kind: str, capacity: int, max_tokens: int,
               threads: int | None = None, **options):
    """The `role` model ("target" / "draft") of the build in out_dir in `precision`, on backend `kind`:
    its files checked, the stage's own options (min_tokens, ORT optimization level, the CPU stand-in of
    an fp16 graph, the TensorRT engine) applied over `options`; a draft over part of the vocabulary
    comes wrapped in vocab.ReducedVocab (target ids out)."""
    out_dir, models = Path(out_dir), manifest["models"]
    if role not in models:
        raise SpecexportError(f"method: this build has no {role} model (built: {', '.join(models)})")
    entry = models[role]
    if precision not in entry["precisions"]:
        key = "precision" if role == "target" else "draft_precision"
        hint = "" if role == "target" else " (draft_precision defaults to precision; pass it to choose another)"
        raise SpecexportError(f"{key}: {precision!r} was not built for the {role}; built: "
                              f"{', '.join(entry['precisions'])}{hint}")
    stage = entry["precisions"][precision]
    check_files(out_dir, stage["files"])        # cheap: sizes; a truncated or missing file names itself
    _check_layout(stage, manifest, f"{role}/{precision}")
    options = _stage_options(stage, role=role, precision=precision, kind=kind, options=options)
    backend = open_backend(kind, out_dir / stage["dir"], io=ModelIO.from_dict(entry["io"]), capacity=capacity,
                           max_tokens=max_tokens, threads=threads, **options)
    backend.exact_trees = stage.get("trees", "exact") == "exact"   # quant/quality.tree_rows_for
    if entry.get("vocab_ids") is not None:      # a draft over part of the vocabulary: target ids out
        from specexport.runtime.backends.vocab import ReducedVocab

        backend = ReducedVocab(backend, entry["vocab_ids"], models["target"]["vocab_size"])
    return backend


def _stage_options(stage: dict, *, role: str, precision: str, kind: str, options: dict) -> dict:
    """The backend options of one built stage: the caller's, or for "tensorrt" the stage's engine entry's
    (trt/engine.py), with what the build measured or made for this stage."""
    options = dict(options)
    if kind == "tensorrt":
        if "engine" not in stage:
            raise SpecexportError(f"backend: 'tensorrt' was not built for the {role} {precision} (build with "
                                  f"backends: [tensorrt])")
        engine = stage["engine"]
        options = {"engine": engine["file"], "attention": engine["attention"], "min_tokens": engine["min_tokens"]}
    elif stage["backend"] != kind:
        raise SpecexportError(f"backend: {kind!r} was not built; built: {stage['backend']}")
    if stage.get("min_tokens", 1) > 1:          # the build measured this graph's one-row kernels differ
        options["min_tokens"] = stage["min_tokens"]
    if stage.get("ort_optimization", "all") != "all":     # Q/DQ graphs: basic (quant/ptq.py)
        options["optimization"] = stage["ort_optimization"]
    if "cpu_graph" in stage:                    # fp16: its fp32 stand-in for CPUs (calibrate/fp16.emulate)
        options["graph"] = stage["cpu_graph"]
    return options


def open_medusa(out_dir, manifest: dict, *, kind: str, target_precision: str):
    """The build's Medusa heads, on backend `kind` (their q8_0 blocks where the target's `target_precision`
    runs on our kernels, else fp32); an error when the build made none."""
    entry = manifest.get("heads", {}).get("medusa")
    if entry is None:
        raise SpecexportError("method: 'medusa' was not built (no medusa: heads in the model.yaml)")
    stage = _heads_stage(entry, manifest, kind, target_precision=target_precision)
    check_files(Path(out_dir), stage["files"])
    return open_heads(kind, Path(out_dir) / stage["dir"], io=HeadsIO.from_dict(entry["io"]))


def open_eagle(out_dir, manifest: dict, *, kind: str, capacity: int, max_tokens: int, target_precision: str):
    """The build's EAGLE head, on backend `kind` (its q8_0 blocks where the target runs on our kernels, else
    fp32): its cache holds capacity + the build's scratch
    rows (a draft tree's levels), its calls take max_tokens rows or its top-K, whichever is more; an
    error when the build made none. Its attention is ours (batched heads share passes on it) only where the
    target's `target_precision` graph runs on our kernels: no other build compiles or fetches anything."""
    entry = manifest.get("heads", {}).get("eagle")
    if entry is None:
        raise SpecexportError("method: 'eagle' was not built (no eagle: head in the model.yaml)")
    io = EagleIO.from_dict(entry["io"])
    stage = _heads_stage(entry, manifest, kind, target_precision=target_precision)
    check_files(Path(out_dir), stage["files"])
    ours = _on_kernels(manifest, target_precision) and stage is entry["precisions"]["fp32"]  # q8_0's is ours
    return open_eagle_head(kind, Path(out_dir) / stage["dir"], io=io, capacity=capacity + entry["scratch_rows"],
                           max_tokens=max(max_tokens, io.top_k), our_attention=ours)


def _on_kernels(manifest: dict, target_precision: str) -> bool:
    return on_our_kernels(manifest["models"]["target"]["precisions"].get(target_precision) or {})


def _check_layout(stage: dict, manifest: dict, what: str) -> None:
    """A graph whose weights are in a layout this version's kernels do not read is refused before any pass."""
    from specexport.plugins.cpu import LAYOUTS, layout_of

    layout = layout_of(stage)
    if on_our_kernels(stage) and layout not in LAYOUTS:
        raise SpecexportError(f"{what}: its weights are in the layout {layout!r}, written by specexport "
                              f"{manifest.get('specexport_version', '?')}; this version reads {', '.join(LAYOUTS)}: "
                              "upgrade specexport, or build again with this one")


def on_our_kernels(stage: dict) -> bool:
    """Whether a precision's graph (its manifest entry) runs on specexport's CPU kernels."""
    return ((stage.get("quantization") or {}).get("kernels") or {}).get("ops") == DOMAIN


def _heads_stage(entry: dict, manifest: dict, kind: str, *, target_precision: str) -> dict:
    """Heads' q8_0 stage (builder/stages/head_blocks.py) beside a target on our kernels, else their fp32 one."""
    blocks = entry["precisions"].get("q8_0")
    if blocks is not None and kind == "onnxruntime" and _on_kernels(manifest, target_precision):
        return blocks
    return entry["precisions"]["fp32"]
