from specexport.export.adapters.base import DecoderAdapter


class Qwen2Adapter(DecoderAdapter):
    """Llama layout with q/k/v biases: the biases live in the Linear modules, nothing to override."""

    model_types = ("qwen2",)


class Qwen3Adapter(DecoderAdapter):
    """Llama layout plus per-head RMSNorm of q and k before RoPE."""

    model_types = ("qwen3",)
    qk_norm = True
