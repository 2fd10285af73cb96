"""DecoderAdapter: where a decoder-only HF model keeps the pieces the static-KV wrapper calls.

The defaults are the transformers naming shared by Llama-style models. A new architecture subclasses
this, registers its model_type and overrides only what differs (see DESIGN.md beside this folder).
"""
from __future__ import annotations


class DecoderAdapter:
    model_types: tuple[str, ...] = ()
    qk_norm: bool = False           # per-head RMSNorm on q and k before RoPE (qwen3)
    parity_tolerance = {"fp32": 1e-4}   # max|Δlogits| / max|logits| against PyTorch

    # Each accessor takes the *ForCausalLM module.
    def embed_tokens(self, model):
        return model.model.embed_tokens

    def layers(self, model):
        return model.model.layers

    def final_norm(self, model):
        return model.model.norm

    def lm_head(self, model):
        return model.lm_head

    def rotary(self, model):
        return model.model.rotary_emb
