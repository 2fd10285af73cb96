"""Draft-free rounds sized from the pass curve (runtime/budget.py): the arithmetic, and what suffix decoding
and prompt lookup propose with a flat curve (AMX-like), a steep one (AVX2-like) and none. Lossless sampling
and greedy equality with costs: tests/test_proposers.py and tests/test_suffix.py."""
from __future__ import annotations

import numpy as np
import pytest

from specexport.runtime.budget import DepthAcceptance, best_nodes, relative_costs
from specexport.runtime.loop import DecodeStats
from specexport.runtime.proposers import Limits, PromptLookup, SuffixProposer
from specexport.runtime.suffix import SuffixCache

ZEN4 = {1: 37.4, 2: 41.7, 4: 52.4, 8: 69.8, 16: 117.8}      # Qwen2.5-Coder-1.5B, ms (the stop 56 note)
FLAT = relative_costs({1: 10.0, 16: 11.0}, 16)
STEEP = relative_costs({1: 10.0, 2: 15.0, 16: 50.0}, 16)


def test_relative_costs_interpolate_and_extend_by_the_last_slope():
    c = relative_costs({"1": 37.4, "2": 41.7, "4": 52.4, "8": 69.8, "16": 117.8}, 20)
    assert c[0] == 0.0 and c[1] == 1.0 and len(c) == 21
    assert c[3] == pytest.approx((41.7 + 52.4) / 2 / 37.4) and c[16] == pytest.approx(117.8 / 37.4)
    assert c[20] == pytest.approx((117.8 + 4 * (117.8 - 69.8) / 8) / 37.4)
    assert relative_costs({1: 5.0}, 4).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    for bad in ({2: 1.0, 4: 2.0}, {1: 0.0, 2: 1.0}, {}):
        with pytest.raises(ValueError, match="M = 1"):
            relative_costs(bad, 8)


def test_best_nodes_worked_example():
    costs = relative_costs(ZEN4, 16)
    expected = 1 + np.cumsum([0.0, 0.9, 0.8, 0.3, 0.1])        # E(0..4)
    # E / c: 1, 1.9 / 1.115, 2.7 / 1.258, 3.0 / 1.401, 3.1 / 1.517 -> n = 2
    assert best_nodes(expected, costs) == 2
    assert best_nodes(expected, FLAT) == 4                     # every node pays where a pass costs a step
    assert best_nodes(1 + np.cumsum([0.0, 0.2, 0.1]), STEEP) == 0    # none pays at 1.5 steps for 2 rows
    assert best_nodes(np.arange(1.0, 30.0), costs) == 15       # never past the verify width


def test_depth_acceptance_counts_rounds_that_reached_each_depth_and_shrinks_toward_the_depth_above():
    a = DepthAcceptance(4, rate=0.5, prior=2.0)
    np.testing.assert_allclose(a.expected(2), [1.0, 1.5, 1.75])
    a.observe(4, 1)                     # depth 1 accepted, depth 2 rejected, 3-4 never judged
    np.testing.assert_allclose(a.reached, [1, 1, 0, 0]) and np.testing.assert_allclose(a.accepted, [1, 0, 0, 0])
    r1 = (1 + 2 * 0.5) / 3              # 2/3, then depth 2: (0 + 2 r1) / 3, depths 3-4 (never reached): depth 2's
    np.testing.assert_allclose(a.rates(4), [r1, 2 * r1 / 3, 2 * r1 / 3, 2 * r1 / 3])
    a.observe(2, 5)                     # more accepted than proposed: counted as proposed
    np.testing.assert_allclose(a.reached, [2, 2, 0, 0]) and np.testing.assert_allclose(a.accepted, [2, 1, 0, 0])


def propose(proposer, context, *, depth=15, nodes=15):
    seq = np.append(np.asarray(context, np.int64), np.zeros(depth + 1, np.int64))
    return proposer.propose(seq, len(context), Limits(depth, nodes), None, None, DecodeStats())


def test_suffix_trees_grow_where_passes_are_cheap_and_shrink_where_they_are_not():
    cache = SuffixCache(1000)
    for tail in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [5, 6, 7]):
        cache.add([8, 9, *tail])
    sizes = {}
    for name, costs in (("none", None), ("flat", FLAT), ("steep", STEEP)):
        proposer = SuffixProposer(8, cache=cache, spec_factor=8.0, min_prob=0.0, costs=costs)
        proposer.begin(np.array([8]), 64)
        p = propose(proposer, [8, 9])
        sizes[name] = 0 if p is None else len(p.tokens) - 1
    # probs 0.75 (1), 0.75 (1-2), 0.5 (1-2-3), 0.25 each (5, 1-2-4, 5-6, 5-6-7): all 7 fit the α·m budget;
    # steep (c 1, 1.5, 1.75, 2, 2.25 for 1..5 rows): E / c 1.17, 1.43, 1.5, 1.44 for 1..4 nodes -> 3
    assert sizes == {"none": 7, "flat": 7, "steep": 3}


def test_lookup_judges_every_depth_in_hindsight_and_sizes_its_chains_by_it():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]                   # [1, 2] occurred: copy [3, 4, 5, ..., 1]
    cont = [3, 4, 5, 6, 7, 8, 9, 1]

    def emitted(proposer, tokens):
        """A round at the end of ctx, then the target emitting `tokens`: the continuation judged."""
        seq = np.append(np.asarray(ctx + tokens, np.int64), np.zeros(17, np.int64))
        proposer.propose(seq, len(ctx), Limits(15, 15), None, None, DecodeStats())
        proposer.propose(seq, len(ctx) + len(tokens), Limits(15, 15), None, None, DecodeStats())

    steep = PromptLookup(8, ngram_max=2, costs=relative_costs(ZEN4, 16))
    steep.begin(np.array([1]), 64)
    first = propose(steep, ctx)
    assert first is not None and 1 <= len(first.tokens) - 1 < 8     # the prior's 0.5 a token: a short chain
    for _ in range(10):
        emitted(steep, [0])                                   # the target went another way at once
    assert propose(steep, ctx) is None                        # not worth a wider pass any more
    for _ in range(3):
        emitted(steep, cont)                                  # the whole continuation held, proposed or not
    again = propose(steep, ctx)
    assert again is not None and len(again.tokens) > len(first.tokens)
    flat = PromptLookup(8, ngram_max=2, costs=FLAT)
    flat.begin(np.array([1]), 64)
    chain = propose(flat, ctx)
    assert len(chain.tokens) > len(first.tokens)              # a flat curve: a longer chain on the same prior
    for _ in range(3):
        emitted(flat, cont)
    assert len(propose(flat, ctx).tokens) - 1 == 8            # and the whole of it once its guesses hold
