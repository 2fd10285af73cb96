"""Issue 26's checks on a real build no test uses (SmolLM2-135M-Instruct from its GGUF file):

1. prompt lookup on text that loops: tokens proposed per round and tokens per target pass;
2. suffix decoding greedy, through one pipeline cache: every output equal to vanilla's;
3. suffix sampled at temperature 1 with the same seed as vanilla: the same text (runtime/sampling.Coins);
4. a two-token G-test at temperature 1 (the fp32 graph's exact p(x1) p(x2 | x1), two_token_gtest.py),
   the shared cache learning from every sample as it goes.

    python benchmarks/check_suffix.py engines/smol --precision fp32 --samples 2000
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from two_token_gtest import collect, prepare

LOOP = "Write the word 'echo' forty times, separated by spaces, and nothing else."
REPEATING = "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n\ndef h(x):\n    return x"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--samples", type=int, default=2000)
    args = ap.parse_args()

    import specexport
    from specexport.manifest import read_manifest

    root = Path(__file__).resolve().parents[1]
    code = [json.loads(line) for line in (root / "benchmarks/workloads/code_edit.jsonl").read_text().splitlines()]
    with specexport.load(args.build, precision=args.precision) as pipe:
        # 1. a loop
        ids = pipe.chat_ids(LOOP)
        out = pipe.generate(prompt_ids=ids, method="lookup", gamma=8, max_new_tokens=96, suffix_share=False)
        van = pipe.generate(prompt_ids=ids, method="vanilla", max_new_tokens=96, suffix_share=False)
        proposed = [p for p, _ in out.stats.rounds]
        full = sum(p == 8 for p in proposed)
        print(f"1. lookup γ 8 on a loop ({out.text[:40]!r}...): {out.stats.mean_accepted_tokens:.2f} tokens per "
              f"target pass, {full} of {len(proposed)} rounds proposed 8 tokens; output equal to vanilla: "
              f"{out.token_ids == van.token_ids}")
        # 2. greedy through one cache
        equal = passes = 0
        for text in code + code[:4]:                     # the first four twice: the cache has them then
            p = pipe.chat_ids(text)
            ref = pipe.generate(prompt_ids=p, method="vanilla", max_new_tokens=128, suffix_share=False)
            got = pipe.generate(prompt_ids=p, method="suffix", max_new_tokens=128)
            equal += got.token_ids == ref.token_ids
            passes += got.stats.target_passes
        print(f"2. suffix greedy = vanilla on {equal} of {len(code) + 4} code-edit requests "
              f"(cache {pipe.suffix_cache.tokens} tokens)")
        # 3. seeded sampling
        same = sum(pipe.generate(prompt_ids=pipe.encode(REPEATING), method="suffix", max_new_tokens=40,
                                 temperature=1.0, seed=s).token_ids
                   == pipe.generate(prompt_ids=pipe.encode(REPEATING), method="vanilla", max_new_tokens=40,
                                    temperature=1.0, seed=s, suffix_share=False).token_ids for s in range(20))
        print(f"3. temperature 1, same seed: suffix text = vanilla text for {same} of 20 seeds")
        # 4. the G-test
        manifest = read_manifest(Path(args.build))
        vocab = manifest["models"]["target"]["vocab_size"]
        test = prepare(Path(args.build), manifest, [pipe.encode(REPEATING)], np.ones(vocab, bool), args.samples)
        observed, accepted, _ = collect(
            test, lambda s: pipe.generate(prompt_ids=test.prompt, method="suffix", max_new_tokens=3,
                                          temperature=1.0, seed=10_000 + s), args.samples)
        g, pvalue, dof = test.g_test(observed)
        print(f"4. two-token G-test, suffix at temperature 1, {args.samples} samples (the cache learning from each: "
              f"{pipe.suffix_cache.tokens} tokens at the end, {accepted} proposals accepted): G = {g:.1f}, "
              f"{dof} d.o.f., p = {pvalue:.3f}")


if __name__ == "__main__":
    main()
