from specexport.export.adapters.base import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    """RMSNorm, RoPE (default, linear, llama3, yarn), GQA, SwiGLU. Nothing to override."""

    model_types = ("llama", "mistral")
