"""Proposers: what the decode loop asks for a token tree each round (STYLE.md: the loop knows only
Proposer, Backend and the verifier).

A round, as the loop drives it (N tokens so far, the last one, the root, not yet in the target's cache):

    proposal = proposer.propose(seq, N, limits, params, rng, stats)   # None: nothing to propose, plain step
    target.forward(proposal.tokens, depths, tree_mask)                 # one pass over the whole tree
    verdict = accept_*(...)                                            # greedy / chain / q-free tree rule
    target.commit(verdict.path)                                        # compacts only the accepted rows
    proposer.accepted(seq, N, proposal, verdict)                       # the proposer updates its own state

`Proposal.tokens[0]` is the root (seq[N-1]); `tree` gives the other nodes' parents. `q` is present when
the children were *sampled* from a draft distribution (q[i - 1] is the distribution node i was drawn
from); without it the children were chosen deterministically (top-k, n-gram matches, argmax), and the
q-free rule verifies them losslessly whatever chose them. A proposer that owns a model owns its
backend and its KV bookkeeping; the target's KV is the loop's.
"""
from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.proposers.draft import DraftChain
from specexport.runtime.proposers.draft_tree import DraftTree
from specexport.runtime.proposers.eagle import DynamicTree, EagleTree
from specexport.runtime.proposers.lookup import PromptLookup
from specexport.runtime.proposers.medusa import MedusaTree
from specexport.runtime.proposers.suffix import SuffixProposer

__all__ = ["DraftChain", "DraftTree", "DynamicTree", "EagleTree", "Limits", "MedusaTree", "PromptLookup", "Proposal",
           "Proposer", "SuffixProposer"]
