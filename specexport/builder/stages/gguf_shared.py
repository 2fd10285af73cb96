"""What the gguf and blocks stages share (builder/stages/gguf.py, blocks.py): which ops a graph calls and its
weights' layout, the lean graph filled from a GGUF file, and the parity check of a graph computed in fp32
(its exact twin) against its reference."""
from __future__ import annotations

from pathlib import Path

from specexport.errors import SpecexportError


def lean_graph(ctx, mp, graph, *, level, kernels: bool, gguf: Path | None = None, layout: str = "file"):
    """A weightless export filled from the file (`gguf`, else the model's own) by name; the parity source
    is the file itself."""
    import transformers

    from specexport.export.gguf_weights import GgufWeights
    from specexport.builder import export_cache
    from specexport.export.lean import skeleton_module, skeleton_sources, write_skeleton
    from specexport.export.to_onnx import check_graph_io
    from specexport.quant.gguf_fill import fill

    hf_config = transformers.AutoConfig.from_pretrained(mp.config.path)
    skeleton = graph.with_name("skeleton.onnx")
    wrapper, model = skeleton_module(mp, hf_config)
    key = export_cache.graph_key("skeleton", mp, hf_config, name=skeleton.name)
    with ctx.reporter.stage(f"export {mp.role} ({mp.arch.model_type}) to ONNX without weights"):
        cached = export_cache.fetch(key, skeleton) is not None
        if not cached:
            write_skeleton(wrapper, mp.io, skeleton)
            export_cache.store(key, skeleton.parent, [skeleton.name])
    if cached:
        ctx.reporter.note(f"  {mp.role}: the weightless graph from the export cache (${export_cache.ENV})")
    sources = skeleton_sources(wrapper, model, mp.vocab_ids, skeleton)
    gguf = gguf or mp.config.gguf
    weights = GgufWeights(gguf, hf_config)
    with ctx.reporter.stage(f"{mp.role}: fill the graph from {gguf.name}'s own blocks"):
        report = fill(skeleton, sources, weights, graph, accuracy_level=level, kernels=kernels, layout=layout)
    skeleton.unlink()
    check_graph_io(graph, mp.io)
    return report, weights


def choose_kernels(choice: str, head_dim: int, role: str):
    """The ops a gguf graph calls, as quantization.gguf.kernels asks: auto (ours where they build and load
    here, else the stock ops), ours (fail without them), stock."""
    from specexport.plugins import cpu

    if choice == "stock":
        return cpu.Status(None, reason="quantization.gguf.kernels: stock")
    kernels = cpu.status()
    if kernels.available and head_dim % 8:
        kernels = cpu.Status(None, reason=f"head_dim {head_dim} is not a multiple of 8 (the kernels' attention)")
    if choice == "ours" and not kernels.available:
        raise SpecexportError(f"{role} gguf: quantization.gguf.kernels is 'ours', but specexport's CPU kernels do not "
                              f"run here: {kernels.reason} (kernels: auto takes ONNX Runtime's ops instead)")
    return kernels


def choose_layout(choice: str, kernels, where: str) -> tuple[str, str]:
    """The weights' layout for a graph on `kernels` (quantization.<p>.layout), and why."""
    from specexport.plugins.cpu import layout

    if choice != "file" and choice != "auto" and not kernels.available:
        raise SpecexportError(f"{where}.layout: {choice} is a layout of specexport's CPU kernels, which do not run "
                              f"here ({kernels.reason}); layout: auto or file")
    return layout.choose(choice, kernels)


def note_layout(ctx, what: str, layout: str, *, why: str, report) -> None:
    """The build's log: the layout chosen and the tensors whose last rows (N % 8) keep the file's."""
    ctx.reporter.note(f"  {what}: weights in the {layout} layout ({why})")
    if report.tails:
        names = ", ".join(f"{n} ({r} rows)" for n, r in list(report.tails.items())[:4])
        ctx.reporter.note(f"  {what}: {len(report.tails)} tensor(s) keep their last rows (N % 8) as in the file: {names}")


def kernels_entry(kernels, layout: str, why: str, *, report) -> dict:
    """The manifest's quantization.kernels: the ops the graph calls, and on ours, the weights' layout."""
    if not kernels.available:
        return {"ops": "onnxruntime", "why": kernels.reason}
    return {"ops": "specexport.cpu", "path": kernels.path, "cpu_runs": kernels.paths, "layout": layout,
            "layout_why": why, "layout_tails": report.tails}


def exact_twin(graph: Path, level: int) -> Path:
    """The graph computed in fp32: itself at accuracy_level 0 (stock ops), else a twin that shares its
    weights file (the caller removes it): MatMulNBits at accuracy_level 0, our GgufMatMul in its exact mode."""
    import onnx

    if level == 0:
        return graph
    proto = onnx.load(str(graph), load_external_data=False)
    for node in proto.graph.node:
        for attr in node.attribute:
            if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                attr.i = 0
            if node.op_type in ("GgufMatMul", "GgufMatMulN") and attr.name == "exact":
                attr.i = 1
    twin = graph.with_name("parity-twin.onnx")
    onnx.save(proto, str(twin))               # its initializers still name model.onnx.data
    return twin


def parity_check(ctx, mp, source, *, twin: Path):
    """The graph computed in fp32 against its reference on the parity case (prefill, decode, a tree):
    the fp32 graph (`source` a path), or transformers run layer by layer from the file (`source` the
    file's GgufWeights). Returns (the report, the twin's logits per phase)."""
    from specexport.export.validate import (
        case_logits,
        compare,
        onnx_logits,
        parity_case,
    )

    cfg = ctx.config
    case = parity_case(mp.io, max_seq_len=cfg.max_seq_len, max_verify_tokens=cfg.max_verify_tokens)
    if isinstance(source, Path):
        reference = onnx_logits(source, mp.io, case)
    else:
        from specexport.export.gguf_reference import layerwise_logits

        reference = case_logits(lambda seqs: layerwise_logits(source, seqs, vocab_rows=mp.vocab_ids), case)
    got = onnx_logits(twin, mp.io, case)
    return compare(reference, got), got
