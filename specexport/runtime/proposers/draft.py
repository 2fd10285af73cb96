"""The draft-model chain: a small model of the same vocabulary proposes γ tokens, one forward each.

State: the draft's KV holds a prefix of seq. Each round it catches up on seq[draft.length:N] in its
first call (the root, and after a fully accepted round also the last proposal it never saw), then
feeds back its own proposals. After the verdict it rolls back to N + min(n_accepted, γ - 1): the rows
of rejected proposals are forgotten, and the last proposal's row was never written.

Greedy: x_i = argmax. Sampling: x_i ~ q_i = warp(draft logits) and q is returned with the proposal,
so the verifier applies the chain rejection rule with the q that produced the tokens.
draft_stop > 0 ends a round's drafting once the draft gives its own proposal a probability below it
(the target is not consulted: the output distribution is unchanged).
"""
from __future__ import annotations

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.sampling import sample, warp
from specexport.runtime.tree import Tree


class DraftChain(Proposer):
    round_keyed = True              # samples from the rng; the chain rule's tests are keyed by round
    def __init__(self, draft, gamma: int, *, draft_stop: float = 0.0):
        self.check_stop(draft_stop)
        self.draft, self.max_depth, self.draft_stop = draft, gamma, draft_stop
        self.capacity = draft.capacity

    @staticmethod
    def check_stop(draft_stop) -> None:
        if not 0.0 <= draft_stop < 1.0:
            raise SpecexportError(f"draft_stop: expected a probability in [0, 1), got {draft_stop!r}")

    def begin(self, prompt: np.ndarray, prefill_chunk: int) -> None:
        from specexport.runtime.backends.base import prefill

        self.draft.reset()
        prefill(self.draft, prompt, prefill_chunk)

    def propose(self, seq, n, limits: Limits, params, rng, stats) -> Proposal:
        g = min(self.max_depth, limits.max_depth, limits.max_nodes)
        draft = self.draft
        proposal = np.empty(g, dtype=np.int64)                                  # [γ]
        q = None if params.greedy else np.empty((g, draft.vocab_size))          # [γ, V]
        feed = seq[draft.length:n]
        for i in range(g):
            out = draft.forward(feed)
            draft.commit(len(feed))
            stats.count_forward(self.role, len(feed))
            logits = out.logits[-1]
            if params.greedy:
                proposal[i] = x = int(logits.argmax())
                confident = not self.draft_stop or _top_probability(logits, x) >= self.draft_stop
            else:
                q[i] = warp(logits, params)
                proposal[i] = x = sample(q[i], rng.random())
                confident = q[i][x] >= self.draft_stop
            feed = proposal[i:i + 1]
            if not confident and i + 1 < g:
                g = i + 1
                proposal, q = proposal[:g], None if q is None else q[:g]
                break
        stats.draft_passes += g
        return Proposal(Tree.chain(g), np.concatenate([seq[n - 1:n], proposal]), q)

    def accepted(self, seq, n, proposal: Proposal, verdict) -> None:
        g = proposal.tree.size - 1
        self.draft.rollback(n + min(verdict.n_accepted, g - 1))


def _top_probability(logits: np.ndarray, top: int) -> float:
    """softmax(logits)[top] where `top` is the argmax."""
    return 1.0 / float(np.exp(logits - logits[top], dtype=np.float64).sum())
