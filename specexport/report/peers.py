"""Peers measured on the same weights and prompt tokens, interleaved with our runs in one bench.

- transformers (PyTorch, CPU): plain greedy `generate`, and assisted generation with
  `assistant_model=` the draft, from the checkpoints named in the manifest (`models.<role>.source`).
- onnxruntime-genai: its model builder makes its own graph from the same target checkpoint
  (`python -m onnxruntime_genai.models.builder -p fp32|int4 -e cpu`, cached under the bench's output
  folder); measured with plain greedy search and with its n-gram (prompt lookup) speculation
  (`speculative: {ngram_size, max_draft_tokens}` in genai_config.json).
A peer whose package is missing or whose build fails is skipped, and the report says why.

Every peer is a `Peer`: `run(prompt_ids, max_new_tokens) -> generated ids`, greedy, so the bench
can also report whether its tokens equal ours.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# precisions of ours that onnxruntime-genai's builder has a counterpart of: its int4 is weight-only
# MatMulNBits like ours, but its quantization choices differ, so its greedy tokens differ from ours
# (the row says how often they match); its int8 is another scheme altogether and is left out
ORT_GENAI_PRECISIONS = {"fp32": "fp32", "int4": "int4"}
NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}


@dataclass
class Peer:
    name: str
    precision: str
    run: Callable[[list[int], int], list[int]]


def open_peers(manifest: dict, precisions, *, work_dir: Path, log=print) -> tuple[list[Peer], list[dict]]:
    """The peers that can run here, and a {"peer", "skipped"} record for each one that cannot."""
    peers, skipped = [], []
    sources = {role: Path(m["source"]) for role, m in manifest["models"].items()}
    missing = [p for p in ("torch", "transformers") if importlib.util.find_spec(p) is None]
    if missing:
        skipped.append({"peer": "transformers", "skipped": f"not installed: {', '.join(missing)}"})
    elif not all(p.is_dir() for p in sources.values()):
        skipped.append({"peer": "transformers", "skipped": f"checkpoints not found: {sorted(map(str, sources.values()))}"})
    else:
        peers += _transformers(sources)
    if importlib.util.find_spec("onnxruntime_genai") is None:
        skipped.append({"peer": "onnxruntime-genai", "skipped": "not installed (pip install onnxruntime-genai)"})
    elif missing:
        skipped.append({"peer": "onnxruntime-genai", "skipped": f"its model builder needs {', '.join(missing)}"})
    else:
        for p in precisions:
            if p not in ORT_GENAI_PRECISIONS:
                skipped.append({"peer": f"onnxruntime-genai {p}", "skipped": f"no counterpart of our {p} in its builder"})
                continue
            try:
                peers += _ort_genai(sources["target"], p, Path(work_dir) / f"onnxruntime-genai-{p}", log)
            except RuntimeError as e:
                skipped.append({"peer": f"onnxruntime-genai {p}", "skipped": str(e)})
    log(f"peers: {', '.join(f'{p.name} ({p.precision})' for p in peers) or 'none'}")
    return peers, skipped


def _transformers(sources) -> list[Peer]:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    target = transformers.AutoModelForCausalLM.from_pretrained(sources["target"], dtype=torch.float32).eval()
    draft = (transformers.AutoModelForCausalLM.from_pretrained(sources["draft"], dtype=torch.float32).eval()
             if "draft" in sources else None)
    eos = target.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos

    def runner(**extra):
        def run(ids: list[int], max_new_tokens: int) -> list[int]:
            x = torch.tensor([ids])
            with torch.no_grad():
                out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=pad, **extra)
            return out[0, len(ids):].tolist()
        return run

    peers = [Peer("transformers greedy", "fp32 (PyTorch)", runner())]
    if draft is not None:
        peers.append(Peer("transformers assisted", "fp32 (PyTorch)", runner(assistant_model=draft)))
    return peers


def _ort_genai(source: Path, precision: str, folder: Path, log) -> list[Peer]:
    import numpy as np
    import onnxruntime_genai as og

    plain = folder / "greedy"
    stamp = {"source": str(source), "precision": precision, "onnxruntime_genai": og.__version__}
    stamp_file = folder / "built_from.json"
    if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        shutil.rmtree(folder, ignore_errors=True)
        log(f"peers: building the onnxruntime-genai {precision} model from {source}")
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(plain),
               "-p", ORT_GENAI_PRECISIONS[precision], "-e", "cpu", "-c", str(folder / "cache")]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not (plain / "genai_config.json").is_file():
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"its builder failed (exit {res.returncode}): {tail[0]}")
        shutil.rmtree(folder / "cache", ignore_errors=True)
        ngram = folder / "ngram"
        shutil.copytree(plain, ngram)
        cfg = json.loads((ngram / "genai_config.json").read_text())
        cfg["speculative"] = dict(NGRAM)
        (ngram / "genai_config.json").write_text(json.dumps(cfg, indent=1))
        stamp_file.write_text(json.dumps(stamp))

    def runner(path: Path):
        model = og.Model(str(path))

        def run(ids: list[int], max_new_tokens: int) -> list[int]:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
            gen = og.Generator(model, params)
            gen.append_tokens(np.asarray([ids], dtype=np.int32))
            while not gen.is_done():
                gen.generate_next_token()
            return [int(t) for t in gen.get_sequence(0)[len(ids):]]
        return run

    return [Peer("onnxruntime-genai greedy", precision, runner(plain)),
            Peer(f"onnxruntime-genai n-gram (n={NGRAM['ngram_size']}, k={NGRAM['max_draft_tokens']})", precision,
                 runner(folder / "ngram"))]
