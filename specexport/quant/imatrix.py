"""An importance matrix: per input column of every linear layer, the mean squared activation over
calibration tokens, what llama.cpp's `llama-imatrix` collects and ggml's `_impl` quantizers weigh each
weight's error by (quant/kquant.py). Collected from the fp32 PyTorch model (forward pre-hooks on every
nn.Linear), one sequence at a time; returned by GGUF-independent HF parameter name.

    collect(hf_dir, sequences) -> {"model.layers.0.self_attn.q_proj.weight": float32 [K], ..., "lm_head.weight": ...}
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require


def collect(hf_dir: Path, sequences, *, steps=None) -> dict[str, np.ndarray]:
    """Mean x^2 per input column of each linear layer's weight, over every token of `sequences` (token id
    arrays). steps: _console.Steps, advanced per sequence."""
    torch, transformers = require("torch"), require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            sums[name] = sums.get(name, 0) + (x * x).sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return pre
    handles = [m.register_forward_pre_hook(hook(f"{n}.weight")) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    if steps is not None:
        steps.total(len(sequences))
    try:
        with torch.no_grad():
            for ids in sequences:
                model(torch.as_tensor(np.asarray(ids, np.int64))[None])
                if steps is not None:
                    steps.advance()
    finally:
        for h in handles:
            h.remove()
    del model
    return {name: (sums[name] / counts[name]).to(torch.float32).numpy() for name in sums}
