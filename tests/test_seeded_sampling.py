"""Seeded sampling that does not depend on the method (runtime/sampling.Coins): every emitted token is
drawn with the coin of its position, so a deterministic proposer verified with the q-free rule emits
exactly vanilla's text for the same seed, at any temperature. An exact test of losslessness beside
the G-tests: one wrong draw anywhere and the texts part."""
from __future__ import annotations

import numpy as np
import pytest

from specexport.runtime.pipeline import Pipeline
from specexport.runtime.sampling import Coins

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "import os\nimport sys\nimport os\nimport", "x = 1"]


def test_coins_are_keyed_by_position_and_seed():
    a, b = Coins(7).at(np.arange(10, 20)), Coins(7).at(np.arange(15, 18))
    assert np.array_equal(a[5:8], b)                                    # same position, same coin
    assert not np.allclose(Coins(8).at(np.arange(10, 20)), a)           # another seed, other coins
    assert not np.allclose(Coins(7).at(np.arange(10, 20), Coins.TEST), a)
    u = Coins(3).at(np.arange(200_000))
    assert ((0 <= u) & (u < 1)).all()
    counts = np.histogram(u, bins=20, range=(0, 1))[0]                  # uniform: a chi-square on 20 bins
    chi2 = ((counts - 10_000) ** 2 / 10_000).sum()
    assert chi2 < 50, chi2                                              # 19 d.o.f.: p ~ 1e-4 at 50


def _splitmix_coin(seed: int, stream: int, counter: int) -> float:
    """Coins' definition written out once more, plainly: SplitMix64's mixer over a Weyl counter."""
    m = 2**64 - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    key = mix(mix(seed % 2**64) ^ (stream * 0x2545F4914F6CDD1D % 2**64))
    return (mix((key + (counter + 1) * 0x9E3779B97F4A7C15) & m) >> 11) / 2**53


def test_coins_one_at_a_time_and_in_bulk_are_the_same_bits():
    """Coins draws a round's few coins in Python ints and many in numpy uint64 (faster each way): both are
    the definition, bit for bit, wrapping at 2^64 included."""
    counters = [0, 1, 5, 17, 2**40 + 3, 2**63, 2**64 - 2, 2**64 - 1]
    for seed, stream in ((0, Coins.DRAW), (2**63 - 1, Coins.TEST), (12345, 7)):
        want = [_splitmix_coin(seed, stream, c) for c in counters]
        coins = Coins(seed)
        few = coins.at(counters, stream)                                 # <= 16: the Python path
        many = coins.at(counters * 3, stream)[:len(counters)]           # > 16: the numpy path
        assert few.tolist() == many.tolist() == want == [coins.one(c, stream) for c in counters]
        for start, count in ((5, 3), (2**64 - 20, 20)):                    # a round's consecutive counters
            want = [_splitmix_coin(seed, stream, start + i) for i in range(count)]
            assert coins.span(start, count, stream).tolist() == want


@pytest.mark.parametrize("temperature", [0.6, 1.0])
@pytest.mark.parametrize("method,options", [("lookup", {"gamma": 4}), ("lookup", {"gamma": 3, "lookup_branches": 3}),
                                            ("draft", {"tree": "small"}), ("draft", {"tree": "wide"})],
                         ids=["lookup", "lookup-branches", "draft-tree-small", "draft-tree-wide"])
def test_deterministic_proposers_emit_vanillas_text_for_the_same_seed(built_llama, method, options, temperature):
    accepted = 0
    with Pipeline(built_llama) as pipe:
        for seed in range(6):
            for prompt in PROMPTS:
                kw = dict(max_new_tokens=40, temperature=temperature, seed=seed)
                vanilla = pipe.generate(prompt, method="vanilla", **kw).token_ids
                out = pipe.generate(prompt, method=method, **options, **kw)
                assert out.token_ids == vanilla, (method, options, seed, prompt)
                accepted += out.stats.accepted
    assert accepted > 0          # speculation did happen: the equality is not vanilla against itself


def test_a_draft_chain_under_rejection_sampling_is_not_promised_vanillas_text(built_llama):
    """The chain rule draws a recovered token from max(0, p - q), not from p with the position's coin:
    still the target's distribution (the G-tests), but a different text for the same seed."""
    differ = 0
    with Pipeline(built_llama) as pipe:
        for seed in range(6):
            kw = dict(max_new_tokens=40, temperature=1.0, seed=seed)
            differ += pipe.generate(PROMPTS[2], method="vanilla", **kw).token_ids != \
                pipe.generate(PROMPTS[2], method="draft", gamma=4, **kw).token_ids
    assert differ > 0


def test_teeth_a_verifier_that_draws_with_another_positions_coin(built_llama, monkeypatch):
    """The equality above is not automatic: the q-free rule drawing depth d's token with the coin of
    position n + d + 1 (one off) is still a fair sampler, and the texts part at once."""
    from specexport.runtime import loop

    original = loop.accept_tree
    monkeypatch.setattr(loop, "accept_tree", lambda tree, tokens, probs, uniforms: original(tree, tokens, probs,
                                                                                          uniforms=np.roll(uniforms, -1)))
    with Pipeline(built_llama) as pipe:
        kw = dict(max_new_tokens=40, temperature=1.0)
        differ = sum(pipe.generate(PROMPTS[0], method="vanilla", seed=s, **kw).token_ids
                     != pipe.generate(PROMPTS[0], method="lookup", gamma=4, seed=s, **kw).token_ids for s in range(6))
    assert differ > 0
