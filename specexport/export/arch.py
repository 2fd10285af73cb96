"""ArchSpec: the one place that reads Hugging Face config attributes.

Every fallback is an explicit, commented line, so a config that lacks a field fails or defaults
visibly here and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass

from specexport.errors import SpecexportError

# RoPE variants whose frequencies are fixed at load time (transformers' ROPE_INIT_FUNCTIONS without a
# sequence-length-dependent update), so one exported graph is exact at every position.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_type: str
    sliding_window: int | None        # active sliding window, None when every layer attends fully
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def arch_spec_from_hf(config) -> ArchSpec:
    """Normalize a transformers config (or anything with the same attributes) into an ArchSpec."""
    heads = config.num_attention_heads
    # Older configs have no num_key_value_heads: that means plain multi-head attention.
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    # head_dim is explicit in qwen3 and some mistral configs; otherwise hidden / heads.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # transformers 5 keeps RoPE settings in rope_parameters; 4.x in rope_scaling (None = default).
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ArchSpec(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        # transformers' default for a missing flag is True (PreTrainedConfig).
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        rope_type=rope_type,
        sliding_window=_active_sliding_window(config),
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=eos_ids,
        pad_token_id=getattr(config, "pad_token_id", None),
    )


def _active_sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    # qwen2/qwen3 carry a window but only use it when use_sliding_window is set; layer_types says
    # per layer in transformers 5.
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_supported(arch: ArchSpec, *, max_seq_len: int, where: str) -> None:
    """Refuse features the static-KV graph does not reproduce exactly. `where` names the config key."""
    if arch.rope_type not in STATIC_ROPE_TYPES:
        raise SpecexportError(
            f"{where}: rope type {arch.rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if max_seq_len > arch.max_position_embeddings:
        raise SpecexportError(
            f"max_seq_len: {max_seq_len} exceeds {where} max_position_embeddings "
            f"({arch.max_position_embeddings})"
        )
    if arch.sliding_window is not None and max_seq_len > arch.sliding_window:
        raise SpecexportError(
            f"max_seq_len: {max_seq_len} exceeds the sliding window ({arch.sliding_window}) of {where}; "
            f"sliding-window attention is not exported: use max_seq_len <= {arch.sliding_window}"
        )
