"""Done-means of issue 14 on a pair the tests never saw: a reduced-vocabulary draft (draft.vocab, e.g.
from `distill-draft --draft-vocab N`) decodes greedily equal to vanilla, and sampled speculative output
at temperature 1 follows the target's exact distribution, tokens outside the draft's vocabulary included.

    python benchmarks/check_reduced_vocab.py BUILD --prompts examples/demo/prompts/code.jsonl [--samples 3000]

1. greedy: vanilla vs draft chains (γ 1..5) on the prompts, 64 new tokens each, token for token;
2. G-test on the first two tokens of sampled speculative decoding (γ 3, temperature 1, one seed per
   sample, 3 new tokens: x1 comes from the prefill, x2 from the first draft-verify round, whose
   proposal is accepted, rejected or replaced through the residual) against the exact joint
   p(x1) p(x2 | x1) computed with the fp32 target graph: cells are
   the (x1, x2) pairs with an expected count >= 5, an "other x2" cell per such x1 and one "other"
   cell for the rest. The prompt is the one (of the first 8) where the target puts the most mass
   outside the draft's vocabulary, so the residual path is exercised; the observed and expected share
   of out-of-vocabulary tokens are printed beside the test.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import specexport
from specexport.manifest import read_manifest
from two_token_gtest import prepare

GAMMA = 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--greedy-prompts", type=int, default=6)
    args = ap.parse_args()
    m = read_manifest(args.build)
    vocab = np.array(m["models"]["draft"]["vocab_ids"])
    in_vocab = np.zeros(m["models"]["target"]["io"]["vocab_size"], bool)
    in_vocab[vocab] = True
    print(f"{args.build}: draft vocabulary {len(vocab)} of {len(in_vocab)} ids "
          f"({m['models']['draft'].get('vocab_source')})")
    pipe = specexport.load(args.build)
    texts = [json.loads(line) for line in open(args.prompts) if line.strip()]
    prompts = [pipe.encode(t)[-48:] for t in texts]

    print(f"1. greedy, {args.greedy_prompts} prompts x 64 tokens: vanilla vs draft γ 1..5")
    for p in prompts[:args.greedy_prompts]:
        ref = pipe.generate(prompt_ids=p, max_new_tokens=64, method="vanilla").token_ids
        same = [pipe.generate(prompt_ids=p, max_new_tokens=64, method="draft", gamma=g).token_ids == ref
                for g in range(1, 6)]
        outside = sum(not in_vocab[t] for t in ref)
        print(f"   {len(ref)} tokens ({outside} outside the draft's vocabulary): equal {same}")

    n = args.samples
    test = prepare(args.build, m, prompts, in_vocab, n)
    k, prompt, p1, expected = test.prompt_index, test.prompt, test.p1, test.expected
    oov_exact = p1[~in_vocab].sum()
    print(f"2. G-test: prompt {k} ({len(prompt)} tokens), target mass outside the draft's vocabulary at "
          f"token 1: {oov_exact:.3f}; {len(expected)} cells, {n} samples (γ {GAMMA}, temperature 1)")
    observed = np.zeros(len(expected))
    oov = oov2 = accepted = proposed = 0
    start = time.perf_counter()
    for s in range(n):
        out = pipe.generate(prompt_ids=prompt, max_new_tokens=3, method="draft", gamma=GAMMA, temperature=1.0,
                            seed=1000 + s)     # 3: with 2 the budget leaves the round after x1 nothing to propose
        x, y = out.token_ids[:2]
        if out.stats.proposed == 0:
            raise SystemExit(f"sample {s}: no proposal was made, so x2 did not go through speculation")
        observed[test.cell(x, y)] += 1
        oov += not in_vocab[x]
        oov2 += not in_vocab[y]
        accepted, proposed = accepted + out.stats.accepted, proposed + out.stats.proposed
    g, p, dof = test.g_test(observed)
    print(f"   G = {g:.1f} on {dof} degrees of freedom, p = {p:.3f}; first token outside the draft's "
          f"vocabulary in {oov / n:.3f} of samples (exact {oov_exact:.3f}), second token {oov2 / n:.3f}; acceptance "
          f"{accepted / max(proposed, 1):.3f} of {proposed} proposals; "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
