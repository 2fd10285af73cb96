"""Peers measured on the same weights and prompts, in the same bench run.

- transformers: plain greedy `generate` and assisted generation (`assistant_model=` the draft),
  PyTorch on CPU, from the checkpoints named in the manifest (`models.<role>.source`);
- onnxruntime-genai: reported as skipped unless the package is importable (its builder needs the
  HF checkpoint and a separate model folder; not wired up yet).
A peer whose package is missing is skipped and the report says why.
"""
from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path


def run_peers(manifest: dict, prompts, *, max_new_tokens: int, rounds: int, log=print) -> list[dict]:
    rows = []
    missing = [p for p in ("torch", "transformers") if importlib.util.find_spec(p) is None]
    sources = {role: Path(m["source"]) for role, m in manifest["models"].items()}
    if missing:
        rows.append({"peer": "transformers", "skipped": f"not installed: {', '.join(missing)}"})
    elif not all(p.is_dir() for p in sources.values()):
        rows.append({"peer": "transformers", "skipped": f"checkpoints not found: {sorted(map(str, sources.values()))}"})
    else:
        rows += _transformers(sources, prompts, max_new_tokens=max_new_tokens, rounds=rounds, log=log)
    if importlib.util.find_spec("onnxruntime_genai") is None:
        rows.append({"peer": "onnxruntime-genai", "skipped": "not installed (pip install onnxruntime-genai)"})
    else:
        rows.append({"peer": "onnxruntime-genai", "skipped": "installed, but its model builder is not wired up yet"})
    return rows


def _transformers(sources, prompts, *, max_new_tokens, rounds, log) -> list[dict]:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(sources["target"])
    target = transformers.AutoModelForCausalLM.from_pretrained(sources["target"], dtype=torch.float32).eval()
    draft = (transformers.AutoModelForCausalLM.from_pretrained(sources["draft"], dtype=torch.float32).eval()
             if "draft" in sources else None)
    configs = {"transformers greedy": {}}
    if draft is not None:
        configs["transformers assisted"] = {"assistant_model": draft}
    speeds = {k: [] for k in configs}
    log(f"peers: {', '.join(configs)}")
    for _ in range(rounds):
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            for name, extra in configs.items():
                start = time.perf_counter()
                with torch.no_grad():
                    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          do_sample=False, pad_token_id=tok.eos_token_id, **extra)
                speeds[name].append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - start))
    return [{"peer": name, "tokens_per_s": statistics.median(v), "precision": "fp32 (PyTorch)"}
            for name, v in speeds.items()]
