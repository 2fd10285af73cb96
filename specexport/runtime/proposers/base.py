"""The Proposer seam: what the loop asks each round (Limits in, a Proposal out) and the base class
every method derives from. See the package docstring for a round as the loop drives it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.runtime.tree import Tree


@dataclass(frozen=True)
class Limits:
    """What this round may propose: the tree's depth (tokens it could emit, minus the bonus) and
    its node count (rows the target's verify pass writes, root excluded)."""
    max_depth: int
    max_nodes: int


@dataclass(frozen=True)
class Proposal:
    tree: Tree                      # node 0 = root
    tokens: np.ndarray              # [T] int64: tokens[0] = root token (seq[N-1]), then each node's token
    q: np.ndarray | None = None     # [T-1, V]: the draft distribution each node was sampled from, or None
    replacement: bool = True        # sampled siblings drawn i.i.d. (True) or without replacement

    @property
    def is_chain(self) -> bool:
        return self.tree.is_chain

    def first_chain(self) -> "Proposal":
        """The chain from the root through each node's first child: what a tree proposal becomes on a
        target whose tree passes differ from decoding (Backend.exact_trees). Proposers list the likelier
        child first (top-ranked, best-first, the most recent match), so it is their best guess; a sampled
        tree's first children are each a sample of q, so the chain rule verifies it.

        Example: parents [-1, 0, 0, 1], tokens [7, 1, 2, 3] -> parents [-1, 0, 1], tokens [7, 1, 3]."""
        nodes = [0]
        while self.tree.children[nodes[-1]]:
            nodes.append(self.tree.children[nodes[-1]][0])
        keep = np.asarray(nodes)
        return Proposal(Tree.chain(len(keep) - 1), self.tokens[keep],
                        None if self.q is None else self.q[keep[1:] - 1], self.replacement)


class Proposer:
    """Base class. `max_depth`: the deepest tree it proposes; `max_nodes`: the most nodes besides the
    root (None: the loop's limit); `capacity`: KV rows of a model it owns (None when it owns none);
    `role`: the name its forwards are counted under in DecodeStats."""

    max_depth: int = 0
    max_nodes: int | None = None
    capacity: int | None = None
    role: str = "draft"
    wants_features: bool = False    # True: the loop calls features() with the target's hidden states
    feature_source: str = "hidden"  # what features() gets: "hidden" (final post-norm) or "aux" (aux layers' inputs)
    round_keyed: bool = False       # True: a sampled output depends on where rounds start (draws from the rng,
                                    # tests keyed by round), so a batch keeps its rounds' sizes for seeds to repeat

    def begin(self, prompt: np.ndarray, prefill_chunk: int) -> None:
        """A new generation starts with `prompt` (prefill a model here)."""

    def propose(self, seq: np.ndarray, n: int, limits: Limits, params, rng, stats) -> Proposal | None:
        raise NotImplementedError

    def accepted(self, seq: np.ndarray, n: int, proposal: Proposal, verdict) -> None:
        """The verdict of the round that `propose(seq, n, ...)` started (seq is not yet extended)."""

    def features(self, hidden: np.ndarray, start: int) -> None:
        """(wants_features) The target's states [k, H] (feature_source "hidden": final, post-norm;
        "aux": the inputs of its aux layers, [k, n*H]) of the rows it is committing at positions
        start..start+k-1, in order: each prefill chunk (before `begin`; start 0 is a new generation),
        the accepted path of a round, a plain step's row. The last row is the state whose logits chose
        the newest token. `hidden` is a view of the backend's reused buffer: copy what you keep."""
