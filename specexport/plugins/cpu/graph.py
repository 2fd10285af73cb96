"""Our ops in ONNX graphs: ONNX Runtime's GroupQueryAttention nodes turned into ours (the gguf graphs at
build time; an EAGLE head's graph at load, so a batch of requests can share its passes)."""
from __future__ import annotations

from pathlib import Path

from specexport.plugins.cpu import DOMAIN, status


def kernel_attention(nodes: list) -> None:
    """com.microsoft GroupQueryAttention nodes (export/gqa.py: no rotary inside, an additive bias) become
    specexport.cpu GroupQueryAttention, in place. Their head size must be a multiple of 8 (the op says so)."""
    for node in nodes:
        if node.domain != "com.microsoft" or node.op_type != "GroupQueryAttention":
            continue
        ins = list(node.input) + [""] * (11 - len(node.input))
        if any(ins[7:10]) or not ins[10]:
            raise ValueError(f"{node.name}: GroupQueryAttention with rotary or position inputs, or without a bias, "
                             "is not the contract the CPU kernels' attention takes (export/gqa.py)")
        del node.input[:]
        node.input.extend(ins[:7] + [ins[10]])
        node.domain = DOMAIN


def with_our_attention(path: Path, head_dim: int):
    """The graph at `path` (its weights left in their data file) with our attention in place of ONNX
    Runtime's, where the kernels load and every attention node is the contract ours takes (head_dim, its
    heads' size, a multiple of 8); else None."""
    import onnx

    if not status().available or head_dim % 8:
        return None
    model = onnx.load(str(path), load_external_data=False)
    try:
        kernel_attention(model.graph.node)
    except ValueError:                  # not the contract ours takes: ONNX Runtime's stays
        return None
    if not any(n.domain == DOMAIN for n in model.graph.node):
        return None
    model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return model
