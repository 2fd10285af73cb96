"""Tiny random Hugging Face checkpoints, seeded, for tests and the quick start.

No hub: the tokenizer is a byte-level BPE trained here on Python standard-library source, and the
weights are random. One config per supported architecture (a test fails when an adapter has none).
"""
from __future__ import annotations

import inspect
from pathlib import Path

from specexport._optional import require

# Per model_type: the features that architecture brings, at toy size.
TINY_CONFIGS = {
    # GQA, untied embeddings, llama3 RoPE scaling
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # GQA, tied embeddings, explicit head_dim
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, head_dim=16,
                    sliding_window=None),
    # attention biases, tied embeddings
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # q/k norms, head_dim decoupled from hidden/heads
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, head_dim=16),
}

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer (transformers PreTrainedTokenizerFast) trained on stdlib source."""
    tokenizers = require("tokenizers")
    transformers = require("transformers")
    import json as _json
    import textwrap as _textwrap

    corpus = [inspect.getsource(m) for m in (_json, _textwrap)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_tiny_checkpoint(path, model_type: str = "llama", *, seed: int = 0, num_layers: int = 2,
                         hidden_size: int = 64, tokenizer=None, max_position_embeddings: int = 512,
                         **overrides) -> Path:
    """Write config.json, model.safetensors and tokenizer files of a random model to `path`."""
    torch = require("torch")
    transformers = require("transformers")
    path = Path(path)
    tokenizer = tokenizer or train_tokenizer()
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, max_position_embeddings=max_position_embeddings,
        initializer_range=0.1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        **TINY_CONFIGS[model_type],
    )
    fields.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def truncate_checkpoint(source, dest, *, num_layers: int) -> Path:
    """A draft made of the first `num_layers` layers of `source` (same embeddings, norm and head)."""
    transformers = require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(dest)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(dest)
    return Path(dest)
