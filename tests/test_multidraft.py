"""Trees of *sampled* children (several draft samples per node): the multi-draft rejection rule.

Token level: a root with k children drawn from q (with or without replacement); the token the round
emits first must be distributed as p, for p and q from sharp to flat and the edge cases (q = p,
disjoint supports, one-hot q, duplicate children). Loop level: a sampled draft tree on the tabular
toy model is G-tested against the target's exact continuation distribution.
Teeth: siblings tested with min(1, p/q) each but without the multi-draft residual correction, and
i.i.d. children verified as if drawn without replacement, must fail at p < 1e-6 (token level and
through the loop).

The q-free rule ("draw y ~ p, descend if y is a child") is *not* a bug on sampled children: it is
lossless for any tree fixed before the target's coins, however the children were chosen (measured
here: G-test p = 0.38 on 20 000 rounds). What it loses is acceptance, which a test below measures.
"""
from __future__ import annotations

import numpy as np
import pytest

from fakes import (TabularBackend, counts_of, decode_many, exact_continuation_probs, goodness_of_fit, make_table,
                   perturb_table)
from specexport.runtime import loop
from specexport.runtime.accept import Verdict, accept_tree, accept_tree_sampled
from specexport.runtime.proposers import DraftTree
from specexport.runtime.sampling import SamplingParams, sample
from specexport.runtime.tree import Tree

ALPHA = 1e-4 / 30
TEETH_P = 1e-6
V = 5
STAR = Tree(np.array([-1, 0, 0, 0]))                  # a root with three sampled children


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _cases():
    rng = np.random.default_rng(0)
    cases = {f"random sharp {i}": (softmax(2.5 * rng.standard_normal(V)), softmax(2.5 * rng.standard_normal(V)))
             for i in range(2)}
    cases["random flat"] = (softmax(0.3 * rng.standard_normal(V)), softmax(0.3 * rng.standard_normal(V)))
    p = softmax(rng.standard_normal(V))
    cases["q equals p"] = (p, p.copy())
    cases["disjoint supports"] = (np.array([0.5, 0.5, 0, 0, 0]), np.array([0, 0, 0.2, 0.3, 0.5]))
    cases["one-hot q"] = (softmax(rng.standard_normal(V)), np.eye(V)[2])
    return cases


CASES = _cases()


def draw_children(q, k, rng, replacement):
    if replacement:
        return [sample(q, rng.random()) for _ in range(k)]
    q, out = q.copy(), []
    for _ in range(k):
        if q.sum() <= 0:
            break
        x = sample(q, rng.random())
        out.append(x)
        q[x] = 0.0
    return out


def first_tokens(p, q, *, replacement, verifier=accept_tree_sampled, trials=40_000, seed=0, accepted=None):
    """The token each trial's round emits first (the accepted child, or the final draw); `accepted`
    (a list) collects each round's number of accepted children."""
    rng = np.random.default_rng(seed)
    out = np.empty(trials, dtype=np.int64)
    shapes = {}                                           # children count -> (tree, P, Q): the verifiers copy rows
    for t in range(trials):
        kids = draw_children(q, 3, rng, replacement)
        if len(kids) not in shapes:                       # the children's own p is not reached here
            size = len(kids) + 1
            shapes[len(kids)] = (Tree(np.array([-1] + [0] * len(kids))), np.tile(p, (size, 1)), np.tile(q, (size, 1)))
        tree, P, Q = shapes[len(kids)]
        tokens = np.array([0] + kids)
        if verifier is accept_tree:
            verdict = accept_tree(tree, tokens, P, uniforms=rng.random(tree.size + 2))
        else:
            verdict = verifier(tree, tokens, P, draft_probs=Q, uniforms=rng.random(2 * tree.size + 2), replacement=replacement)
        out[t] = verdict.tokens[0]
        if accepted is not None:
            accepted.append(verdict.n_accepted)
    return out


@pytest.mark.parametrize("replacement", [True, False], ids=["with replacement", "without replacement"])
@pytest.mark.parametrize("name", list(CASES))
def test_multi_draft_rule_is_lossless_at_token_level(name, replacement):
    p, q = CASES[name]
    toks = first_tokens(p, q, replacement=replacement, seed=len(name))
    fit = goodness_of_fit(counts_of(toks[:, None], (V,)), p)
    assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"{name}: {fit}"


def test_multi_draft_worked_example():
    tree = Tree(np.array([-1, 0, 0]))
    p, q = np.array([0.5, 0.5]), np.array([1.0, 0.0])
    P, Q = np.tile(p, (3, 1)), np.tile(q, (3, 1))
    accepted = accept_tree_sampled(tree, np.array([0, 0, 0]), P, draft_probs=Q, uniforms=np.array([0.4, 0.1, 0.3]),
                                   replacement=True)
    assert accepted.path.tolist() == [0, 1] and accepted.tokens.tolist() == [0, 0]
    rejected = accept_tree_sampled(tree, np.array([0, 0, 0]), P, draft_probs=Q, uniforms=np.array([0.6, 0.1, 0.3]),
                                   replacement=True)
    assert rejected.path.tolist() == [0] and rejected.tokens.tolist() == [1]     # the residual [0, .5]


