"""config.json of the published EAGLE layouts for a head train-heads makes for a target (the module itself is
heads/eagle_torch.py's, shared with the build's parity reference)."""
from __future__ import annotations


def head_config(tcfg, version: int, *, aux_layers=(), draft_vocab: int | None = None,
                intermediate: int | None = None, dtype: str = "float32", target: str = "") -> dict:
    """config.json of the published layouts for a head on target config `tcfg`: a one-layer Llama config
    with the target's attention shape, MLP width (unless `intermediate`), norm eps and RoPE (rope_theta,
    and its scaling as rope_scaling), + EAGLE-3's draft vocabulary and aux layers, EAGLE-1's "bias"."""
    heads = tcfg.num_attention_heads
    rope = dict(getattr(tcfg, "rope_parameters", None) or getattr(tcfg, "rope_scaling", None) or {})
    theta = float(rope.get("rope_theta") or getattr(tcfg, "rope_theta", None) or 10000.0)
    cfg = {"architectures": ["LlamaForCausalLMEagle3" if version == 3 else "LlamaForCausalLMEagle"],
           "model_type": "llama", "hidden_size": tcfg.hidden_size, "num_attention_heads": heads,
           "num_key_value_heads": getattr(tcfg, "num_key_value_heads", None) or heads,
           "head_dim": getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
           "intermediate_size": intermediate or tcfg.intermediate_size, "num_hidden_layers": 1,
           "hidden_act": "silu", "rms_norm_eps": float(getattr(tcfg, "rms_norm_eps", 1e-6)), "rope_theta": theta,
           "max_position_embeddings": getattr(tcfg, "max_position_embeddings", 2048), "vocab_size": tcfg.vocab_size,
           "bos_token_id": getattr(tcfg, "bos_token_id", None), "eos_token_id": getattr(tcfg, "eos_token_id", None),
           "tie_word_embeddings": False, "torch_dtype": dtype, "target_model": target}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        cfg["rope_scaling"] = {**rope, "rope_theta": theta}
    if version == 3:
        cfg.update(draft_vocab_size=draft_vocab or tcfg.vocab_size,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
    else:
        cfg["bias"] = True
    return cfg
