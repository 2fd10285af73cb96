"""Medusa: heads on the target's own hidden state propose a static token tree each round.

Head h reads the final hidden state x of the position whose logits chose the root (the newest
token, seq[N-1]) and ranks the tokens for position N + h, i.e. depth h + 1 of the tree. A tree node
with rank path (r_1, ..., r_d) gets head d-1's r_d-th most likely token: every node at depth d
draws from the same head's top-k, whatever its parent (the heads see only x), exactly as Medusa's
`medusa_choices` trees do. No KV and no catch-up: the loop hands the proposer the target's hidden
states of the rows it commits (`features`), and the next round's x is the last of them.

The children are chosen deterministically (ranks), so the q-free rule verifies the tree losslessly at
any temperature, and greedy verification equals plain greedy. Medusa's "typical acceptance" is not
offered: it is not lossless.
"""
from __future__ import annotations

import numpy as np

from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.tree import cut, from_rank_paths


class MedusaTree(Proposer):
    role = "medusa"
    wants_features = True

    def __init__(self, heads, paths):
        """heads: callable hidden [H] -> ids [N, K] (each head's K most likely tokens, best first),
        with `num_heads` and `top_k`; paths: rank paths (Medusa's medusa_choices format)."""
        self.heads = heads
        self.tree, self.ranks = from_rank_paths(paths)
        self.max_depth = int(self.tree.depths.max())
        self.max_nodes = self.tree.size - 1
        self.check(self.tree, self.ranks, heads.num_heads, heads.top_k)
        self._hidden = None

    @staticmethod
    def check(tree, ranks, num_heads: int, top_k: int) -> None:
        """A rank tree these heads can propose: depth d reads head d - 1, a rank r needs top_k > r."""
        depth, rank = int(tree.depths.max()), int(ranks.max())
        if depth > num_heads:
            raise ValueError(f"tree: depth {depth} needs {depth} heads; these Medusa heads are {num_heads}")
        if rank >= top_k:
            raise ValueError(f"tree: rank {rank} needs top_k > {rank}; the heads graph returns the top {top_k} "
                             f"(medusa.top_k in the model.yaml)")

    def features(self, hidden: np.ndarray, start: int) -> None:
        self._hidden = np.array(hidden[-1])                 # [H] the state that chose the newest token

    def propose(self, seq, n, limits: Limits, params, rng, stats) -> Proposal:
        tree, ranks = cut(self.tree, self.ranks, limits.max_depth, max_nodes=limits.max_nodes)
        ids = self.heads(self._hidden)                      # [N, K]
        stats.count_forward(self.role, 1)
        stats.draft_passes += 1
        tokens = np.empty(tree.size, dtype=np.int64)        # [T]
        tokens[0] = seq[n - 1]
        tokens[1:] = ids[tree.depths[1:] - 1, ranks[1:]]
        return Proposal(tree, tokens)
