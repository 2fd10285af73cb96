from specexport.export.adapters.base import DecoderAdapter
from specexport.export.registry import register_adapter


@register_adapter("qwen2")
class Qwen2Adapter(DecoderAdapter):
    """Llama layout with q/k/v biases: the biases live in the Linear modules, nothing to override."""


@register_adapter("qwen3")
class Qwen3Adapter(DecoderAdapter):
    """Llama layout plus per-head RMSNorm of q and k before RoPE."""

    qk_norm = True
