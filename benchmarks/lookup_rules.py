"""Prompt lookup's candidate rule, measured: tokens per target pass of greedy lookup for the shipped rule
(runtime/proposers/lookup.py: the highest match length - log2(distance + 1)) against "the longest n-gram
first, the most recent within it" (the rule before issue 33) and "the most recent occurrence".

Greedy output does not depend on the proposer, so each text is decoded once (vanilla) and every rule is
replayed on it: a round proposes γ tokens from the text so far, accepts the longest prefix that equals the
text and emits one more token. Texts come from a build (prompt files, JSON lines as `specexport bench
--workload` reads them; a conversation's first turn) and, with --random-llama N, from N randomly initialised
Llamas on random prompts (transformers; their greedy outputs loop, like an undertrained target's):

    python benchmarks/lookup_rules.py --build engines/smollm2-gguf --chat benchmarks/workloads/*.jsonl
    python benchmarks/lookup_rules.py --build engines/demo examples/demo/prompts/*.jsonl --random-llama 4
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specexport.runtime.proposers.lookup import _continue, continuations


def longest_first(context, depth, ngram_max=3):
    """The rule before issue 33: n from ngram_max down, the first n with a match wins, most recent first."""
    N = len(context)
    for n in range(min(ngram_max, N - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[:N - 1], n)
        starts = np.flatnonzero((windows == context[N - n:]).all(axis=1))
        if len(starts):
            return _continue(context, int(starts[-1]) + n, depth)
    return None


def most_recent(context, depth):
    c = continuations(context, depth=depth, ngram_max=1)
    return c[0] if c else None


def shipped(context, depth):
    c = continuations(context, depth=depth, ngram_max=16)
    return c[0] if c else None


RULES = {"shipped (L - log2(p + 1))": shipped, "longest n-gram first": longest_first, "most recent": most_recent}


def passes(seq: np.ndarray, start: int, rule, depth: int) -> int:
    pos, n = start, 0
    while pos < len(seq):
        proposal = rule(seq[:pos], depth)
        accepted = 0
        if proposal is not None:
            same = proposal[:len(seq) - pos] == seq[pos:pos + len(proposal)]
            accepted = len(same) if same.all() else int(np.argmin(same))
        pos, n = pos + accepted + 1, n + 1
    return n


def build_texts(build: str, files: list[str], chat: bool, new_tokens: int) -> dict:
    import specexport

    texts = {}
    with specexport.load(build) as pipe:
        for f in files:
            for line in Path(f).read_text().splitlines():
                if line.strip():
                    item = json.loads(line)
                    text = item if isinstance(item, str) else item["turns"][0]
                    ids = pipe.chat_ids(text) if chat else pipe.encode(text)
                    out = pipe.generate(prompt_ids=ids, max_new_tokens=new_tokens, method="vanilla").token_ids
                    texts.setdefault(Path(f).name, []).append((np.array(ids + out), len(ids)))
    return texts


def random_llama_texts(count: int, new_tokens: int) -> dict:
    import torch
    import transformers

    texts = {}
    for seed in range(count):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       initializer_range=0.04 + 0.01 * (seed % 2))
        model = transformers.LlamaForCausalLM(cfg).eval()
        rng = np.random.default_rng(seed)
        for _ in range(8):
            prompt = [1, *rng.integers(3, 2048, 8).tolist()]
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False)[0].numpy()
            texts.setdefault(f"random llama {seed}", []).append((out, len(prompt)))
    return texts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="JSON-lines prompt files (with --build)")
    ap.add_argument("--build")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--random-llama", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gammas", default="4,6")
    args = ap.parse_args()
    texts = build_texts(args.build, args.files, args.chat, args.new_tokens) if args.build else {}
    texts.update(random_llama_texts(args.random_llama, args.new_tokens) if args.random_llama else {})
    gammas = [int(g) for g in args.gammas.split(",")]
    print("| texts | tokens | γ | " + " | ".join(RULES) + " |")
    print("|---|---|---|" + "---|" * len(RULES))
    for name, items in texts.items():
        emitted = sum(len(seq) - start for seq, start in items)
        for g in gammas:
            cells = [emitted / sum(passes(seq, start, rule, g) for seq, start in items) for rule in RULES.values()]
            print(f"| {name} | {emitted} | {g} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
