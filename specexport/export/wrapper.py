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
          final norm -> hidden_states [B,T,H] -> lm_head -> logits [B,T,V]

No global monkeypatching: the HF model is only read.
"""
from __future__ import annotations

from specexport._optional import require

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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

    def forward(self, input_ids, position_ids, tree_mask, *past):
        B, T = input_ids.shape
        P = past[0].shape[1]
        h = self.embed(input_ids)                                   # [B, T, H]
        cos, sin = self.rotary(h, position_ids)                     # [B, T, D] each
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)               # [B, T, 1, D]
        committed = torch.ones((B, T, P), dtype=torch.bool, device=h.device)
        visible = torch.cat([committed, tree_mask], dim=-1).unsqueeze(1)   # [B, 1, T, P+T]
        aux, presents = [], []
        for i, layer in enumerate(self.decoder_layers):
            if i in self.aux_hidden_layers:
                aux.append(h)
            h, k, v = self._layer(layer, h, cos, sin, visible, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        h = self.norm(h)                                            # [B, T, H]
        logits = self.head(h)                                       # [B, T, V]
        outs = [logits.float(), h.float()]
        if self.aux_hidden_layers:
            outs.append(torch.cat(aux, dim=-1).float())             # [B, T, k*H]
        return (*outs, *presents)

    def _layer(self, layer, h, cos, sin, visible, past_k, past_v):
        attn, arch = layer.self_attn, self.arch
        B, T, _ = h.shape
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(B, T, arch.num_heads, arch.head_dim)        # [B, T, Hq, D]
        k = attn.k_proj(x).view(B, T, arch.num_kv_heads, arch.head_dim)     # [B, T, Hkv, D]
        v = attn.v_proj(x).view(B, T, arch.num_kv_heads, arch.head_dim)     # [B, T, Hkv, D]
        if self.adapter.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys = torch.cat([past_k, k], dim=1).transpose(1, 2)        # [B, Hkv, P+T, D]
        values = torch.cat([past_v, v], dim=1).transpose(1, 2)      # [B, Hkv, P+T, D]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=visible,
            scale=attn.scaling, enable_gqa=arch.num_heads != arch.num_kv_heads,
        )                                                           # [B, Hq, T, D]
        h = h + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, k, v
