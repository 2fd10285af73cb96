"""A Hugging Face checkpoint written as a GGUF file, its weights quantized into ggml's blocks.

Why: the CPU kernels (plugins/cpu) multiply GGUF blocks, so a checkpoint quantized into them runs on the
kernels through the lean GGUF route (builder/stages/blocks.py), and the same file runs in llama.cpp: the
bench compares both on identical bytes. The gguf package writes the file (GGUFWriter, its tensor name
map, SpecialVocab for merges and special tokens); what it lacks is written here: the K-quant
quantizers (quant/kquant.py) and llama-quantize's choice of block type per tensor:

    mix     precision  per tensor (llama-quantize's type of that name: llama_tensor_get_type)
    q8_0    int8       every matrix Q8_0
    q4_k_m  int4       output (or a tied embedding) Q6_K; attn_v and ffn_down Q6_K in the layers
                       use_more_bits picks (the first and last eighth, every third between), Q4_K
                       elsewhere; rows not a multiple of 256 weights take Q5_0 for Q4_K, Q8_0 for Q6_K
    q4_0, q4_1 int4    output (or a tied embedding) Q6_K (Q8_0 where rows are not 256s), the rest Q4_0 / Q4_1
                       (what fits bandwidth-bound CPUs where rows are not 256s: Q4_K_M is mostly Q5_0 then)
    every mix: vectors (norms, biases) F32

Tensors are read, quantized and written one at a time (the file's tensor table is planned first from
the shapes), so memory holds one fp32 tensor, not the model.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.schemes import default_scheme

ARCHES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}   # what transformers reads back (not mistral)
# mix -> (base block type, llama.cpp's file type); each is llama-quantize's type of that name
MIXES = {"q8_0": ("Q8_0", "MOSTLY_Q8_0"), "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M"), "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
         "q4_1": ("Q4_1", "MOSTLY_Q4_1"), "f32": ("F32", "ALL_F32")}
PRECISION_MIXES = {"int8": ("q8_0",), "int4": ("q4_k_m", "q4_1", "q4_0")}     # the first: the default
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
BLOCK = {"Q4_K": 256, "Q6_K": 256, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "F32": 1}
# Qwen2's pre-tokenizer in llama.cpp (llama-vocab.cpp), beside the splits export/gguf.py checks files with
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in a Q4_K_M file."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple, mix: str, *, n_layers: int, tied: bool) -> str:
    """The block type of GGUF tensor `name` ([rows, K]) in a file of `mix` (MIXES)."""
    base = MIXES[mix][0]
    if len(shape) < 2 or base == "F32":
        return "F32"
    qtype = base
    if (name == "output.weight" or (tied and name == "token_embd.weight")) and base != "Q8_0":
        qtype = "Q6_K" if shape[-1] % 256 == 0 else "Q8_0"
    elif mix == "q4_k_m" and name.endswith((".attn_v.weight", ".ffn_down.weight")):
        if use_more_bits(int(name.split(".")[1]), n_layers):
            qtype = "Q6_K"
    if shape[-1] % BLOCK[qtype]:
        qtype = FALLBACK.get(qtype, qtype)
    if shape[-1] % BLOCK[qtype]:
        raise SpecexportError(f"{name}: rows of {shape[-1]} weights are not a multiple of {BLOCK[qtype]}, "
                              f"which {qtype} (and every block type of the {mix} mix) needs")
    return qtype


def unwritable(config) -> str | None:
    """Why checkpoint config (transformers') cannot be written as blocks, or None: the architecture, RoPE,
    or a matrix whose rows are not a multiple of 32 weights (every block type's least)."""
    if config.model_type not in ARCHES:
        return f"model_type {config.model_type} (blocks are written for {', '.join(ARCHES)})"
    kind = _rope_parameters(config).get("rope_type", "default")
    if kind not in ("default", "llama3"):
        return f"RoPE {kind} (blocks are written for default and llama3 RoPE)"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rows = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "heads x head_dim": config.num_attention_heads * head_dim}
    odd = [f"{k} {v}" for k, v in rows.items() if v % 32]
    return f"rows of {', '.join(odd)} weights (not a multiple of 32)" if odd else None


def blocks_or_matmulnbits(mc, hf_config) -> tuple:
    """The model's quantization with MatMulNBits where its int8/int4 ask for blocks (the default) and the
    checkpoint cannot be written as blocks; ((precision, why), ...) for the plan's lines and the manifest."""
    asked = [p for p in mc.precisions if mc.quantization.get(p, {}).get("scheme") == "blocks"]
    why = unwritable(hf_config) if asked else None
    if why is None:
        return mc, ()
    quantization = {**mc.quantization, **{p: default_scheme(p, "matmulnbits") for p in asked}}
    return dataclasses.replace(mc, quantization=quantization), tuple((p, why) for p in asked)


def write_gguf(hf_dir, dest, mix: str, *, importance: dict | None = None, steps=None) -> dict:
    """Write checkpoint folder `hf_dir` to GGUF file `dest` quantized as `mix` (MIXES; f32: unquantized,
    what llama-quantize takes). importance: {HF weight name: [K]} (quant/imatrix.py), which the types that
    take one weigh their errors by (llama-quantize --imatrix). Returns {"types": {gguf name: block type},
    "pre": ..., "tensors": n}. steps: _console.Steps, advanced per tensor."""
    gguf, transformers = require("gguf"), require("transformers")
    from specexport.quant import kquant

    hf_dir = Path(hf_dir)
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    if config.model_type not in ARCHES:
        raise SpecexportError(f"{hf_dir}: writing a GGUF file supports model_type {', '.join(ARCHES)}; "
                              f"config.json has {config.model_type!r}")
    arch = getattr(gguf.MODEL_ARCH, ARCHES[config.model_type])
    tensors = _checkpoint_tensors(hf_dir)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan = {}
    for hf, (shape, _) in tensors.items():
        if hf.endswith("rotary_emb.inv_freq") or (tied and hf == "lm_head.weight"):
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SpecexportError(f"{hf_dir}: tensor {hf} has no GGUF name for {ARCHES[config.model_type].lower()} "
                                  f"(the gguf package's tensor name map)")
        plan[name] = (hf, shape, tensor_type(name, shape, mix, n_layers=config.num_hidden_layers, tied=tied))
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    _hparams(writer, config, gguf, mix)
    pre = _tokenizer(writer, hf_dir, gguf)
    extra = _rope_freqs(config)
    if extra is not None:
        writer.add_tensor_info("rope_freqs.weight", extra.shape, np.float32, extra.nbytes)
    for name, (_, shape, qtype) in plan.items():
        if qtype == "F32":
            writer.add_tensor_info(name, shape, np.float32, 4 * int(np.prod(shape)))
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            row = shape[-1] // block * size
            writer.add_tensor_info(name, (*shape[:-1], row), np.uint8, row * int(np.prod(shape[:-1])), raw_dtype=qt)
    writer.write_header_to_file(path=Path(dest))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if extra is not None:
        writer.write_tensor_data(extra)
    if steps is not None:
        steps.total(len(plan))
    importance = importance or {}
    for name, (hf, shape, qtype) in plan.items():
        w = _gguf_order(tensors[hf][1](), name, config)
        seen = importance.get("lm_head.weight" if tied and name == "token_embd.weight" else hf)   # the output's
        writer.write_tensor_data(w if qtype == "F32" else kquant.quantize(w.reshape(-1, shape[-1]), qtype, seen))
        if steps is not None:
            steps.advance()
    writer.close()
    return {"types": {n: t for n, (_, _, t) in plan.items()}, "pre": pre, "tensors": len(plan),
            "file_type": MIXES[mix][1]}


def _checkpoint_tensors(hf_dir: Path) -> dict:
    """HF name -> (shape, a function loading it as float32 numpy): safetensors files, read lazily."""
    torch = require("torch")
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise SpecexportError(f"{hf_dir}: no *.safetensors weights (writing a GGUF file reads safetensors only)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                shape = tuple(st.get_slice(key).get_shape())
                out[key] = (shape, lambda f=f, key=key: _load(torch, safe_open, f, key))
    return out


def _load(torch, safe_open, f: Path, key: str) -> np.ndarray:
    with safe_open(str(f), framework="pt") as st:
        return st.get_tensor(key).to(torch.float32).numpy()


def _gguf_order(w: np.ndarray, name: str, config) -> np.ndarray:
    """llama.cpp's row order: a llama's q/k rows are interleaved per head as its convert script permutes them
    (transformers' GGUF loader undoes it: export/gguf_weights.py)."""
    if ARCHES[config.model_type] != "LLAMA" or not name.endswith((".attn_q.weight", ".attn_k.weight")):
        return np.ascontiguousarray(w, dtype=np.float32)
    heads = config.num_attention_heads if name.endswith(".attn_q.weight") else config.num_key_value_heads
    return np.ascontiguousarray(w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape), dtype=np.float32)


def _rope_parameters(config) -> dict:
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def _hparams(writer, config, gguf, mix: str) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(Path(getattr(config, "_name_or_path", "") or "model").name or "model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(float(_rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, MIXES[mix][1]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _rope_freqs(config):
    """llama3 RoPE scaling as llama.cpp reads it: per-frequency factors in a rope_freqs tensor (None: no
    scaling). Other scalings are refused: written wrong, llama.cpp would run another model."""
    rope = _rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise SpecexportError(f"config.json rope_parameters.rope_type {kind!r}: writing a GGUF file supports "
                              f"default and llama3 RoPE")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _tokenizer(writer, hf_dir: Path, gguf) -> str:
    """tokenizer.ggml.* for a byte-level BPE tokenizer (tokenizer.json); returns the pre-tokenizer name."""
    f = hf_dir / "tokenizer.json"
    spec = json.loads(f.read_text()) if f.is_file() else {}
    if spec.get("model", {}).get("type") != "BPE":
        raise SpecexportError(f"{f}: writing a GGUF file supports BPE tokenizers (tokenizer.json model.type BPE)")
    vocab = dict(spec["model"]["vocab"])
    kinds = {}
    for t in spec.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        kinds[t["id"]] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    config = json.loads((hf_dir / "config.json").read_text())
    n = max(config.get("vocab_size", 0), max(vocab.values()) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(n)], [gguf.TokenType.UNUSED] * n
    for text, i in vocab.items():
        tokens[i], types[i] = text, kinds.get(i, gguf.TokenType.NORMAL)
    pre = _pre_tokenizer(hf_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=n).add_to_gguf(writer, quiet=True)
    return pre


def _pre_tokenizer(hf_dir: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer: the one a GGUF conversion recorded, else the first
    of the splits we know whose ids equal the tokenizer's on export/gguf.py's sample strings ("default":
    none does, and llama.cpp may cut text otherwise)."""
    from specexport.export.gguf import LLAMA_CPP_SPLITS, RECORD, SAMPLES, llama_cpp_ids

    record = hf_dir / RECORD
    if record.is_file():
        pre = json.loads(record.read_text()).get("tokenizer.ggml.pre")
        if pre:
            return pre
    backend = require("tokenizers").Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for name, splits in {**LLAMA_CPP_SPLITS, "qwen2": (QWEN2,)}.items():
        if all(backend.encode(t, add_special_tokens=False).ids == llama_cpp_ids(backend, t, splits) for t in SAMPLES):
            return name
    return "default"
