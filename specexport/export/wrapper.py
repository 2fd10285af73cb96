"""StaticKVDecoder: the torch module that is exported to ONNX.

It calls the HF model's own submodules (embeddings, projections, norms, MLP, rotary embedding) with
the graph contract of io_spec.py: each layer's KV cache comes in and goes out as one buffer that the
new tokens' K/V are written into (in place when the runtime binds the same memory to both), and the
new tokens attend to what `attention_mask` allows: every committed position and their tree ancestors.

   input_ids [B,T]   position_ids [B,T]   attention_mask [B,T,P+T]          past_key/value.i [B,Hkv,C,D]
        |                  |                       |                                  |
   embed_tokens      rotary(cos,sin)      bias = 0 where visible, else min            |
        |                  |                       |                                  |
   layer i:  x = norm(h) -> q,k,v (+q/k norm) -> RoPE -> GroupQueryAttention(q, k, v, cache, bias)
             (writes k, v at rows P..P+T-1 of the cache -> present_key/value.i; attends over P+T rows)
             h += o_proj(attention) ;  h += mlp(norm(h))
        |
   final norm -> hidden_states [B,T,H] -> rows logits_rows [B,R] -> lm_head -> logits [B,R,V]

RoPE is written with torch.onnx.ops (the ONNX-23 RotaryEmbedding op on sequence-major [B, S, heads*D]
tensors); the same math in plain torch ops exports to ~40 kernels a layer instead of ~22, a large
share of a small model's CPU step. Attention is ORT's GroupQueryAttention (gqa.py says why).

No global monkeypatching: the HF model is only read.
"""
from __future__ import annotations

from specexport._optional import require
from specexport.export.gqa import group_query_attention, lengths

torch = require("torch")
nn = torch.nn
onnx_ops = torch.onnx.ops


class StaticKVDecoder(nn.Module):
    def __init__(self, model, adapter, arch, *, aux_hidden_layers=(), vocab_rows=None):
        super().__init__()
        self.model = model
        self.adapter = adapter
        self.arch = arch
        self.aux_hidden_layers = tuple(aux_hidden_layers)
        self.embed = adapter.embed_tokens(model)
        self.decoder_layers = adapter.layers(model)
        self.norm = adapter.final_norm(model)
        self.head = adapter.lm_head(model)
        if vocab_rows is not None:          # a reduced-vocabulary draft: project onto these target ids only
            self.head = _rows_of(self.head, vocab_rows)
        self.rotary = adapter.rotary(model)

    def forward(self, input_ids, position_ids, attention_mask, logits_rows, *caches):
        h = self.embed(input_ids)                                   # [B, T, H]
        cos, sin = self.rotary(h, position_ids)                     # [B, T, D] each: two equal halves
        half = self.arch.head_dim // 2
        cos, sin = cos[..., :half], sin[..., :half]                 # [B, T, D/2]
        zero = torch.zeros((), dtype=torch.float32)
        bias = torch.where(attention_mask, zero, torch.finfo(torch.float32).min).unsqueeze(1)   # [B, 1, T, P+T]
        seqlens_k, total = lengths(attention_mask)                  # int32 [B] = P+T-1, int32 [] = P+T
        aux, presents = [], []
        for i, layer in enumerate(self.decoder_layers):
            if i in self.aux_hidden_layers:
                aux.append(h)
            h, k, v = self._layer(layer, h, cos, sin, (seqlens_k, total, bias), caches[2 * i], caches[2 * i + 1])
            presents += [k, v]
        h = self.norm(h)                                            # [B, T, H]
        rows = torch.gather(h, 1, logits_rows.unsqueeze(-1).expand(-1, -1, h.shape[-1]))   # [B, R, H]
        logits = self.head(rows)                                    # [B, R, V] only the rows asked for
        outs = [logits.float(), h.float()]
        if self.aux_hidden_layers:
            outs.append(torch.cat(aux, dim=-1).float())             # [B, T, k*H]
        return (*outs, *presents)

    def _layer(self, layer, h, cos, sin, visible, cache_k, cache_v):
        """visible: (seqlens_k, total length, additive mask bias), shared by every layer."""
        attn, arch = layer.self_attn, self.arch
        B, T, _ = h.shape
        hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        x = layer.input_layernorm(h)
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)    # [B, T, Hq*D], [B, T, Hkv*D] x 2
        if self.adapter.qk_norm:
            q = attn.q_norm(q.view(B, T, hq, d)).view(B, T, hq * d)
            k = attn.k_norm(k.view(B, T, hkv, d)).view(B, T, hkv * d)
        q = onnx_ops.rotary_embedding(q, cos, sin, num_heads=hq)    # [B, T, Hq*D]
        k = onnx_ops.rotary_embedding(k, cos, sin, num_heads=hkv)   # [B, T, Hkv*D]
        out, cache_k, cache_v = group_query_attention(q, k, v, cache_k, cache_v, *visible, hq, hkv, float(attn.scaling))
        h = h + attn.o_proj(out)                                    # out [B, T, Hq*D]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, cache_k, cache_v


def _rows_of(head, rows):
    """A copy of the linear `head` that computes only the given output rows (no tying to the embedding:
    the embedding keeps every row, the projection does not)."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    small = nn.Linear(head.in_features, len(index), bias=head.bias is not None)
    with torch.no_grad():
        small.weight.copy_(head.weight[index])
        if head.bias is not None:
            small.bias.copy_(head.bias[index])
    return small
