"""A ~110M-parameter Llama (12 layers x 768, GQA 12/4, tied embeddings, random weights) and a 2-layer
draft cut from it, for the export and runtime benchmarks.

    python benchmarks/make_llama110m.py --out /tmp/llama110m
"""
import argparse
from pathlib import Path

from specexport.export.tiny import make_tiny_checkpoint, train_tokenizer, truncate_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="/tmp/llama110m")
args = parser.parse_args()
out = Path(args.out)
tok = train_tokenizer(vocab_size=4096)
make_tiny_checkpoint(out / "target", "llama", seed=0, tokenizer=tok, num_layers=12, hidden_size=768,
                     vocab_size=32000, num_attention_heads=12, num_key_value_heads=4, intermediate_size=3072,
                     tie_word_embeddings=True, initializer_range=0.02, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
truncate_checkpoint(out / "target", out / "draft", num_layers=2)
for cap in (128, 2048):
    (out / f"cap{cap}.yaml").write_text(
        f"name: llama110m-cap{cap}\ntarget: {{path: target}}\ndraft: {{path: draft}}\n"
        f"max_seq_len: {cap}\noutput: build-cap{cap}\n")
print(f"wrote {out}")
