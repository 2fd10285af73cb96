"""Write a GGUF file of a real model's shape with seeded random weights (issue 25: "a 3B-shaped GGUF
builds on these machines"): the shapes of Qwen2.5-3B by default, the block types of a Q4_K_M file
(Q4_K, with Q6_K for half of the attn_v / ffn_down tensors and the embedding, as llama.cpp's Q4_K_M
mix does), and the tokenizer and chat template copied from a real GGUF of the same tokenizer family.

    python benchmarks/seeded_gguf.py --tokenizer-from /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --out /work/seeded/qwen2.5-3b-shaped-q4_k_m.gguf

The tensors are written one at a time (GGUFWriter's tensor-info-then-data mode): the script holds one
tensor in memory. The weights are random valid blocks (quant/gguf_blocks.random_blocks) with small
scales, so a forward pass stays finite through every layer; the file decodes to noise, which is all a
build-memory measurement needs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SHAPES = {   # Qwen2.5 configs (config.json of the published checkpoints)
    "qwen2.5-3b": {"layers": 36, "hidden": 2048, "ffn": 11008, "heads": 16, "kv_heads": 2, "vocab": 151936},
    "qwen2.5-1.5b": {"layers": 28, "hidden": 1536, "ffn": 8960, "heads": 12, "kv_heads": 2, "vocab": 151936},
    "qwen2.5-7b": {"layers": 28, "hidden": 3584, "ffn": 18944, "heads": 28, "kv_heads": 4, "vocab": 152064},
}
SKIP_KEYS = ("GGUF.", "general.", "qwen2.")        # written fresh below


def tensors(shape: dict):
    """(name, type, dims in ggml order: [K, N]) as llama.cpp's Q4_K_M writes a Qwen2 model."""
    h, f, v, L = shape["hidden"], shape["ffn"], shape["vocab"], shape["layers"]
    kv = h // shape["heads"] * shape["kv_heads"]
    yield "token_embd.weight", "Q6_K", (h, v)                  # tied: also the output projection
    for i in range(L):
        b = f"blk.{i}."
        big = "Q6_K" if i % 2 == 0 else "Q4_K"                   # Q4_K_M: more bits for half of attn_v, ffn_down
        yield b + "attn_norm.weight", "F32", (h,)
        yield b + "attn_q.weight", "Q4_K", (h, h)
        yield b + "attn_q.bias", "F32", (h,)
        yield b + "attn_k.weight", "Q4_K", (h, kv)
        yield b + "attn_k.bias", "F32", (kv,)
        yield b + "attn_v.weight", big, (h, kv)
        yield b + "attn_v.bias", "F32", (kv,)
        yield b + "attn_output.weight", "Q4_K", (h, h)
        yield b + "ffn_norm.weight", "F32", (h,)
        yield b + "ffn_gate.weight", "Q4_K", (h, f)
        yield b + "ffn_up.weight", "Q4_K", (h, f)
        yield b + "ffn_down.weight", big, (f, h)
    yield "output_norm.weight", "F32", (h,)


def data(rng, name: str, qtype: str, dims) -> np.ndarray:
    from specexport.quant.gguf_blocks import random_blocks

    if qtype == "F32":
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + 0.02 * rng.standard_normal(dims[0])).astype(np.float32)
    k, n = dims
    return random_blocks(rng, qtype, n, k=k, scale=2e-4 if qtype == "Q4_K" else 1e-3)


def write(out: Path, shape_name: str, tokenizer_from: Path, seed: int) -> None:
    import gguf

    shape = SHAPES[shape_name]
    source = gguf.GGUFReader(str(tokenizer_from))
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(f"{shape_name} shaped, seeded random weights (seed {seed})")
    w.add_block_count(shape["layers"])
    w.add_context_length(32768)
    w.add_embedding_length(shape["hidden"])
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, field in source.fields.items():
        if key.startswith(SKIP_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    plan = list(tensors(shape))
    for name, qtype, dims in plan:
        qt = gguf.GGMLQuantizationType[qtype]
        if qtype == "F32":
            w.add_tensor_info(name, dims[::-1], np.dtype(np.float32), 4 * dims[0])
        else:
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            k, n = dims
            w.add_tensor_info(name, (n, k // bs * ts), np.dtype(np.uint8), n * (k // bs) * ts, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, qtype, dims) in enumerate(plan):
        w.write_tensor_data(data(rng, name, qtype, dims))
        if i % 60 == 0:
            print(f"  {i + 1}/{len(plan)} tensors", flush=True)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-3b")
    ap.add_argument("--tokenizer-from", type=Path, required=True, help="a GGUF file whose tokenizer to copy")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; this script never overwrites a file")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    write(partial, args.shape, args.tokenizer_from, args.seed)
    partial.rename(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
