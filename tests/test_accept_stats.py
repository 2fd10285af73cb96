"""Token-level proof that the verifiers are lossless (ANCHORS.md "How to prove losslessness", steps 1, 3, 4).

The model of the world in these tests is a context model: `P[j]` ([V] * (j + 1)) is the target's
distribution of token j + 1 given tokens 1..j, and `Q[j]` the draft's. One trial draws a proposal
from Q (vectorized), hands the verifier the matching rows of P and Q, and records the verdict's
tokens; a round that emitted fewer tokens than we look at is completed by sampling straight from P
(what the next round's target would do). Losslessness then says: the emitted tokens are distributed
exactly as the product of the P's, the "no speculation" distribution. Each case is checked by
  * a G-test of the first emitted token and of the joint of the first k emitted tokens
    (p-value > 1e-4 / number of tests, Bonferroni) and total variation < 4 sqrt(cells / N);
  * the number of accepted proposals: its exact distribution (chain: sum min(p, q) per level; tree:
    the children's p) by G-test, and its mean within 4 sigma.
Teeth: copies of the verifiers with one planted bug each (the bugs others shipped) must fail the same
test at p < 1e-6, and the copy without a bug must pass it.

Runtime: ~1e5 trials per case (2e5 for the widest vocabularies); each verifier call is ~10 us.
"""
from __future__ import annotations

import numpy as np
import pytest

from close import assert_close
from fakes import Fit, counts_of, draw, goodness_of_fit
from specexport.runtime.accept import Verdict, accept_chain, accept_greedy, accept_tree
from specexport.runtime.sampling import SamplingParams, sample, warp
from specexport.runtime.tree import Tree

N_GOF_TESTS = 150                     # upper bound on the goodness-of-fit tests in this file
ALPHA = 1e-4 / N_GOF_TESTS            # Bonferroni
TEETH_P = 1e-6
N_TRIALS = 100_000


def assert_fits(fit: Fit, what: str) -> None:
    assert fit.pvalue > ALPHA, f"{what}: {fit}"
    assert fit.tv < fit.tv_bound, f"{what}: {fit}"


# ------------------------------------------------------------------------------------------------
# Context models: P[j] [V] * (j + 1), the distribution of token j + 1 given tokens 1..j
# ------------------------------------------------------------------------------------------------
def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def random_model(rng, V: int, depth: int, sharpness: float, first: np.ndarray | None = None) -> list:
    """[P_0 .. P_depth]: P_j [V] * (j + 1) = softmax(sharpness * N(0, 1)); `first` overrides P_0."""
    model = [softmax(sharpness * rng.standard_normal((V,) * (j + 1))) for j in range(depth + 1)]
    if first is not None:
        model[0] = np.asarray(first, dtype=np.float64)
    return model