def accept_without_residual_update(tree, node_tokens, target_probs, draft_probs, uniforms, *, replacement, draws=None):
    """Planted bug: after a rejected sibling, p is not replaced by the residual."""
    node, path, u = 0, [0], 0
    while True:
        kids = tree.children[node]
        p = target_probs[node]
        q = draft_probs[kids[0] - 1] if kids else None
        nxt = None
        for c in kids:
            x = node_tokens[c]
            u += 1
            if uniforms[u - 1] * q[x] < p[x]:
                nxt = c
                break
        if nxt is None:
            residual = np.maximum(p - q, 0) if q is not None else p
            y = sample(residual if residual.sum() > 0 else p, uniforms[u] if draws is None else draws[len(path) - 1])
            path = np.asarray(path, dtype=np.int64)
            return Verdict(path, np.append(node_tokens[path[1:]], y).astype(np.int64))
        node = nxt
        path.append(node)


def test_q_free_rule_on_sampled_children_is_lossless_but_accepts_less():
    p, q = CASES["random sharp 0"]
    free, multi = [], []
    toks = first_tokens(p, q, replacement=True, verifier=accept_tree, trials=20_000, seed=1, accepted=free)
    first_tokens(p, q, replacement=True, trials=20_000, seed=2, accepted=multi)
    fit = goodness_of_fit(counts_of(toks[:, None], (V,)), p)
    assert fit.pvalue > ALPHA, f"q-free on sampled children: {fit}"
    sd = np.sqrt(0.25 / 20_000)
    assert np.mean(multi) > np.mean(free) + 8 * sd, (np.mean(multi), np.mean(free))


@pytest.mark.parametrize("bug", ["no residual update between siblings", "i.i.d. children verified as without replacement"])
def test_teeth_multi_draft(bug):
    p, q = CASES["random sharp 0"]
    if bug.startswith("no residual"):
        toks = first_tokens(p, q, replacement=True, verifier=accept_without_residual_update, trials=20_000, seed=1)
    else:
        def as_without(*args, replacement, **named):
            return accept_tree_sampled(*args, replacement=False, **named)
        toks = first_tokens(p, q, replacement=True, verifier=as_without, trials=20_000, seed=1)
    fit = goodness_of_fit(counts_of(toks[:, None], (V,)), p)
    assert fit.pvalue < TEETH_P, f"planted bug ({bug}) not detected: {fit}"


# -- through the loop: a draft tree of sampled children ---------------------------------------------------
TARGET = make_table(np.random.default_rng(3), 6, sharpness=1.5)
DRAFT = perturb_table(np.random.default_rng(4), TARGET, noise=1.0)
PROMPT = [3, 1, 4]
SHAPE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def run_sampled_tree(params, runs, seed, max_new=6):
    target = TabularBackend(TARGET, capacity=64, max_tokens=16)
    proposer = DraftTree(TabularBackend(DRAFT, capacity=64, max_tokens=16), SHAPE, sampled=True)
    return decode_many(target, proposer, PROMPT, params, runs, max_new=max_new, seed=seed)


def loop_fits(tokens, params):
    k = tokens.shape[1]
    exact = exact_continuation_probs(TARGET, PROMPT, k, params)
    return {"first 3": goodness_of_fit(counts_of(tokens[:, :3], (6,) * 3), exact.sum(tuple(range(3, k)))),
            f"all {k}": goodness_of_fit(counts_of(tokens, (6,) * k), exact)}


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(1.0, top_k=3)], ids=["T1", "top-k 3"])
def test_sampled_draft_tree_is_lossless_through_the_loop(params):
    tokens, proposed, accepted = run_sampled_tree(params, 15_000, seed=31)
    for view, fit in loop_fits(tokens, params).items():
        assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"sampled draft tree, {view}: {fit}"
    assert 0 < accepted < proposed


def test_teeth_sampled_draft_tree_without_the_residual_correction(monkeypatch):
    """The loop testing each sampled sibling with min(1, p/q) but never updating p to the residual."""
    monkeypatch.setattr(loop, "accept_tree_sampled", accept_without_residual_update)
    tokens, _, _ = run_sampled_tree(SamplingParams(1.0), 6_000, seed=32)
    worst = min(loop_fits(tokens, SamplingParams(1.0)).values(), key=lambda f: f.pvalue)
    assert worst.pvalue < TEETH_P, f"sibling tests without the residual correction not detected: {worst}"
