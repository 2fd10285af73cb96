"""Done-means of issue 11 on a build the tests never saw (e.g. examples/smollm2.yaml with its trained
EAGLE-3 head): greedy EAGLE decoding equals vanilla token for token, and sampled EAGLE output follows
the target's exact distribution, tokens outside the head's draft vocabulary included.

    python benchmarks/check_eagle.py BUILD --prompts examples/smollm2/heldout.jsonl --chat [--samples 3000]

1. greedy: vanilla vs EAGLE (tree auto, dynamic defaults, static `small`) on the prompts, 64 new tokens;
   prints tokens per target pass;
2. G-test on the first two tokens of sampled EAGLE decoding (temperature 1, one seed per sample, 3 new
   tokens: x1 comes from the prefill, x2 from the first EAGLE round, whose tree is accepted into or
   left through the q-free rule's own draw) against the exact joint p(x1) p(x2 | x1) from the fp32
   target graph: cells are the (x1, x2) pairs with an expected count >= 5, an "other x2" cell per such
   x1 and one "other" cell. The prompt is the one (of the first 8) where the target puts the most mass
   outside the head's draft vocabulary (EAGLE-3's d2t), so that path is exercised.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import specexport
from specexport.manifest import read_manifest
from two_token_gtest import collect, prepare


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--chat", action="store_true", help="prompts are user messages of the chat template")
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--greedy-prompts", type=int, default=8)
    args = ap.parse_args()
    m = read_manifest(args.build)
    head = m["heads"]["eagle"]
    V = m["models"]["target"]["io"]["vocab_size"]
    in_vocab = np.zeros(V, bool)
    in_vocab[head["target_ids"] if head["target_ids"] else np.arange(V)] = True
    print(f"{args.build}: EAGLE-{head['version']} head, draft vocabulary {int(in_vocab.sum())} of {V} ids, "
          f"tree auto {({k: head['auto_tree'][k] for k in ('top_k', 'depth', 'total_tokens')})}")
    pipe = specexport.load(args.build)
    texts = [json.loads(line) for line in open(args.prompts) if line.strip()]
    prompts = [pipe.chat_ids(t) if args.chat else pipe.encode(t) for t in texts]

    print(f"1. greedy, {args.greedy_prompts} prompts x 64 tokens: vanilla vs EAGLE trees auto / dynamic / small")
    for p in prompts[:args.greedy_prompts]:
        ref = pipe.generate(prompt_ids=p, max_new_tokens=64, method="vanilla").token_ids
        runs = [pipe.generate(prompt_ids=p, max_new_tokens=64, method="eagle", tree=t) for t in ("auto", "dynamic", "small")]
        print(f"   {len(ref)} tokens: equal {[r.token_ids == ref for r in runs]}, tokens per target pass "
              f"{[round(r.stats.mean_accepted_tokens, 2) for r in runs]}")

    n = args.samples
    test = prepare(args.build, m, prompts, in_vocab, n)
    k, prompt, p1, cond, expected = test.prompt_index, test.prompt, test.p1, test.cond, test.expected
    tops = list(cond)
    outside = {x: cond[x][~in_vocab].sum() for x in tops}
    exact_oov2 = sum(p1[x] * outside[x] for x in tops) / max(sum(p1[x] for x in tops), 1e-30)
    print(f"2. G-test: prompt {k} ({len(prompt)} tokens); {len(expected)} cells, {n} samples (EAGLE tree auto, "
          f"temperature 1); target mass outside the head's vocabulary at token 2: {exact_oov2:.3f}")
    oov = []
    start = time.perf_counter()
    observed, accepted, proposed = collect(
        test, lambda s: pipe.generate(prompt_ids=prompt, max_new_tokens=3, method="eagle", temperature=1.0,
                                      seed=1000 + s), n, each=lambda x, y: oov.append(not in_vocab[y]))
    oov2 = sum(oov)
    g, p, dof = test.g_test(observed)
    print(f"   G = {g:.1f} on {dof} degrees of freedom, p = {p:.3f}; second token outside the head's "
          f"vocabulary in {oov2 / n:.3f} of samples; acceptance {accepted / max(proposed, 1):.3f} of {proposed} "
          f"proposed nodes; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
