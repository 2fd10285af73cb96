from specexport.export.adapters.base import DecoderAdapter
from specexport.export.registry import register_adapter


@register_adapter("llama", "mistral")
class LlamaAdapter(DecoderAdapter):
    """RMSNorm, RoPE (default, linear, llama3, yarn), GQA, SwiGLU. Nothing to override."""
