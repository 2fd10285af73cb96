"""EAGLE trees through the whole loop, on the tabular toy target (V = 6, exact continuation
probabilities) with a tabular head that has a real KV cache (fakes.TabularEagleHead).

- Sampling (temperature 1, top-p), dynamic (EAGLE-2) and static trees, with a reduced draft
  vocabulary whose ids map onto target ids through d2t: the emitted tokens G-tested against the
  target's exact distribution (q-free tree rule); a target token outside the draft vocabulary still
  comes out.
- Teeth: the verifier bugs of the trees issue (siblings without renormalising, the stale bonus) fail
  the G-test at p < 1e-6; the proposer bugs (d2t applied twice or not at all, the head's cache keeping
  a draft branch) fail the oracle check: with the target's own table, every round's children must be
  the target's top-k within the draft vocabulary, in target ids.
- Greedy: token for token equal to plain greedy; the dynamic tree's selection worked example.
"""
from __future__ import annotations

import numpy as np
import pytest

from fakes import TabularEagleHead, make_table
from specexport.errors import SpecexportError
from specexport.runtime import loop
from specexport.runtime.proposers import DynamicTree, EagleTree
from specexport.runtime.proposers.eagle import _as_tree, _best_closed
from specexport.runtime.sampling import SamplingParams
from test_proposers import (ALPHA, T1, TARGET, TEETH_P, V, accept_tree_stale_bonus,
                            accept_tree_without_renormalising, fits, greedy_against_plain, run)

# the draft vocabulary: 4 of the 6 target ids, in an order where d2t is not zero (draft id i -> VOCAB[i])
VOCAB = np.array([1, 2, 3, 5])
D2T = VOCAB - np.arange(len(VOCAB))
HEAD_TABLE = make_table(np.random.default_rng(7), V, sharpness=1.0)     # a head that is often wrong
STATIC = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def eagle(tree, *, table=HEAD_TABLE, vocab=VOCAB, top_k=3, capacity=96):
    head = TabularEagleHead(table, vocab_ids=vocab, top_k=top_k, capacity=capacity, max_tokens=16)
    ids = None if vocab is None else np.arange(len(vocab)) + (vocab - np.arange(len(vocab)))
    return EagleTree(head, tree, target_ids=ids)


# top-k 3 with the reduced vocabulary was a case too: the warps are shared with every proposer and G-tested in
# test_accept_stats, and the dynamic tree and d2t here (suite time)
CASES = [("dynamic T1, reduced vocabulary", lambda: eagle(DynamicTree(top_k=2, depth=3, total_tokens=5)), T1),
         ("static top-p 0.8, full vocabulary", lambda: eagle(STATIC, vocab=None), SamplingParams(1.0, top_p=0.8))]


@pytest.mark.parametrize("name,make,params", CASES, ids=[c[0] for c in CASES])
def test_eagle_tree_sampling_is_lossless(name, make, params):
    proposer = make()
    tokens, proposed, accepted = run(proposer, params, 20_000, seed=len(name))
    for view, fit in fits(tokens, params).items():
        assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"{name}, {view}: {fit}"
    assert 0 < accepted < proposed and proposer.head.calls > 0
    if proposer.target_ids is not None and params.top_k is None:      # tokens the head can never propose
        outside = np.setdiff1d(np.arange(V), VOCAB)
        assert np.isin(tokens, outside).any()


@pytest.mark.parametrize("variant", ["siblings without renormalising", "stale bonus after rejected siblings"])
def test_teeth_eagle_tree_verification(variant, monkeypatch):
    bug = accept_tree_without_renormalising if variant.startswith("siblings") else accept_tree_stale_bonus
    monkeypatch.setattr(loop, "accept_tree", bug)
    tokens, _, _ = run(eagle(DynamicTree(top_k=3, depth=2, total_tokens=6)), T1, 4_000, seed=12)
    worst = min(fits(tokens, T1).values(), key=lambda f: f.pvalue)
    assert worst.pvalue < TEETH_P, f"planted bug ({variant}) not detected: {worst}"


