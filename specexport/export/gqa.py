"""In-place KV attention for the exported graph: ONNX Runtime's `com.microsoft::GroupQueryAttention`.

Each layer's attention is one GroupQueryAttention node with the layer's cache [B, Hkv, C, D] as both
`past_key` and `present_key` (the runtime binds the same buffer to both: ORT writes the T new rows at
P..P+T-1 in place and attends over the P+T valid rows, not the capacity C), the tree mask as an
additive `attention_bias` [B, 1, T, P+T], and `seqlens_k` / `total_sequence_length` derived once in
the graph from the mask's width (lengths()). Without a shared buffer (a plain session.run) ORT returns a new cache of
max(C, P+T) rows: feeding an empty cache and then each call's output back works too.

Why this op (issue 10 item 6a; measured with benchmarks/inplace_kv.py as of commit 2c45591): the standard ONNX Attention has to attend
over a concatenation of past and new K/V, and every layer of every step copied the whole committed
prefix to build it. On SmolLM2-135M at 512 committed tokens that made a decode step 15 % slower
(40.9 vs 34.6 ms) and a 2-10 token verify pass 11-24 % slower; the cost grew with the context.
ONNX's own in-place form (Attention-24 + TensorScatter) attends over the whole capacity on ORT CPU
(`nonpad_kv_seqlen` saves no compute there), which costs more than the copy.

torch side: a custom op with only a fake (shape) implementation, translated at export by
`custom_translation_table`. The graph is never run in PyTorch: the parity gate compares the ONNX
graph in ORT against the unmodified HF model.
"""
from __future__ import annotations

from specexport._optional import require

torch = require("torch")

DOMAIN = "com.microsoft"


@torch.library.custom_op("specexport::group_query_attention", mutates_args=())
def group_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                          cache_v: torch.Tensor, seqlens_k: torch.Tensor, total_length: torch.Tensor,
                          bias: torch.Tensor, num_heads: int, kv_num_heads: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, Hq*D], k/v [B, T, Hkv*D], caches [B, Hkv, C, D], seqlens_k int32 [B] (P+T-1),
    total_length int32 [] (P+T), bias [B, 1, T, P+T] -> (attention output [B, T, Hq*D], cache_k,
    cache_v with rows P..P+T-1 written). See lengths() for the two length inputs."""
    raise NotImplementedError("export only: becomes com.microsoft::GroupQueryAttention in the ONNX graph")


@group_query_attention.register_fake
def _(q, k, v, cache_k, cache_v, seqlens_k, total_length, bias, num_heads, kv_num_heads, scale):
    return torch.empty_like(q), torch.empty_like(cache_k), torch.empty_like(cache_v)


def lengths(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seqlens_k int32 [B], total_sequence_length int32 []) from attention_mask [B, T, P+T]: computed
    once per graph, not per layer (per-layer Shape/Expand/Cast nodes were 4% of the demo's kernel time)."""
    total = attention_mask.shape[-1]
    seqlens_k = torch.full((attention_mask.shape[0],), total - 1, dtype=torch.int32)
    return seqlens_k, seqlens_k[0] + 1


def translation_table() -> dict:
    """What torch.onnx.export(custom_translation_table=...) needs to emit the node."""
    register_gqa_schema()
    return {torch.ops.specexport.group_query_attention.default: _to_onnx}


def _to_onnx(q, k, v, cache_k, cache_v, seqlens_k, total_length, bias, num_heads: int, kv_num_heads: int,
             scale: float):
    import onnxscript

    ms = onnxscript.values.Opset(DOMAIN, 1)
    return ms.GroupQueryAttention(q, k, v, cache_k, cache_v, seqlens_k, total_length, None, None, None, bias,
                                  num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale)


def register_gqa_schema() -> None:
    """The onnx package has no schemas for ORT's contrib ops, and onnxscript (the exporter's graph
    builder) needs one to emit a node: declare the inputs, outputs and attributes used here."""
    onnx = require("onnx")
    OpSchema = onnx.defs.OpSchema
    if onnx.defs.has("GroupQueryAttention", DOMAIN):
        return
    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    names = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
             "cos_cache", "sin_cache", "position_ids", "attention_bias")
    types = {"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "P"}
    required = {"query", "seqlens_k", "total_sequence_length"}
    inputs = [param(n, types.get(n, "T")) if n in required else param(n, types.get(n, "T"), param_option=optional)
              for n in names]
    attr, kind = OpSchema.Attribute, OpSchema.AttrType
    onnx.defs.register_schema(OpSchema(
        "GroupQueryAttention", DOMAIN, 1, inputs=inputs,
        outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], ""),
                          ("P", ["tensor(int64)"], "")],
        attributes=[attr("num_heads", kind.INT, ""), attr("kv_num_heads", kind.INT, ""),
                    attr("scale", kind.FLOAT, "")]))
