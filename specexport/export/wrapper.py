"""StaticKVDecoder: the torch module that is exported to ONNX.

It calls the HF model's own submodules (embeddings, projections, norms, MLP, rotary embedding) with
the graph contract of io_spec.py: the committed past K/V comes in, only the new tokens' K/V goes out,
and the new tokens see every committed position plus the ancestors that `tree_mask` allows.

          input_ids [B,T]      position_ids [B,T]      tree_mask [B,T,T]     past_key/value.i [B,P,Hkv,D]
               |                     |                       |                        |
          embed_tokens         rotary(cos,sin)       visible = [ones(B,T,P) | tree_mask]  [B,T,P+T]
               |                     |                       |                        |
   layer i:  x = norm(h) -> q,k,v (+q/k norm) -> RoPE -> k,v ---> present_key/value.i [B,T,Hkv,D]
                                                   K = cat(past_k, k), V = cat(past_v, v)
             h += o_proj(attention(q, K, V, visible)) ;  h += mlp(norm(h))

               |
          final norm -> hidden_states [B,T,H] -> rows logits_rows [B,R] -> lm_head -> logits [B,R,V]

RoPE and attention are written with torch.onnx.ops, which export to the ONNX-23 RotaryEmbedding and
Attention ops on sequence-major [B, S, heads*D] tensors. The same math in plain torch ops (rotate_half,
SDPA on [B, H, S, D]) exports to ~40 kernels a layer instead of ~22 (Split/Neg/Concat/Mul per RoPE, four
Transposes for the head-major layout); on CPU, where a small model's step is mostly per-kernel cost,
that was a large share of every decode step.

No global monkeypatching: the HF model is only read.
"""
from __future__ import annotations

from specexport._optional import require

torch = require("torch")
nn = torch.nn
onnx_ops = torch.onnx.ops


class StaticKVDecoder(nn.Module):
    def __init__(self, model, adapter, arch, *, aux_hidden_layers=()):
        super().__init__()
        self.model = model
        self.adapter = adapter
        self.arch = arch
        self.aux_hidden_layers = tuple(aux_hidden_layers)
        self.embed = adapter.embed_tokens(model)
        self.decoder_layers = adapter.layers(model)
        self.norm = adapter.final_norm(model)
        self.head = adapter.lm_head(model)
        self.rotary = adapter.rotary(model)

    def forward(self, input_ids, position_ids, tree_mask, logits_rows, *past):
        B, T = input_ids.shape
        P = past[0].shape[1]
        h = self.embed(input_ids)                                   # [B, T, H]
        cos, sin = self.rotary(h, position_ids)                     # [B, T, D] each: two equal halves
        half = self.arch.head_dim // 2
        cos, sin = cos[..., :half], sin[..., :half]                 # [B, T, D/2]
        visible = self._visible(tree_mask, P)                       # [B, 1, T, P+T]
        aux, presents = [], []
        for i, layer in enumerate(self.decoder_layers):
            if i in self.aux_hidden_layers:
                aux.append(h)
            h, k, v = self._layer(layer, h, cos, sin, visible, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        h = self.norm(h)                                            # [B, T, H]
        rows = torch.gather(h, 1, logits_rows.unsqueeze(-1).expand(-1, -1, h.shape[-1]))   # [B, R, H]
        logits = self.head(rows)                                    # [B, R, V] only the rows asked for
        outs = [logits.float(), h.float()]
        if self.aux_hidden_layers:
            outs.append(torch.cat(aux, dim=-1).float())             # [B, T, k*H]
        return (*outs, *presents)

    @staticmethod
    def _visible(tree_mask, past_length):
        """What each new token may attend to: every committed position, and its tree ancestors."""
        B, T, _ = tree_mask.shape
        committed = torch.ones((B, T, past_length), dtype=torch.bool, device=tree_mask.device)
        return torch.cat([committed, tree_mask], dim=-1).unsqueeze(1)

    def _layer(self, layer, h, cos, sin, visible, past_k, past_v):
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
        out, k, v = self._attend(q, k, v, past_k, past_v, visible, scale=attn.scaling)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, k, v

    def _attend(self, q, k, v, past_k, past_v, visible, *, scale):
        """q [B, T, Hq*D], k and v [B, T, Hkv*D] (after RoPE) -> (attention output [B, T, Hq*D], the
        layer's two KV outputs). Here: concatenate the committed past and attend under `visible`;
        the outputs are the new tokens' K/V. (benchmarks/inplace_kv.py overrides this.)"""
        B, T, _ = q.shape
        P, hkv, d = past_k.shape[1], self.arch.num_kv_heads, self.arch.head_dim
        keys = torch.cat([past_k.reshape(B, P, hkv * d), k], dim=1)       # [B, P+T, Hkv*D]
        values = torch.cat([past_v.reshape(B, P, hkv * d), v], dim=1)     # [B, P+T, Hkv*D]
        out = onnx_ops.attention(q, keys, values, attn_mask=visible, q_num_heads=self.arch.num_heads,
                                 kv_num_heads=hkv, scale=scale)[0]  # [B, T, Hq*D]
        return out, k.view(B, T, hkv, d), v.view(B, T, hkv, d)