def rows(table: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """table [V] * (j + 1), prefix [N, j] -> [N, V] the rows at each prefix."""
    n, j = prefix.shape
    if j == 0:
        return np.broadcast_to(table, (n, table.shape[-1]))
    return table[tuple(prefix.T)]


def joint(model: list, k: int) -> np.ndarray:
    """[V] * k exact probability of the first k tokens."""
    out = model[0]
    for j in range(1, k):
        out = out[..., None] * model[j]
    return out


def complete(tokens: np.ndarray, model: list, rng) -> np.ndarray:
    """tokens [N, k] with -1 after each round's last emitted token -> filled by sampling from the model."""
    tokens = tokens.copy()
    for j in range(tokens.shape[1]):
        need = tokens[:, j] < 0
        if need.any():
            tokens[need, j] = draw(rows(model[j], tokens[need, :j]), rng.random(int(need.sum())))
    return tokens


def check_emitted(tokens: np.ndarray, model: list) -> list[Fit]:
    """G-tests of the first token and of the joint of all k columns; returns the fits (not asserted)."""
    V, k = model[0].shape[-1], tokens.shape[1]
    fits = [goodness_of_fit(np.bincount(tokens[:, 0], minlength=V), model[0])]
    if k > 1:
        fits.append(goodness_of_fit(counts_of(tokens, (V,) * k), joint(model, k)))
    return fits


def check_accepted(n_acc: np.ndarray, exact: np.ndarray, what: str) -> None:
    """n_acc [N] against its exact distribution [γ + 1]: G-test, and the mean within 4 sigma."""
    assert_fits(goodness_of_fit(np.bincount(n_acc, minlength=len(exact)), exact), f"{what}: accepted count")
    levels = np.arange(len(exact))
    mean = float(levels @ exact)
    sd = np.sqrt(max(float(levels ** 2 @ exact) - mean ** 2, 0.0) / len(n_acc))
    assert abs(n_acc.mean() - mean) <= 4 * sd + 1e-12, (
        f"{what}: mean accepted {n_acc.mean():.5f}, exact {mean:.5f} (4 sigma = {4 * sd:.5f})")


# ------------------------------------------------------------------------------------------------
# Trial runners
# ------------------------------------------------------------------------------------------------
def real_chain(proposal, draft_probs, target_probs, uniforms, draft_probs_raw):
    return accept_chain(proposal, draft_probs, target_probs, uniforms=uniforms)


def run_chain(verify, P: list, Q: list, n: int, seed: int, Q_raw: list | None = None):
    """One chain round per trial: proposal ~ Q, verdict, completion from P.

    Returns (tokens [n, γ + 1], n_accepted [n]). Q_raw is what a buggy verifier would use as q
    (the unwarped softmax of the draft logits); verifiers get it as their last argument.
    """
    rng = np.random.default_rng(seed)
    gamma = len(Q)
    x = np.zeros((n, gamma), dtype=np.int64)                                   # [n, γ] proposals
    for j in range(gamma):
        x[:, j] = draw(rows(Q[j], x[:, :j]), rng.random(n))
    qs = np.stack([rows(Q[j], x[:, :j]) for j in range(gamma)], 1)             # [n, γ, V]
    ps = np.stack([rows(P[j], x[:, :j]) for j in range(gamma + 1)], 1)         # [n, γ + 1, V]
    raw = qs if Q_raw is None else np.stack([rows(Q_raw[j], x[:, :j]) for j in range(gamma)], 1)
    coins = rng.random((n, gamma + 1))                                         # [n, γ + 1]
    tokens = np.full((n, gamma + 1), -1, dtype=np.int64)
    n_acc = np.empty(n, dtype=np.int64)
    for i in range(n):
        v = verify(x[i], qs[i], ps[i], coins[i], raw[i])
        if i < 2000:                                                           # the verdict's shape
            assert v.n_accepted == len(v.tokens) - 1 and np.array_equal(v.path, np.arange(len(v.path)))
            assert np.array_equal(v.tokens[:-1], x[i, :v.n_accepted])
        tokens[i, :len(v.tokens)] = v.tokens
        n_acc[i] = v.n_accepted
    return complete(tokens, P, rng), n_acc


def chain_accept_exact(P: list, Q: list) -> np.ndarray:
    """[γ + 1] exact P(n_accepted = j): reaching level j accepted has mass prod_i min(p_i, q_i)(x_i)."""
    gamma = len(Q)
    at_least = [1.0]
    reach = np.ones(())
    for j in range(gamma):
        reach = reach[..., None] * np.minimum(P[j], Q[j])                        # [V] * (j + 1)
        at_least.append(float(reach.sum()))
    at_least.append(0.0)
    return np.maximum(-np.diff(at_least), 0.0)


def node_probs(tree: Tree, tokens: np.ndarray, P: list) -> np.ndarray:
    """[T, V] the target's distribution at each node: P at the node's path tokens (context model)."""
    return np.stack([P[int(tree.depths[i])][tuple(tokens[tree.path_to(i)[1:]])] for i in range(tree.size)])


def tree_accept_exact(tree: Tree, tokens: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """[max depth + 1] exact P(n_accepted = d) under the q-free rule (a repeated sibling token is
    reached through its first child only)."""
    reach = np.zeros(tree.size)
    reach[0] = 1.0
    stop = np.ones(tree.size)
    for node in range(tree.size):                                  # parents come first
        seen = set()
        for c in tree.children[node]:
            t = int(tokens[c])
            if t not in seen:
                reach[c] = reach[node] * probs[node, t]
                stop[node] -= probs[node, t]
                seen.add(t)
    out = np.zeros(int(tree.depths.max()) + 1)
    np.add.at(out, tree.depths, reach * np.maximum(stop, 0.0))
    return out


def real_tree(tree, tokens, probs, uniforms):
    return accept_tree(tree, tokens, probs, uniforms=uniforms[:tree.size])


def run_tree(verify, tree: Tree, tokens: np.ndarray, P: list, n: int, seed: int):
    """One tree round per trial (the tree and its tokens are fixed before the coins are drawn)."""
    rng = np.random.default_rng(seed)
    k = int(tree.depths.max()) + 1
    probs = node_probs(tree, tokens, P)                                        # [T, V]
    coins = rng.random((n, 2 * tree.size + 1))                                 # enough for any rule
    out = np.full((n, k), -1, dtype=np.int64)
    n_acc = np.empty(n, dtype=np.int64)
    for i in range(n):
        v = verify(tree, tokens, probs, coins[i])
        if i < 2000:                                                           # the verdict's shape
            assert v.path[0] == 0 and np.array_equal(tree.path_to(int(v.path[-1])), v.path)
            assert np.array_equal(v.tokens[:-1], tokens[v.path[1:]])
        out[i, :len(v.tokens)] = v.tokens
        n_acc[i] = v.n_accepted
    return complete(out, P, rng), n_acc


# ------------------------------------------------------------------------------------------------
# accept_chain, γ = 1: sharp to flat, and the edge cases
# ------------------------------------------------------------------------------------------------
def _p_q(name: str, rng):
    """(p [V], q [V]) for one γ = 1 case."""
    if name.startswith("random"):                       # random-V-sharpness_p-sharpness_q
        _, V, sp, sq = name.split("-")
        V = int(V)
        return softmax(float(sp) * rng.standard_normal(V)), softmax(float(sq) * rng.standard_normal(V))
    V = 6
    base = softmax(rng.standard_normal(V))
    if name == "q_equals_p":
        return base, base.copy()
    if name == "disjoint_supports":
        return np.array([.5, .3, .2, 0, 0, 0]), np.array([0, 0, 0, .1, .6, .3])
    if name == "one_hot_p":
        return np.eye(V)[2], base
    if name == "one_hot_q":
        return base, np.eye(V)[1]
    if name == "one_hot_both_differ":
        return np.eye(V)[2], np.eye(V)[4]
    if name == "p_zero_where_q_has_mass":
        p = np.array([.4, 0, .35, 0, .25, 0])
        return p, np.array([.1, .3, .1, .3, .1, .1])
    if name == "partial_overlap":
        return np.array([.6, .4, 0, 0, 0, 0]), np.array([0, .2, .2, .2, .2, .2])
    raise KeyError(name)


CHAIN1_CASES = ["random-4-3-3", "random-4-0.3-0.3", "random-8-1-1", "random-8-3-0.3", "random-16-0.3-3",
                "random-32-1-1", "q_equals_p", "disjoint_supports", "one_hot_p", "one_hot_q",
                "one_hot_both_differ", "p_zero_where_q_has_mass", "partial_overlap"]


@pytest.mark.parametrize("name", CHAIN1_CASES)
def test_accept_chain_gamma1_is_lossless(name):
    rng = np.random.default_rng(CHAIN1_CASES.index(name) + 100)
    p, q = _p_q(name, rng)
    V = len(p)
    P = [p, softmax(rng.standard_normal((V, V)))]                  # P_1: the target one token later
    n = 200_000 if V >= 32 else N_TRIALS
    tokens, n_acc = run_chain(real_chain, P, [q], n, seed=CHAIN1_CASES.index(name))
    for fit, view in zip(check_emitted(tokens, P), ["first token", "first two tokens"]):
        assert_fits(fit, f"{name}: {view}")
    rate = float(np.minimum(p, q).sum())                            # acceptance rate = sum min(p, q)
    sd = np.sqrt(rate * (1 - rate) / n)
    assert abs(n_acc.mean() - rate) <= 4 * sd + 1e-12, f"{name}: acceptance {n_acc.mean():.5f} vs {rate:.5f}"
    check_accepted(n_acc, chain_accept_exact(P, [q]), name)


# ------------------------------------------------------------------------------------------------
# accept_chain, γ = 2 and 3: the joint of every emitted token (with completion), per-level acceptance
# ------------------------------------------------------------------------------------------------
CHAIN_CASES = [  # (name, V, γ, target sharpness, draft sharpness)
    ("v4-g2-flat", 4, 2, 0.5, 0.5),
    ("v6-g2-sharp-vs-flat", 6, 2, 3.0, 0.3),
    ("v4-g3-mixed", 4, 3, 1.0, 2.0),
    ("v5-g3-sharp", 5, 3, 3.0, 3.0),
]


@pytest.mark.parametrize("name,V,gamma,sp,sq", CHAIN_CASES)
def test_accept_chain_gamma_ge2_is_lossless(name, V, gamma, sp, sq):
    rng = np.random.default_rng([V, gamma, 7])
    P = random_model(rng, V, gamma, sp)
    Q = random_model(rng, V, gamma - 1, sq)
    tokens, n_acc = run_chain(real_chain, P, Q, N_TRIALS, seed=V * 10 + gamma)
    fits = check_emitted(tokens, P)
    fits.append(goodness_of_fit(counts_of(tokens[:, :2], (V, V)), joint(P, 2)))
    for fit, view in zip(fits, ["first token", f"all {gamma + 1} tokens", "first two tokens"]):
        assert_fits(fit, f"{name}: {view}")
    check_accepted(n_acc, chain_accept_exact(P, Q), name)


def test_accept_chain_ge2_with_duplicate_and_impossible_proposals():
    """Draft that often repeats the same token and proposes tokens the target gives zero mass."""
    V, gamma = 5, 3
    rng = np.random.default_rng(11)
    P = random_model(rng, V, gamma, 1.0)
    for j in range(gamma + 1):
        P[j][..., 4] = 0.0                                          # the target never says 4
        P[j] /= P[j].sum(-1, keepdims=True)
    Q = [np.broadcast_to(np.array([.5, .1, .1, .1, .2]), (V,) * (j + 1)).copy() for j in range(gamma)]
    tokens, n_acc = run_chain(real_chain, P, Q, N_TRIALS, seed=12)
    assert not np.any(tokens == 4)
    for fit in check_emitted(tokens, P):
        assert_fits(fit, "chain with repeated and impossible proposals")
    check_accepted(n_acc, chain_accept_exact(P, Q), "chain with repeated and impossible proposals")


# ------------------------------------------------------------------------------------------------
# accept_tree (q-free): fixed trees, duplicate siblings, children with no target mass
# ------------------------------------------------------------------------------------------------
TREE_CASES = {  # name: (V, parents, node tokens (root's ignored), sharpness, P_0 override)
    "root-3-children": (6, [-1, 0, 0, 0], [0, 1, 3, 4], 1.0, None),
    "duplicate-siblings": (5, [-1, 0, 0, 0, 1, 2, 3], [0, 2, 2, 3, 4, 1, 0], 1.0, None),
    "duplicate-siblings-deep": (4, [-1, 0, 0, 1, 2, 2, 3], [0, 1, 1, 1, 0, 2, 3], 0.5, None),
    "medusa-like": (4, [-1, 0, 0, 1, 1, 2, 3], [0, 0, 1, 2, 3, 0, 1], 2.0, None),
    "all-tokens-as-children": (5, [-1, 0, 0, 0, 0, 0], [0, 0, 1, 2, 3, 4], 1.0, None),
    "children-without-mass": (6, [-1, 0, 0, 1], [0, 1, 2, 3], 1.0, [0, 0, .5, 0, .5, 0]),
    "chain-as-tree": (4, [-1, 0, 1, 2], [0, 1, 2, 3], 0.3, None),
}


@pytest.mark.parametrize("name", list(TREE_CASES))
def test_accept_tree_is_lossless(name):
    V, parents, tokens, sharpness, first = TREE_CASES[name]
    tree, tokens = Tree(np.array(parents)), np.array(tokens, dtype=np.int64)
    k = int(tree.depths.max()) + 1
    rng = np.random.default_rng(list(TREE_CASES).index(name) + 300)
    P = random_model(rng, V, k - 1, sharpness, first)
    emitted, n_acc = run_tree(real_tree, tree, tokens, P, N_TRIALS, seed=len(name))
    for fit, view in zip(check_emitted(emitted, P), ["first token", f"first {k} tokens"]):
        assert_fits(fit, f"{name}: {view}")
    exact = tree_accept_exact(tree, tokens, node_probs(tree, tokens, P))
    # root level: P(a child is accepted) = sum of p over the distinct children's tokens
    root_kids = {int(tokens[c]) for c in tree.children[0]}
    assert np.isclose(1 - exact[0], sum(P[0][t] for t in root_kids))
    check_accepted(n_acc, exact, name)


# ------------------------------------------------------------------------------------------------
# Teeth: verifier copies with one planted bug each must fail; the copy without a bug must pass
# ------------------------------------------------------------------------------------------------
def _sample_unnormalized(probs, u):
    """The planted "residual not normalized" bug: compare u with the raw cumulative mass."""
    idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return min(idx, int(np.flatnonzero(probs > 0)[-1]))


def chain_copy(bug: str | None):
    """accept_chain copied line by line, with the bug named `bug` planted (None: a faithful copy)."""
    def verify(proposal, draft_probs, target_probs, uniforms, draft_probs_raw):
        gamma = len(proposal)
        for i in range(gamma):
            x, p, q = proposal[i], target_probs[i], draft_probs[i]
            if bug == "q_from_unwarped_logits":                 # transformers #47932 / #32867
                q = draft_probs_raw[i]
            if bug == "inverted_ratio":
                accept = uniforms[i] * p[x] < q[x]               # u < q/p instead of u < p/q
            else:
                accept = uniforms[i] * q[x] < p[x]
            if accept:
                continue
            residual = np.maximum(p - q, 0.0)
            if residual.sum() <= 0:
                residual = p
            if bug == "recovered_from_p":
                residual = p                                     # forgets to subtract q
            coin = uniforms[i] if bug == "shared_coin" else uniforms[gamma]   # reuses the test's coin
            if bug == "residual_unnormalized":
                token = _sample_unnormalized(residual, coin)
            else:
                token = sample(residual, coin)
            return Verdict(np.arange(i + 1), np.append(proposal[:i], token).astype(np.int64))
        last = target_probs[gamma]
        if bug == "stale_bonus":                                 # the last level's residual, not p_γ
            stale = np.maximum(target_probs[gamma - 1] - draft_probs[gamma - 1], 0.0)
            last = stale if stale.sum() > 0 else target_probs[gamma - 1]
        bonus = sample(last, uniforms[gamma])
        return Verdict(np.arange(gamma + 1), np.append(proposal, bonus).astype(np.int64))
    return verify


def _teeth_case(kind: str):
    """(P, Q, Q_raw) that expose the planted bugs; Q is the distribution the proposals come from,
    Q_raw the softmax of the draft's unwarped logits."""
    rng = np.random.default_rng(["top_k", "greedy", "generic", "gamma2"].index(kind) + 500)
    if kind in ("top_k", "greedy"):
        V = 8
        P = random_model(rng, V, 1, 1.0)
        draft_logits = 1.5 * rng.standard_normal(V)
        target_logits = draft_logits + rng.standard_normal(V)
        params = SamplingParams(temperature=1.0, top_k=2) if kind == "top_k" else SamplingParams(0.0)
        # the target samples at temperature 1 (with the same top-k when the draft uses one)
        P[0] = warp(target_logits, SamplingParams(temperature=1.0, top_k=params.top_k))
        return P, [warp(draft_logits, params)], [softmax(draft_logits)]
    gamma = 2 if kind == "gamma2" else 1
    P = random_model(rng, 6, gamma, 1.0)
    return P, random_model(rng, 6, gamma - 1, 1.5), None


CHAIN_BUGS = [  # (bug, case that exposes it)
    (None, "generic"),
    (None, "top_k"),
    (None, "greedy"),
    (None, "gamma2"),
    ("q_from_unwarped_logits", "top_k"),      # transformers #47932: tokens from top-k q, ratio from raw q
    ("q_from_unwarped_logits", "greedy"),     # transformers #32867: greedy draft, q from softmax
    ("recovered_from_p", "generic"),
    ("residual_unnormalized", "generic"),
    ("shared_coin", "generic"),
    ("inverted_ratio", "generic"),
    ("stale_bonus", "gamma2"),                # EAGLE PR #47, chain form
]


@pytest.mark.parametrize("bug,kind", CHAIN_BUGS)
def test_teeth_chain(bug, kind):
    P, Q, Q_raw = _teeth_case(kind)
    tokens, _ = run_chain(chain_copy(bug), P, Q, 20_000, seed=CHAIN_BUGS.index((bug, kind)), Q_raw=Q_raw)
    fits = check_emitted(tokens, P)
    if bug is None:
        for fit in fits:
            assert_fits(fit, f"faithful copy of accept_chain, {kind} case")
    else:
        worst = min(fits, key=lambda f: f.pvalue)
        assert worst.pvalue < TEETH_P, f"planted bug {bug!r} not detected: {worst}"


def tree_sequential(bug: str | None):
    """The q-free rule in its sibling-by-sibling form (ANCHORS.md): try the distinct children in order,
    accept child c with p'(c) (p' = p with earlier rejected children removed, renormalized); if none is
    accepted draw from p'; after an acceptance descend with the child's own fresh p.
    bug "stale_bonus": at a leaf reached after a sibling was rejected, the bonus is drawn from the
    parent's residual p' (EAGLE PR #47)."""
    def verify(tree, tokens, probs, uniforms):
        node, path, coin = 0, [0], 0
        p = probs[0].copy()                                              # [V] p' at the current node
        while tree.children[node]:
            nxt, rejected = None, False
            for c in tree.children[node]:
                t = int(tokens[c])
                u, coin = uniforms[coin], coin + 1
                if u * p.sum() < p[t]:                                   # accept with p'(t)
                    nxt = c
                    break
                p[t], rejected = 0.0, True                               # remove it, renormalize later
            if nxt is None:
                break                                                    # recovered token from p'
            node = nxt
            path.append(node)
            if not (bug == "stale_bonus" and rejected and not tree.children[node]):
                p = probs[node].copy()
        y = sample(p, uniforms[coin])
        return Verdict(np.asarray(path), np.append(tokens[path[1:]], y).astype(np.int64))
    return verify


@pytest.mark.parametrize("bug", [None, "stale_bonus"])
def test_teeth_tree_sibling_form(bug):
    """The sibling-by-sibling form is lossless too; drawing a leaf's bonus from the stale residual is not."""
    V = 5
    tree, tokens = Tree(np.array([-1, 0, 0, 0, 1, 1])), np.array([0, 0, 1, 2, 3, 4])
    P = random_model(np.random.default_rng(77), V, 2, 1.0)
    emitted, n_acc = run_tree(tree_sequential(bug), tree, tokens, P, 30_000, seed=78)
    fits = check_emitted(emitted, P)
    if bug is None:
        for fit in fits:
            assert_fits(fit, "sibling form of the q-free rule")
        check_accepted(n_acc, tree_accept_exact(tree, tokens, node_probs(tree, tokens, P)), "sibling form")
    else:
        assert min(f.pvalue for f in fits) < TEETH_P, f"planted bug {bug!r} not detected: {fits}"


# ------------------------------------------------------------------------------------------------
# Worked examples a human can check
# ------------------------------------------------------------------------------------------------
def test_accept_greedy_worked_examples():
    chain = Tree.chain(2)
    v = accept_greedy(chain, np.array([0, 7, 9]), np.array([7, 4, 5]))      # the docstring example
    assert v.path.tolist() == [0, 1] and v.tokens.tolist() == [7, 4]
    v = accept_greedy(chain, np.array([0, 7, 9]), np.array([7, 9, 3]))      # all accepted + bonus 3
    assert v.path.tolist() == [0, 1, 2] and v.tokens.tolist() == [7, 9, 3]
    v = accept_greedy(chain, np.array([0, 7, 9]), np.array([8, 9, 3]))      # first rejected
    assert v.path.tolist() == [0] and v.tokens.tolist() == [8]
    # root -> {5 (-> 7), 6 (-> 8)}: argmax 6 at the root, 8 at node 2, then 2
    tree = Tree(np.array([-1, 0, 0, 1, 2]))
    v = accept_greedy(tree, np.array([0, 5, 6, 7, 8]), np.array([6, 7, 8, 1, 2]))
    assert v.path.tolist() == [0, 2, 4] and v.tokens.tolist() == [6, 8, 2]
    # duplicate siblings: the first child with the argmax token is followed
    tree = Tree(np.array([-1, 0, 0, 1, 2]))
    v = accept_greedy(tree, np.array([0, 6, 6, 1, 2]), np.array([6, 1, 2, 9, 9]))
    assert v.path.tolist() == [0, 1, 3] and v.tokens.tolist() == [6, 1, 9]
    # a root without children: just the argmax
    v = accept_greedy(Tree(np.array([-1])), np.array([3]), np.array([4]))
    assert v.path.tolist() == [0] and v.tokens.tolist() == [4] and v.n_accepted == 0


def test_accept_chain_worked_examples():
    p = np.array([[.5, .5], [.2, .8]])
    q = np.array([[1.0, 0.0]])
    v = accept_chain(np.array([0]), q, p, uniforms=np.array([0.4, 0.9]))             # u0 < 0.5: accept, bonus ~ p_1
    assert v.tokens.tolist() == [0, 1] and v.path.tolist() == [0, 1]
    v = accept_chain(np.array([0]), q, p, uniforms=np.array([0.4, 0.1]))
    assert v.tokens.tolist() == [0, 0]
    v = accept_chain(np.array([0]), q, p, uniforms=np.array([0.6, 0.0]))             # reject: residual [0, .5] -> 1
    assert v.tokens.tolist() == [1] and v.path.tolist() == [0]
    # γ = 2: first accepted (p >= q), second rejected (u * q >= p), residual max(p - q, 0) = [0, 0, .3]
    p = np.array([[.6, .4, 0], [.2, .2, .6], [1, 0, 0]])
    q = np.array([[.5, .5, 0], [.5, .2, .3]])
    v = accept_chain(np.array([0, 0]), q, p, uniforms=np.array([0.99, 0.5, 0.0]))
    assert v.tokens.tolist() == [0, 2] and v.path.tolist() == [0, 1]


def test_accept_chain_residual_without_mass_does_not_divide_by_zero():
    """p and q equal up to rounding: a rejection can leave max(p - q, 0) == 0 everywhere (gpt-fast)."""
    p = np.array([[0.5, 0.5], [0.3, 0.7]])
    q = np.array([[0.5, np.nextafter(0.5, 1)]])                           # q(1) one ulp above p(1)
    with np.errstate(all="raise"):
        v = accept_chain(np.array([1]), q, p, uniforms=np.array([np.nextafter(1.0, 0), 0.75]))
    assert v.n_accepted == 0 and v.tokens[0] in (0, 1)


def test_accept_tree_worked_example():
    # root -> children tokens {3, 5}; p_0(3) = .6, p_0(5) = .3, else .1 on token 0
    tree, tokens = Tree(np.array([-1, 0, 0])), np.array([0, 3, 5])
    probs = np.zeros((3, 6))
    probs[0, [0, 3, 5]] = [.1, .6, .3]
    probs[1, 4] = probs[2, 2] = 1.0
    assert accept_tree(tree, tokens, probs, uniforms=np.array([0.05, 0.5, 0.5])).tokens.tolist() == [0]
    v = accept_tree(tree, tokens, probs, uniforms=np.array([0.5, 0.5, 0.5]))
    assert v.tokens.tolist() == [3, 4] and v.path.tolist() == [0, 1]
    v = accept_tree(tree, tokens, probs, uniforms=np.array([0.95, 0.5, 0.5]))
    assert v.tokens.tolist() == [5, 2] and v.path.tolist() == [0, 2]


def test_trees_are_shared_read_only_and_built_once_per_shape():
    """Proposers' trees repeat round after round: tree_of builds each shape once and the arrays of a shared
    Tree cannot be written (a caller's array is copied, not frozen); the docstring's worked example holds."""
    from specexport.runtime.tree import tree_of

    parents = np.array([-1, 0, 0, 1])
    tree = tree_of(parents)
    assert tree is tree_of([-1, 0, 0, 1]) and tree is not tree_of([-1, 0, 1, 1])
    assert parents.flags.writeable and tree.depths.tolist() == [0, 1, 1, 2] and tree.children == ((1, 2), (3,), (), ())
    assert tree.mask.astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    for a in (tree.parents, tree.depths, tree.mask):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 0
    assert Tree(np.arange(-1, 3)).is_chain and not tree.is_chain
    for bad in ([0, 0], [-1, 1], [-1, 0, 3]):
        with pytest.raises(ValueError, match="parents"):
            Tree(np.array(bad))


def test_a_static_trees_cut_is_made_once_per_limits_and_shared_read_only():
    from specexport.runtime.tree import cut, from_rank_paths

    tree, ranks = from_rank_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    small, small_ranks = cut(tree, ranks, 2, 3)
    assert small.parents.tolist() == [-1, 0, 0, 1] and small_ranks.tolist() == [-1, 0, 1, 0]
    assert cut(tree, ranks, 2, 3)[0] is small and cut(tree, ranks, 2, 3)[1] is small_ranks
    with pytest.raises(ValueError, match="read-only"):
        small_ranks[0] = 0
    whole = cut(tree, ranks, 3, 5)                                       # nothing cut: the tree itself
    assert whole[0] is tree and whole[1] is ranks
    other_ranks = ranks.copy()                                           # another proposer's arrays: its own cut
    assert cut(tree, other_ranks, 2, 3)[1] is not small_ranks


# ------------------------------------------------------------------------------------------------
# warp, sample, SamplingParams
# ------------------------------------------------------------------------------------------------
def test_warp_docstring_example_and_temperature():
    assert_close(warp(np.array([2., 1, 0, -1]), SamplingParams(1.0, top_k=2)), [0.7310586, 0.2689414, 0, 0],
                 rel=1e-6, why="the expected probabilities are written to 7 digits")
    z = np.random.default_rng(0).standard_normal((3, 7))
    for t in (0.25, 1.0, 3.0):
        np.testing.assert_allclose(warp(z, SamplingParams(t)), softmax(z / t), rtol=1e-12)


def test_warp_top_k_keeps_exactly_k_largest():
    rng = np.random.default_rng(1)
    z = rng.standard_normal((50, 12))                               # continuous: no ties
    for k in (1, 2, 5, 11, 12, 40):
        w = warp(z, SamplingParams(0.7, top_k=k))
        kept = w > 0
        assert np.all(kept.sum(-1) == min(k, 12))
        top = np.argsort(-z, -1)[:, :min(k, 12)]
        assert np.all(np.take_along_axis(kept, top, -1))
        ref = np.where(kept, softmax(z / 0.7), 0)
        np.testing.assert_allclose(w, ref / ref.sum(-1, keepdims=True), rtol=1e-12)


def test_warp_top_p_keeps_smallest_set_reaching_top_p():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((200, 10)) * 2
    base = softmax(z)
    for top_p in (0.05, 0.3, 0.5, 0.8, 0.95, 0.999):
        w = warp(z, SamplingParams(1.0, top_p=top_p))
        for b, row in zip(base, w):
            order = np.argsort(-b)
            m = int((row > 0).sum())
            assert set(np.flatnonzero(row > 0)) == set(order[:m])          # the m most likely tokens
            assert b[order[:m]].sum() >= top_p - 1e-12                    # reaches top_p ...
            assert m == 1 or b[order[:m - 1]].sum() < top_p               # ... and no smaller set does
            np.testing.assert_allclose(row[order[:m]], b[order[:m]] / b[order[:m]].sum(), rtol=1e-12)
    np.testing.assert_array_equal(warp(z, SamplingParams(1.0, top_p=1.0)) > 0, True)


def test_warp_top_p_on_a_vocabulary_equals_sorting_every_token():
    """Rows longer than sampling._SORT_ALL sort only their most likely tokens: the same bits as a stable sort
    of the whole row (ties, flat rows, peaked rows, one row or several, each as its own row)."""
    from specexport.runtime import sampling

    def whole_sort(probs, top_p):
        order = np.argsort(-probs, kind="stable")
        keep = (np.cumsum(probs[order]) - probs[order]) < top_p
        out = np.zeros_like(probs)
        out[order[keep]] = probs[order[keep]]
        return out / np.add.reduce(out)

    rng = np.random.default_rng(5)
    V = 4 * sampling._SORT_ALL + 3
    for scale in (0.2, 1.0, 4.0, 12.0):
        z = (scale * rng.standard_normal((3, V))).astype(np.float32)
        z[1, rng.integers(0, V, V // 2)] = z[1, 0]                                     # ties
        z[2] = np.round(z[2])
        for top_p in (0.1, 0.5, 0.9, 0.99):
            w = warp(z, SamplingParams(1.0, top_p=top_p))
            for row, probs in zip(w, warp(z, SamplingParams(1.0))):
                np.testing.assert_array_equal(row, whole_sort(probs, top_p))
            np.testing.assert_array_equal(warp(z[0], SamplingParams(1.0, top_p=top_p)), w[0])
    bad = z[0].copy()
    bad[3] = np.nan                                     # garbage in, the whole sort's garbage out (no crash)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(warp(bad, SamplingParams(1.0, top_p=0.9)),
                                      whole_sort(warp(bad, SamplingParams(1.0)), 0.9))


def test_warp_order_temperature_then_top_k_then_top_p():
    z = np.array([2., 1, 0, -1])
    # top-k 2 first: [.731, .269] -> top-p .7 keeps only token 0. (top-p first would keep two.)
    np.testing.assert_allclose(warp(z, SamplingParams(1.0, top_k=2, top_p=0.7)), [1, 0, 0, 0])
    # temperature first: at T = 3, softmax [.39, .28, .20, .14] needs three tokens for .8
    assert (warp(z, SamplingParams(3.0, top_p=0.8)) > 0).sum() == 3
    assert (warp(z, SamplingParams(1.0, top_p=0.8)) > 0).sum() == 2


def test_warp_greedy_is_one_hot_argmax():
    z = np.random.default_rng(3).standard_normal((4, 5, 9))
    for params in (SamplingParams(0.0), SamplingParams(0.0, top_k=3, top_p=0.5)):
        w = warp(z, params)
        np.testing.assert_array_equal(w, np.eye(9)[z.argmax(-1)])
    assert warp(np.array([1., 3, 3, 0]), SamplingParams(0.0)).tolist() == [0, 1, 0, 0]   # first of a tie


def test_sample_never_returns_zero_probability_token():
    us = np.concatenate([np.linspace(0, 1, 2001, endpoint=False), [np.nextafter(1.0, 0), 0.0, 1e-300]])
    rng = np.random.default_rng(4)
    cases = [np.array([0.5, 0, 0.5]), np.array([0, 0, 1.0]), np.array([1.0, 0, 0]), np.array([0, 1e-300, 0]),
             np.array([0.1, 0.2, 0.3, 0.0]), np.array([3, 0, 0, 5.0])]      # unnormalized rows too
    for _ in range(30):
        p = rng.random(8) * (rng.random(8) < 0.5)
        if p.sum() > 0:
            cases.append(p)
    for p in cases:
        got = np.array([sample(p, u) for u in us])
        assert np.all(p[got] > 0), (p, got[p[got] <= 0])
    assert sample(np.array([0.5, 0, 0.5]), 0.2) == 0 and sample(np.array([0.5, 0, 0.5]), 0.7) == 2


def test_sample_is_an_exact_inverse_cdf():
    """On a fine grid of u the frequencies equal p to within one grid step per boundary."""
    p = np.array([0.1, 0.0, 0.25, 0.05, 0.0, 0.6])
    n = 20_000
    got = np.array([sample(p, u) for u in (np.arange(n) + 0.5) / n])
    np.testing.assert_allclose(np.bincount(got, minlength=6) / n, p, atol=2 / n)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_k=-3), "top_k"),
    (dict(temperature=1.0, top_k=2.5), "top_k"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_p=-0.2), "top_p"),
    (dict(temperature=1.0, top_p=float("nan")), "top_p"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_valid_values():
    assert SamplingParams().greedy and not SamplingParams(0.5).greedy
    SamplingParams(temperature=1, top_k=1, top_p=1.0)
    SamplingParams(temperature=0.01, top_k=100, top_p=1e-9)
