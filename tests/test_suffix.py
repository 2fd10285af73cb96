"""Suffix decoding through the whole loop (runtime/proposers/suffix.py over runtime/suffix.py).

- Worked examples: the request's own text, the shared cache, the better tree by score, the budget cut
  to the match length.
- Sampling at temperature 1: the emitted tokens G-tested against the tabular target's exact
  distribution while the shared cache learns from every run (so proposals change from run to run);
  teeth: the same test fails with a planted verifier bug.
- Greedy: token for token equal to plain greedy, with the cache warm; on an exported model too.
- Scopes: a lookup never sees another scope's text (teeth: a cache that ignores the scope is caught).
"""
from __future__ import annotations

import numpy as np
import pytest

from fakes import (TabularBackend, counts_of, decode_many, exact_continuation_probs, goodness_of_fit,
                   greedy_reference, make_table)
from specexport.runtime import loop
from specexport.runtime.loop import DecodeStats, decode
from specexport.runtime.proposers import Limits, SuffixProposer
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.suffix import SuffixCache
from test_proposers import STEEP, accept_tree_without_renormalising

ALPHA = 1e-4 / 6
TEETH_P = 1e-6
V = 6
TARGET = make_table(np.random.default_rng(3), V, sharpness=1.5)
PROMPT = [3, 1, 4, 3, 1, 5, 3]
T1 = SamplingParams(temperature=1.0)


def propose(proposer, context, *, depth=8, nodes=15):
    seq = np.append(np.asarray(context, np.int64), np.zeros(depth + 1, np.int64))
    proposer.begin(np.asarray(context[:1], np.int64), 64)
    return proposer.propose(seq, len(context), Limits(depth, nodes), None, None, DecodeStats())


