"""Verification: which proposed tokens the target accepts, and the one token it adds.

Three rules, each a pure function with the random coins passed in (the loop owns the RNG):

* `accept_greedy` (any tree): follow the children whose token equals the target's argmax at their
  parent, as deep as possible; then add the target's argmax at the deepest accepted node (bonus).
  Output equals plain greedy decoding.
* `accept_chain` (a chain sampled from the draft's q; Leviathan et al. 2023, Chen et al. 2023):
  accept proposal x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the
  recovered token from normalize(max(0, p_i - q_i)); after full acceptance draw the bonus from p_γ.
  Lossless: the emitted tokens are distributed exactly as sampling from p alone.
* `accept_tree` (a tree whose children were chosen deterministically: top-k of heads, n-grams,
  Medusa, EAGLE): at each node draw y ~ p(node); if y is a child's token descend into that child,
  otherwise emit y and stop; at a leaf, y is the bonus. This is the q-free rule of ANCHORS.md in its
  "sample y ~ p" form, lossless however the children were chosen, if the tree was fixed first.

* `accept_tree_sampled` (a tree whose children were *sampled* from the draft: several draft samples
  per node): multi-draft rejection sampling. At a node, try its children in order: accept child x
  with probability min(1, p(x) / q(x)); on rejection replace p by normalize(max(0, p - q)) and, when
  the children were drawn without replacement, remove x from q and renormalise it; descend into an
  accepted child with its own fresh p; when every child is rejected, draw from the final p. With
  replacement this is SpecInfer's rule (Miao et al. 2024), without it recursive rejection sampling
  (Jeon et al. 2024). The q-free rule is wrong here: it ignores that likely draft tokens are proposed
  more often (a test plants exactly that).

A Verdict's `path` is the nodes whose K/V the target commits (the root and the accepted nodes);
`tokens` are what the round emits (accepted tokens, then the bonus or recovered token).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.runtime.sampling import sample
from specexport.runtime.tree import Tree


@dataclass(frozen=True)
class Verdict:
    path: np.ndarray        # [n_accepted + 1] node indices root-first: the rows to commit
    tokens: np.ndarray      # [n_accepted + 1] accepted tokens, then the bonus/recovered token

    @property
    def n_accepted(self) -> int:
        return len(self.path) - 1


def accept_greedy(tree: Tree, node_tokens: np.ndarray, target_argmax: np.ndarray) -> Verdict:
    """node_tokens [T] (node 0 = root, ignored), target_argmax [T] the target's argmax at each node.

    Example: chain 0 -> 1 -> 2, node_tokens [_, 7, 9], argmax [7, 4, 5] -> path [0, 1], tokens [7, 4].
    """
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if node_tokens[c] == target_argmax[node]), None)
        if nxt is None:
            break
        node = nxt
        path.append(node)
    path = np.asarray(path, dtype=np.int64)
    return Verdict(path, _then(node_tokens[path[1:]], target_argmax[node]))


def accept_chain(proposal: np.ndarray, draft_probs: np.ndarray, target_probs: np.ndarray,
                 *, uniforms: np.ndarray, draws: np.ndarray | None = None) -> Verdict:
    """Lossless rejection sampling over a chain.

    proposal      [γ]       x_1..x_γ, x_i drawn from draft_probs[i-1]
    draft_probs   [γ, V]    q_i, the warped draft distribution each x_i was drawn from
    target_probs  [γ+1, V]  p_0..p_γ, warped target distributions at the root and each proposal
    uniforms      [γ+1]     coins in [0, 1): one per acceptance test, the last for the final draw
    draws         [γ+1]     (optional) the final draw's coin by the position it lands at: draws[i] when
                            proposal i is rejected, draws[γ] for the bonus (the loop's Coins.DRAW)

    Example: γ = 1, p_0 = [0.5, 0.5], q_1 = [1, 0], x_1 = 0: accept iff u_0 < 0.5; on rejection the
    residual is [0, 0.5] -> token 1.
    """
    gamma = len(proposal)
    for i in range(gamma):
        x, p, q = proposal[i], target_probs[i], draft_probs[i]
        if uniforms[i] * q[x] < p[x]:                  # accept with probability min(1, p(x)/q(x))
            continue
        residual = np.maximum(p - q, 0.0)
        # p == q (up to rounding) leaves no residual mass: rejection then had probability ~0 and p is
        # the right distribution (gpt-fast divided by zero here).
        token = sample(residual if residual.sum() > 0 else p, uniforms[gamma] if draws is None else draws[i])
        return Verdict(np.arange(i + 1), _then(proposal[:i], token))
    bonus = sample(target_probs[gamma], uniforms[gamma] if draws is None else draws[gamma])
    return Verdict(np.arange(gamma + 1), _then(proposal, bonus))


def accept_tree(tree: Tree, node_tokens: np.ndarray, target_probs: np.ndarray, *, uniforms: np.ndarray) -> Verdict:
    """Lossless verification of a tree with deterministically chosen children (q-free rule).

    node_tokens   [T]      token of each node (node 0 = root, ignored)
    target_probs  [T, V]   warped target distribution at each node
    uniforms      [T]      coins; one is used per level descended (max depth + 1 at most)

    Example: root with children tokens {3, 5}, p_0 = [.., p(3)=0.6, .., p(5)=0.3, ..]: the round
    accepts child 3 with probability 0.6, child 5 with 0.3, and emits another token with 0.1.
    Duplicate sibling tokens: the first such child is taken (the later one can never be reached).
    """
    node, path, level = 0, [0], 0
    while True:
        y = sample(target_probs[node], uniforms[level])
        level += 1
        nxt = next((c for c in tree.children[node] if node_tokens[c] == y), None)
        if nxt is None:
            path = np.asarray(path, dtype=np.int64)
            return Verdict(path, _then(node_tokens[path[1:]], y))
        node = nxt
        path.append(node)


def accept_tree_sampled(tree: Tree, node_tokens: np.ndarray, target_probs: np.ndarray, *, draft_probs: np.ndarray,
                        uniforms: np.ndarray, replacement: bool, draws: np.ndarray | None = None) -> Verdict:
    """Lossless verification of a tree whose children were sampled from the draft.

    node_tokens   [T]      token of each node (node 0 = root, ignored)
    target_probs  [T, V]   warped target distribution at each node
    draft_probs   [T-1, V] row i - 1: the warped draft distribution node i and its siblings were
                           first drawn from (the same row for all children of one parent), as in
                           Proposal.q
    uniforms      [>= T + depth + 1]  coins: one per child tried, one per final draw
    replacement   the children of a node were drawn i.i.d. from q (True), or one after another from
                  q with the earlier ones removed (False)
    draws         [>= depth + 1] (optional) the final draw's coin by depth (the position it lands at);
                  None: the next coin of `uniforms`

    Example (with replacement): p = [0.5, 0.5], q = [1, 0], two children both token 0: the first is
    accepted with probability 0.5; if rejected the residual max(p - q, 0) = [0, 0.5] makes the second
    impossible, and the round emits token 1.
    """
    node, path, u = 0, [0], 0
    while True:
        kids = tree.children[node]
        p = np.array(target_probs[node], dtype=np.float64)
        q = np.array(draft_probs[kids[0] - 1], dtype=np.float64) if kids else None
        nxt = None
        for c in kids:
            x = node_tokens[c]
            coin = uniforms[u]
            u += 1
            if coin * q[x] < p[x]:                     # accept with probability min(1, p(x) / q(x))
                nxt = c
                break
            residual = np.maximum(p - q, 0.0)
            total = np.add.reduce(residual)            # ndarray.sum's value without its wrappers (per child)
            if total > 0:                              # p == q: rejection had probability 0; keep p (no 0/0)
                p = residual / total
            if not replacement:
                q[x] = 0.0
                total = np.add.reduce(q)
                if total > 0:
                    q /= total
        if nxt is None:
            y = sample(p, uniforms[u] if draws is None else draws[len(path) - 1])
            path = np.asarray(path, dtype=np.int64)
            return Verdict(path, _then(node_tokens[path[1:]], y))
        node = nxt
        path.append(node)


def _then(tokens: np.ndarray, last: int) -> np.ndarray:
    """[k + 1] int64: tokens, then one more (np.append without its wrappers: the loop calls this every round)."""
    out = np.empty(len(tokens) + 1, dtype=np.int64)
    out[:-1] = tokens
    out[-1] = last
    return out
