"""A draft model proposing a static token tree (rank paths, as Medusa writes them), verified in one
target pass: the top-ranked draft tokens at each node, to the depths and widths the tree names.

Drafting level by level without a contract change: the draft's KV holds only the committed text.
Each round it first catches up on seq[draft.length:N] (the accepted tokens of the last round and the
root) and commits that; the root's logits give the depth-1 children. Level d then feeds every tree
node of depth < d at once, with the tree's ancestor mask and depth positions, into the draft's
scratch rows, reads the logits of the depth-(d-1) nodes, and rolls the scratch back. The cost is the
sum of the levels' sizes in draft tokens (small trees: a few draft passes); nothing of a rejected
branch is ever committed, so the next round's catch-up is all the bookkeeping there is.

By default the children are chosen deterministically (ranks of the draft's warped distribution), so
the q-free rule verifies the tree losslessly at any temperature; greedy verification equals plain
greedy. With sampled=True (and temperature > 0) a node's children are instead drawn i.i.d. from the
draft's warped distribution (the rank paths then only give the tree's shape), the proposal carries
that q, and the loop verifies with the multi-draft rule (accept_tree_sampled, with replacement).
"""
from __future__ import annotations

import numpy as np

from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.sampling import sample, warp
from specexport.runtime.tree import cut, from_rank_paths


class DraftTree(Proposer):
    def __init__(self, draft, paths, *, sampled: bool = False):
        self.draft, self.sampled = draft, sampled
        self.round_keyed = sampled          # sampled children come from the rng
        self.tree, self.ranks = from_rank_paths(paths)          # [T], ranks[0] = -1 (root)
        if int(self.ranks.max()) >= draft.vocab_size:
            raise ValueError(f"tree: rank {int(self.ranks.max())} is beyond the draft's vocabulary of "
                             f"{draft.vocab_size} tokens")
        self.max_depth = int(self.tree.depths.max())
        self.max_nodes = self.tree.size - 1
        self.capacity = draft.capacity
        self._levels = {}                   # id(tree) -> (tree, its levels): a round's tree repeats (tree_of)

    def begin(self, prompt: np.ndarray, prefill_chunk: int) -> None:
        from specexport.runtime.backends.base import prefill

        self.draft.reset()
        prefill(self.draft, prompt, prefill_chunk)

    def propose(self, seq, n, limits: Limits, params, rng, stats) -> Proposal:
        tree, ranks = cut(self.tree, self.ranks, limits.max_depth, limits.max_nodes)
        draft = self.draft
        tokens = np.empty(tree.size, dtype=np.int64)                   # [T]
        tokens[0] = seq[n - 1]
        sampled = self.sampled and not params.greedy
        q = np.zeros((tree.size, draft.vocab_size)) if sampled else None    # [T, V] row i: what node i was drawn from
        choose = (lambda parents, logits: self._draw(tree, tokens, q, parents, logits, params, rng)) if sampled \
            else (lambda parents, logits: self._choose(tree, ranks, tokens, parents, logits, params))
        feed = seq[draft.length:n]                                     # catch up, root last
        out = draft.forward(feed)
        draft.commit(len(feed))
        stats.count_forward(self.role, len(feed))
        choose([0], out.logits[-1:])
        for rows, sub, depths, parents, at in self._levels_of(tree):
            out = draft.forward(tokens[rows], depths=depths, tree_mask=sub)
            stats.count_forward(self.role, len(rows))
            choose(parents, out.logits[at])
            draft.rollback(draft.length)                              # forget the scratch rows
        stats.draft_passes += int(tree.depths.max())
        return Proposal(tree, tokens, q[1:] if sampled else None)

    def _levels_of(self, tree) -> list:
        """Per level d >= 2: the rows fed (nodes of depth 1..d-1), their mask and depth positions, the
        depth-(d-1) parents whose children this level chooses, and their rows in the output."""
        known = self._levels.get(id(tree))
        if known is not None and known[0] is tree:
            return known[1]
        levels = []
        for d in range(2, int(tree.depths.max()) + 1):
            rows = np.flatnonzero((tree.depths >= 1) & (tree.depths < d))
            parents = rows[tree.depths[rows] == d - 1]
            levels.append((rows, tree.mask[np.ix_(rows, rows)], tree.depths[rows] - 1, parents,
                           np.searchsorted(rows, parents)))
        self._levels[id(tree)] = (tree, levels)
        return levels

    @staticmethod
    def _draw(tree, tokens, q, parents, logits, params, rng) -> None:
        """Draw the children of `parents` i.i.d. from the warped draft distribution at the parent."""
        for p, row in zip(parents, logits):
            kids = tree.children[p]
            if kids:
                dist = warp(row, params)
                for c in kids:
                    q[c] = dist
                    tokens[c] = sample(dist, rng.random())

    @staticmethod
    def _choose(tree, ranks, tokens, parents, logits, params) -> None:
        """Set the tokens of the children of `parents` from their logits [len(parents), V]: the child of
        rank r gets the r-th most likely token of the warped draft distribution (argmax order when greedy)."""
        for p, row in zip(parents, logits):
            kids = tree.children[p]
            if not kids:
                continue
            scores = row if params.greedy else warp(row, params)
            order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
            for c in kids:
                tokens[c] = order[ranks[c]]