# -- the oracle: with the target's own table, the children are the target's top-k in the vocabulary -----
class Oracle(EagleTree):
    """Checks every proposal against what the target's table says, from the committed text alone: the
    root's children are the target's best tokens in the vocabulary, and every deeper node is among the
    head's top-k given its own path (what the head reads at a draft level: the node's target id, its
    parent's state)."""

    def propose(self, seq, n, limits, params, rng, stats):
        proposal = super().propose(seq, n, limits, params, rng, stats)
        tokens, parents = proposal.tokens, proposal.tree.parents
        kids = tokens[list(proposal.tree.children[0])]
        np.testing.assert_array_equal(np.sort(kids), np.sort(ranked(seq[n - 2] if n >= 2 else 0, seq[n - 1])[:len(kids)]))
        for i in range(1, len(tokens)):
            p = parents[i]
            before = tokens[parents[p]] if p > 0 else (seq[n - 2] if n >= 2 else 0)
            assert tokens[i] in ranked(before, tokens[p])[:self.head.top_k], (i, tokens.tolist(), parents.tolist())
        return proposal


def ranked(prev2, prev):
    """The draft vocabulary's target ids, most likely first after (prev2, prev) under the target's table."""
    return VOCAB[np.argsort(-np.asarray(TARGET, np.float64)[prev2, prev][VOCAB], kind="stable")]


def oracle(tree=None):
    tree = tree or DynamicTree(top_k=2, depth=4, total_tokens=8)
    head = TabularEagleHead(TARGET, vocab_ids=VOCAB, top_k=3, capacity=256, max_tokens=16)
    return Oracle(head, tree, target_ids=np.arange(len(VOCAB)) + D2T)


@pytest.mark.parametrize("tree", [DynamicTree(top_k=2, depth=4, total_tokens=8), STATIC], ids=["dynamic", "static"])
def test_oracle_head_proposes_the_targets_top_tokens_and_greedy_equals_plain(tree):
    accepted = greedy_against_plain(oracle(tree), seed=3)
    assert accepted > 0


@pytest.mark.parametrize("bug", ["d2t applied twice", "d2t not applied", "draft ids fed back to the head",
                                 "head cache keeps a draft branch"])
def test_teeth_proposer_bugs_fail_the_oracle(bug):
    proposer = oracle()
    if bug == "d2t applied twice":
        proposer.target_ids = np.clip(np.arange(len(VOCAB)) + 2 * D2T, 0, V - 1)
    elif bug == "d2t not applied":
        proposer.target_ids = None
    elif bug == "draft ids fed back to the head":            # the proposal's ids mapped, a level's input not
        level, ids = proposer._level, proposer.target_ids

        def unmapped(*args, **kwargs):
            proposer.target_ids = None
            try:
                return level(*args, **kwargs)
            finally:
                proposer.target_ids = ids

        proposer._level = unmapped
    else:
        head, forget = proposer.head, proposer.head.rollback
        head.rollback = lambda length: forget(length) if length == 0 else None   # reset only: drafts stay cached
    with pytest.raises((AssertionError, SpecexportError)):
        greedy_against_plain(proposer, seed=3)


def test_eagle_greedy_equals_plain_greedy_with_an_imperfect_head():
    proposer = eagle(DynamicTree(top_k=3, depth=3, total_tokens=7), capacity=256)
    assert greedy_against_plain(proposer, seed=5) > 0


def test_dynamic_selection_worked_example():
    # candidates: 0 root; 1, 2 at depth 1 (scores -0.1, -0.5); 3, 4 children of 1 (-0.2, -0.9); 5 child of 2 (-0.5)
    score = np.array([0.0, -0.1, -0.5, -0.2, -0.9, -0.5])
    parent = np.array([-1, 0, 0, 1, 1, 2])
    depth = np.array([0, 1, 1, 2, 2, 2])
    assert _best_closed(score, parent, depth, total=2) == [1, 3]
    assert _best_closed(score, parent, depth, total=4) == [1, 3, 2, 5]        # ties: the parent (shallower) first
    parents, ids = _as_tree([1, 3, 2, 5], parent, depth, ids=np.arange(6) * 10)
    assert parents.tolist() == [-1, 0, 0, 1, 2] and ids.tolist() == [0, 10, 20, 30, 50]


def test_tree_parameters_are_checked():
    with pytest.raises(ValueError, match="tree.depth: expected an integer >= 1"):
        DynamicTree(depth=0)
    head = TabularEagleHead(TARGET, top_k=2, capacity=32, max_tokens=8)
    with pytest.raises(ValueError, match="needs each node's top 3; the head graph returns its top 2"):
        EagleTree(head, DynamicTree(top_k=3))
    with pytest.raises(ValueError, match="needs each node's top 3"):
        EagleTree(head, [(0,), (2,)])
