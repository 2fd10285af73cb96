"""Prompts for distillation and the target-generated sequences the draft learns from.

Prompts come from text files the user gives (one prompt per blank-line-separated paragraph) or are
windows drawn from a corpus folder (every *.py / *.txt / *.md file, in sorted order, seeded). The
target then continues each prompt by sampling; the draft later learns the target's next-token
distributions over prompt + continuation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError

CORPUS_SUFFIXES = (".py", ".txt", ".md", ".rst")


def corpus_files(folder: Path) -> list[Path]:
    """The corpus: a folder (its *.py/*.txt/*.md/*.rst files, recursively) or a text file listing files."""
    folder = Path(folder)
    if folder.is_file():
        files = [Path(line.strip()) for line in folder.read_text().splitlines() if line.strip()]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise SpecexportError(f"--corpus: {folder} lists files that do not exist: {missing[:3]}")
    elif folder.is_dir():
        files = sorted(p for p in folder.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file())
    else:
        raise SpecexportError(f"--corpus: {folder} does not exist")
    if not files:
        raise SpecexportError(f"--corpus: {folder} has no {', '.join(CORPUS_SUFFIXES)} files")
    return files


def prompts_from_files(paths, tokenizer, *, max_tokens: int) -> list[list[int]]:
    """One prompt per blank-line-separated paragraph, left-truncated to max_tokens tokens."""
    prompts = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise SpecexportError(f"--prompts: {path} does not exist")
        for para in path.read_text(errors="replace").split("\n\n"):
            if para.strip():
                ids = tokenizer(para, add_special_tokens=True).input_ids
                prompts.append(ids[-max_tokens:])
    if not prompts:
        raise SpecexportError(f"--prompts: no non-empty paragraphs in {', '.join(map(str, paths))}")
    return prompts


def prompts_from_corpus(folder: Path, tokenizer, *, count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` windows of `tokens` tokens from random positions of random corpus files (seeded)."""
    rng = np.random.default_rng(seed)
    files = corpus_files(folder)
    prompts, tries = [], 0
    while len(prompts) < count and tries < 20 * count:
        tries += 1
        text = files[rng.integers(len(files))].read_text(errors="replace")
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= tokens:
            continue
        start = int(rng.integers(0, len(ids) - tokens))
        prompts.append(ids[start:start + tokens])
    if len(prompts) < count:
        raise SpecexportError(f"--corpus: found only {len(prompts)} windows of {tokens} tokens in {folder}")
    return prompts


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(prompts: list[list[int]], tokenizer) -> list[list[int]]:
    """Each prompt's text as one user message of the tokenizer's chat template, with the generation
    prompt (add_generation_prompt=True): what a chat deployment's target continues. The template's own
    special tokens (BOS, role markers) come from its text, so the ids are encoded without adding more."""
    rendered = []
    for ids in prompts:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        rendered.append(tokenizer(chat, add_special_tokens=False).input_ids)
    return rendered


def generate_sequences(model, prompts: list[list[int]], *, new_tokens: int, batch_size: int, seed: int,
                       eos_ids=(), temperature: float = 1.0, progress=None) -> list[list[int]]:
    """The target's sampled continuations: prompt + up to new_tokens tokens each, cut after EOS (seeded).

    Prompts of equal length are batched together, so no padding enters the target's inputs.
    """
    torch = require("torch")
    device = next(model.parameters()).device
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    results: dict[int, list[int]] = {}
    for length in sorted(groups):
        idx = groups[length]
        for start in range(0, len(idx), batch_size):
            chunk = idx[start:start + batch_size]
            torch.manual_seed(seed + chunk[0])
            ids = torch.tensor([prompts[i] for i in chunk], device=device)
            with torch.no_grad():
                seqs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                      pad_token_id=eos_ids[0] if eos_ids else 0)
            for i, seq in zip(chunk, seqs.cpu().tolist()):
                results[i] = _cut_after_eos(seq, length, eos_ids)
            if progress:
                progress(len(results))
    return [results[i] for i in range(len(prompts))]


def _cut_after_eos(seq: list[int], prompt_len: int, eos_ids) -> list[int]:
    for j in range(prompt_len, len(seq)):
        if seq[j] in eos_ids:
            return seq[:j + 1]
    return seq