# -- worked examples ---------------------------------------------------------------------------------
def test_the_requests_own_text_is_proposed_cut_to_the_match_length():
    # the last 3 tokens [7, 8, 9] occurred once, followed by [1, 2, 3, 4, 5]: m = 3 -> 3 nodes
    context = [7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    p = propose(SuffixProposer(8), context)
    assert p.tokens.tolist() == [9, 1, 2, 3] and p.tree.parents.tolist() == [-1, 0, 1, 2]
    p = propose(SuffixProposer(8, spec_factor=2.0), context)                # budget 2 x 3 = 6 nodes
    assert p.tokens.tolist() == [9, 1, 2, 3, 4, 5, 6]
    assert propose(SuffixProposer(8), [1, 2, 3, 4]) is None                  # nothing occurred before


def test_the_shared_cache_wins_when_its_tree_scores_higher():
    cache = SuffixCache(1000)
    for _ in range(3):                              # three earlier answers agree on what follows [5, 6]
        cache.add([5, 6, 1, 2, 3, 4])
    proposer = SuffixProposer(8, cache=cache, spec_factor=4.0)
    p = propose(proposer, [5, 6, 9, 5, 6])          # this request's own: [9, 5, 6] (score 3) vs 4 from the cache
    assert p.tokens.tolist() == [6, 1, 2, 3, 4] and proposer.from_shared == 1
    other = SuffixProposer(8, cache=cache, scope="other", spec_factor=4.0)      # another scope: its own text only
    assert propose(other, [5, 6, 9, 5, 6]).tokens.tolist() == [6, 9, 5, 6] and other.from_shared == 0


def test_branching_counts_make_a_tree_and_min_prob_prunes_it():
    cache = SuffixCache(1000)
    for tail in ([1, 2], [1, 2], [1, 3], [4, 4]):
        cache.add([8, 9, *tail])
    p = propose(SuffixProposer(4, cache=cache, spec_factor=8.0, min_prob=0.0), [8, 9])
    assert p.tokens.tolist() == [9, 1, 2, 4, 3, 4]    # 1 (0.75), 1-2 (0.5), then 0.25 each, shallower first
    p = propose(SuffixProposer(4, cache=cache, spec_factor=8.0, min_prob=0.3), [8, 9])
    assert p.tokens.tolist() == [9, 1, 2]


# -- scopes ------------------------------------------------------------------------------------------
def shared_hits_across_scopes() -> int:
    """Rounds of scope "b" whose proposal came from text stored under scope "a" (must be 0)."""
    cache = SuffixCache(10_000)
    secret = np.random.default_rng(0).integers(10, 50, 40)
    cache.add(secret, scope="a")
    proposer = SuffixProposer(8, cache=cache, scope="b")
    proposer.begin(secret[:1], 64)
    for n in range(4, 30, 3):
        proposer.propose(np.append(secret, np.zeros(9, np.int64)), n, Limits(8, 15), None, None, DecodeStats())
    return proposer.from_shared


def test_a_scope_never_sees_another_scopes_text():
    assert shared_hits_across_scopes() == 0


def test_teeth_a_cache_that_ignores_the_scope_is_caught(monkeypatch):
    original = SuffixCache.candidates
    monkeypatch.setattr(SuffixCache, "candidates", lambda self, context, *, scope="", **kw:
                        original(self, context, scope="a", **kw))                   # BUG: every lookup in "a"
    assert shared_hits_across_scopes() > 0


# -- sampling, through the whole loop -----------------------------------------------------------------
def run(params, runs, *, seed, max_new=6, cache_tokens=3_000, costs=None):
    """tokens [runs, max_new] decoded with suffix proposals from one shared cache that stores every
    run's prompt + output (so each run's proposals depend on the runs before it), and the summed
    proposed / accepted counts."""
    cache = SuffixCache(cache_tokens)
    return decode_many(TabularBackend(TARGET, capacity=64, max_tokens=8),
                       SuffixProposer(5, cache=cache, spec_factor=2.0, min_prob=0.0, costs=costs), PROMPT, params, runs,
                       max_new=max_new, seed=seed, after=lambda out: cache.add(np.concatenate([PROMPT, out])))


def fits(tokens, params):
    k = tokens.shape[1]
    exact = exact_continuation_probs(TARGET, PROMPT, k, params)
    return {"first 3": goodness_of_fit(counts_of(tokens[:, :3], (V,) * 3), exact.sum(tuple(range(3, k)))),
            "last 3": goodness_of_fit(counts_of(tokens[:, -3:], (V,) * 3), exact.sum(tuple(range(k - 3)))),
            f"all {k}": goodness_of_fit(counts_of(tokens, (V,) * k), exact)}


@pytest.mark.parametrize("params,costs", [(T1, None), (SamplingParams(0.7, top_k=4), None), (T1, STEEP)],
                         ids=["T1", "T0.7-top-k-4", "T1-sized-by-costs"])
def test_suffix_sampling_is_lossless_while_the_cache_learns(params, costs):
    tokens, proposed, accepted = run(params, 12_000 if costs is None else 6_000, seed=1, costs=costs)
    for view, fit in fits(tokens, params).items():
        assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"{view}: {fit}"
    assert 0 < accepted < proposed


def test_teeth_suffix_trees_verified_without_renormalising(monkeypatch):
    monkeypatch.setattr(loop, "accept_tree", accept_tree_without_renormalising)
    tokens, _, _ = run(T1, 4_000, seed=2)
    worst = min(fits(tokens, T1).values(), key=lambda f: f.pvalue)
    assert worst.pvalue < TEETH_P, f"planted bug not detected: {worst}"


# -- greedy ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("costs", [None, STEEP], ids=["alpha-m", "sized-by-costs"])
def test_greedy_suffix_equals_plain_greedy_with_a_warm_cache(costs):
    target = TabularBackend(TARGET, capacity=256, max_tokens=16)
    cache = SuffixCache(5_000)
    proposer = SuffixProposer(15, cache=cache, costs=costs)
    rng = np.random.default_rng(5)
    accepted = shared = 0
    for _ in range(30):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 12)))
        stats, seq = DecodeStats(), list(prompt)
        for chunk in decode(target, proposer, prompt, max_new_tokens=100, params=SamplingParams(0.0),
                            rng=np.random.default_rng(0), stats=stats):
            seq += chunk.tolist()
            assert target.length == len(seq) - 1 and target.context().tolist() == seq[:-1]
        np.testing.assert_array_equal(seq[len(prompt):], greedy_reference(TARGET, prompt, 100))
        cache.add(seq)
        accepted, shared = accepted + stats.accepted, shared + proposer.from_shared
    assert accepted > 0 and shared > 0


