"""A model's graph without its weights: what a lean build exports from a GGUF model's config alone.

The fp32 route (builder/stages/export.py) loads the checkpoint, exports it and keeps an fp32 copy of the
model two or three times over (torch, the exporter, ONNX Runtime's check): 13 GiB at the peak for the
Qwen2.5-Coder 1.5B + 0.5B pair, and a 3B does not build in 24 GB. The graph's structure does not need
the weights: here the same StaticKVDecoder wraps the HF model built on torch's meta device whose
parameters are then zero-stride views of one zero (no memory), and is exported with the weights as
graph *inputs* named by the wrapper's parameters. The onnxscript optimizer and ONNX fusions torch's
exporter applies (`optimize=True`) run afterwards on that graph, where the weights, being inputs,
cannot be constant-folded into fp32 copies. quant/gguf_fill.fill then puts the GGUF file's blocks in.

    skeleton inputs:  input_ids ... past_value.N-1   decoder_layers.0.self_attn.q_proj.weight ...
                      (the IO table's, then one per weight)                 rotary.inv_freq (a buffer)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError


def hollow_model(hf_config):
    """The HF causal LM with zero-stride parameters (tied ones stay one object) and its buffers computed
    on the CPU (the rotary embedding's inverse frequencies)."""
    torch, transformers = require("torch"), require("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    hollow: dict = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in hollow:
                zero = torch.zeros((), dtype=torch.float32).expand(p.shape)
                hollow[id(p)] = torch.nn.Parameter(zero, requires_grad=False)
            setattr(module, name, hollow[id(p)])
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)):
                if not hasattr(child, "config") and "rotary" not in type(child).__name__.lower():
                    raise SpecexportError(f"{type(model).__name__}: module {child_name} ({type(child).__name__}) "
                                          f"keeps buffers a graph without weights cannot recompute")
                setattr(parent, child_name, type(child)(config=hf_config))      # real inv_freq on the CPU
    return model


def weight_sources(wrapper, model, vocab_rows=None) -> dict:
    """Graph input name -> where its values come from: ("param", HF name), ("rows", HF name, rows) for a
    reduced-vocabulary head, or ("buffer", array)."""
    hf = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    out: dict = {}
    for name, p in wrapper.named_parameters(remove_duplicate=False):
        if id(p) in hf:
            out[name] = ("param", hf[id(p)])
    head = wrapper.head
    if id(head.weight) not in hf:                  # _rows_of: the lm_head's rows for a reduced vocabulary
        rows = np.asarray(vocab_rows, np.int64)
        for name, p in wrapper.named_parameters(remove_duplicate=False):
            if p is head.weight:
                out[name] = ("rows", "lm_head.weight", rows)
            elif head.bias is not None and p is head.bias:
                out[name] = ("rows", "lm_head.bias", rows)
    for name, b in wrapper.named_buffers(remove_duplicate=False):
        out[name] = ("buffer", b.detach().numpy().copy())
    return out


def skeleton_module(mp, hf_config):
    """(wrapper, model): the StaticKVDecoder of model plan `mp` around its hollow HF model."""
    from specexport.export.registry import get_adapter
    from specexport.export.wrapper import StaticKVDecoder

    model = hollow_model(hf_config)
    wrapper = StaticKVDecoder(model, get_adapter(mp.arch.model_type), mp.arch,
                              aux_hidden_layers=mp.io.aux_hidden_layers, vocab_rows=mp.vocab_ids)
    return wrapper, model


def write_skeleton(wrapper, io, onnx_path: Path) -> None:
    """Export the weightless graph of `wrapper` to `onnx_path`, optimized as torch's exporter optimizes
    (onnxscript optimize_ir, then the ONNX-23 fusions: RMSNormalization, ...)."""
    torch = require("torch")
    onnx_ir = require("onnx_ir")
    onnxscript = require("onnxscript")
    from onnxscript.rewriter import onnx_fusions

    from specexport.export import gqa
    from specexport.export.to_onnx import (
        OPSET,
        dynamic_shapes,
        example_inputs,
        quiet_exporter,
    )

    ids, pos, mask, rows, caches = example_inputs(io)
    with torch.no_grad(), quiet_exporter():
        program = torch.onnx.export(
            wrapper, (ids, pos, mask, rows, *caches), input_names=io.input_names,
            output_names=io.output_names, dynamic_shapes=dynamic_shapes(io), dynamo=True,
            opset_version=OPSET, verbose=False, optimize=False, custom_translation_table=gqa.translation_table())
        program.save(str(onnx_path), include_initializers=False, keep_initializers_as_inputs=True)
        ir_model = onnx_ir.load(str(onnx_path))
        onnxscript.optimizer.optimize_ir(ir_model)        # what torch.onnx.export(optimize=True) runs
        onnx_fusions.fuse(ir_model)
        onnx_ir.save(ir_model, str(onnx_path))


def skeleton_sources(wrapper, model, vocab_rows, onnx_path: Path) -> dict:
    """weight_sources for the weight inputs the written skeleton kept (the optimizer drops unused ones)."""
    onnx = require("onnx")
    graph_inputs = {v.name for v in onnx.load(str(onnx_path), load_external_data=False).graph.input}
    return {k: v for k, v in weight_sources(wrapper, model, vocab_rows).items() if k in graph_inputs}