def test_suffix_on_an_exported_model_equals_vanilla_and_learns_across_calls(built_llama):
    from specexport.runtime.pipeline import Pipeline

    prompts = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class A:\n    pass\n"]
    with Pipeline(built_llama) as pipe:
        vanilla = [pipe.generate(p, method="vanilla", max_new_tokens=48).token_ids for p in prompts]
        first = [pipe.generate(p, method="suffix", max_new_tokens=48) for p in prompts]
        again = [pipe.generate(p, method="suffix", max_new_tokens=48) for p in prompts]   # the cache has them now
        assert [o.token_ids for o in first] == vanilla == [o.token_ids for o in again]
        passes = lambda outs: sum(o.stats.target_passes for o in outs)    # noqa: E731
        assert passes(again) < passes(first) and sum(o.stats.proposer["from_shared"] for o in again) > 0
        assert pipe.suffix_cache.sequences == 6
        private = pipe.generate(prompts[0], method="suffix", max_new_tokens=48, suffix_share=False)
        assert private.token_ids == vanilla[0] and private.stats.proposer["from_shared"] == 0
        assert pipe.suffix_cache.sequences == 6          # opted out: not stored either


def test_bench_suffix_rows_and_a_workload_replayed_through_one_cache(built_llama, tmp_path, capsys):
    import json
    import shutil

    from specexport.cli import main
    from specexport.report.workload import conversation_turn, read_workload

    shutil.copytree(built_llama, tmp_path / "b")
    work = tmp_path / "work.jsonl"
    work.write_text('"def add(a, b):"\n"def add(a, b):"\n{"turns": ["import os", "import sys"]}\n')
    assert read_workload(work) == ("def add(a, b):", "def add(a, b):", ("import os", "import sys"))
    assert conversation_turn(("a", "b", "c"), ["A", "B"]) == "a\n\nA\n\nb\n\nB\n\nc"
    common = ["--rounds", "2", "--max-new-tokens", "16", "--no-peers", "--threads", "1"]
    assert main(["bench", str(tmp_path / "b"), "--methods", "vanilla,lookup,suffix", "--gammas", "3",
                 "--workload", str(work), *common]) == 0
    report = json.loads((tmp_path / "b" / "bench" / "report.json").read_text())
    assert report["settings"]["workload"] and report["settings"]["prompts"] == 4     # the conversation: 2 turns
    row = next(r for r in report["rows"] if r["method"] == "suffix")
    # the second request repeats the first: its answer comes from the cache (and rounds start afresh)
    assert row["suffix_hit_rate"] > 0 and row["suffix_from_shared"] > 0 and row["suffix_propose_us"] > 0
    assert row["tokens_per_s"] and row["mean_accepted_tokens"] > 1
    assert "## Suffix decoding" in (tmp_path / "b" / "bench" / "report.md").read_text()
    assert main(["bench", str(tmp_path / "b"), "--methods", "vanilla,suffix", "--prompts", str(work), "--workload",
                 str(work), *common]) == 1
    assert "--workload and --prompts" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    assert main(["bench", str(tmp_path / "b"), "--workload", str(bad), *common]) == 1
    assert f"{bad} line 1" in capsys.readouterr().err


class ChainsOnly(TabularBackend):
    """A target whose build measured that a tree's sibling rows differ from decoding (stage "trees":
    "chains"): it must never be given a tree."""
    exact_trees = False

    def forward(self, tokens, *, depths=None, tree_mask=None, phase="decode"):
        assert tree_mask is None or (np.tril(np.ones_like(tree_mask)) == tree_mask).all(), "a tree was verified"
        return super().forward(tokens, depths=depths, tree_mask=tree_mask, phase=phase)


def test_a_target_without_exact_trees_verifies_first_chains_and_stays_greedy_exact():
    from specexport.runtime.proposers import Proposal
    from specexport.runtime.tree import Tree

    p = Proposal(Tree(np.array([-1, 0, 0, 1])), np.array([7, 1, 2, 3]), q=np.eye(4)[[1, 2, 3]])
    c = p.first_chain()
    assert c.tree.parents.tolist() == [-1, 0, 1] and c.tokens.tolist() == [7, 1, 3]
    assert c.q.argmax(-1).tolist() == [1, 3]                     # each kept node's own q row
    target = ChainsOnly(TARGET, capacity=256, max_tokens=16)
    cache = SuffixCache(5_000)
    proposer = SuffixProposer(15, cache=cache, spec_factor=4.0, min_prob=0.0)
    rng = np.random.default_rng(8)
    accepted = 0
    for _ in range(20):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 12)))
        stats = DecodeStats()
        out = np.concatenate(list(decode(target, proposer, prompt, max_new_tokens=60, params=SamplingParams(0.0),
                                         rng=np.random.default_rng(0), stats=stats)))
        np.testing.assert_array_equal(out, greedy_reference(TARGET, prompt, 60))
        cache.add(np.concatenate([prompt, out]))
        accepted += stats.accepted
    assert accepted > 0
