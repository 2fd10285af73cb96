"""Suffix decoding: a draft-free proposer over suffix statistics (SuffixDecoding, Oliaro et al., NeurIPS
2025; Arctic Inference's `suffix` method for vLLM). Runs on any build, the target alone.

Two stores (runtime/suffix.py) are asked each round for the longest suffix of the text that occurred
before and what followed it:
  - the request's own text: the prompt and the output so far (scanned directly: it is short);
  - the shared cache of earlier generations (a Pipeline keeps one across its generate() calls; the
    server one per model), looked up in the request's scope only.
Each gives a candidate tree grown best-first by empirical continuation probability (counts of what
followed each occurrence), cut to a node budget of `spec_factor` x the match length (a long match is
a confident one: the paper's α·m) and, where the pass curve of this CPU is known (`costs`,
runtime/budget.py), further to the best-first prefix with the most expected tokens per verify cost: the
whole tree where a pass of many rows costs about a step (AMX), its likeliest nodes where it costs several
(AVX2). The one with the higher value (expected tokens accepted if the counts hold; per cost, with costs)
is proposed. The tree is fixed before the target runs, so the q-free rule verifies
it losslessly, greedy or sampled.

Example: the prompt holds `def add(a, b):\\n    return a + b` and the output so far ends in
`def add(a, b):`: the request's index matches those tokens and proposes `\\n    return a + b`.
"""
from __future__ import annotations

import math
import time

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.budget import best_nodes
from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.suffix import Candidates, SuffixCache, continuation_tree, scan_match
from specexport.runtime.tree import tree_of


class SuffixProposer(Proposer):
    role = "suffix"                 # it makes no forwards of its own

    def __init__(self, num_tokens: int, *, cache: SuffixCache | None = None, scope: str = "",
                 max_nodes: int | None = None, spec_factor: float = 1.0, min_prob: float = 0.1,
                 max_match: int = 32, max_occurrences: int = 256, costs: np.ndarray | None = None):
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise SpecexportError(f"num_tokens: expected an integer >= 1, got {num_tokens!r}")
        if not (isinstance(spec_factor, (int, float)) and spec_factor > 0):
            raise SpecexportError(f"spec_factor: expected a number > 0, got {spec_factor!r}")
        if not (isinstance(min_prob, (int, float)) and 0 <= min_prob < 1):
            raise SpecexportError(f"min_prob: expected a number in [0, 1), got {min_prob!r}")
        if not isinstance(scope, str):
            raise SpecexportError(f"scope: expected a string, got {scope!r}")
        self.max_depth, self.max_nodes = num_tokens, max_nodes
        self.cache, self.scope = cache, scope
        self.spec_factor, self.min_prob = float(spec_factor), float(min_prob)
        self.costs = costs              # c(T) / c(1) by the pass's rows T (runtime/budget.py), or None
        self._match_options = {"max_match": max_match, "max_occurrences": max_occurrences}
        self.reset_counters()

    def reset_counters(self) -> None:
        self.lookups = self.hits = self.from_shared = 0
        self.propose_s = 0.0

    @property
    def counters(self) -> dict:
        """What this generation's lookups did (DecodeStats.proposer)."""
        return {"lookups": self.lookups, "hits": self.hits, "hit_rate": self.hits / self.lookups if self.lookups else None,
                "from_shared": self.from_shared,
                "propose_us": 1e6 * self.propose_s / self.lookups if self.lookups else None,
                "cache_tokens": self.cache.tokens if self.cache is not None else 0}

    def begin(self, prompt: np.ndarray, prefill_chunk: int) -> None:
        self.reset_counters()

    def propose(self, seq, n, limits: Limits, params, rng, stats) -> Proposal | None:
        start = time.perf_counter()
        context = seq[:n]
        depth = min(self.max_depth, limits.max_depth)
        cap = limits.max_nodes if self.max_nodes is None else min(limits.max_nodes, self.max_nodes)
        root = int(seq[n - 1])
        best, shared = None, False
        found = scan_match(context, **self._match_options)            # the request's own text
        if found is not None:
            best = self._cut(continuation_tree(context, found.starts, root=root, max_depth=depth, max_nodes=cap,
                                               min_prob=self.min_prob), found.length, cap)
        if self.cache is not None:
            found, tree = self.cache.candidates(context, scope=self.scope, root=root, max_depth=depth, max_nodes=cap,
                                                min_prob=self.min_prob)
            if tree is not None:
                tree = self._cut(tree, found.length, cap)
                if best is None or self._value(tree) > self._value(best):
                    best, shared = tree, True
        self.lookups += 1
        proposal = None
        if best is not None and len(best.tokens) > 1:
            self.hits += 1
            self.from_shared += shared
            proposal = Proposal(tree_of(best.parents), best.tokens)
        self.propose_s += time.perf_counter() - start
        stats.proposer = self.counters
        return proposal

    def _cut(self, tree: Candidates, match_length: int, cap: int) -> Candidates:
        """The tree's first `spec_factor` x match-length nodes (it lists them best-first, parents first,
        so a prefix is the best-first tree of that budget)."""
        keep = 1 + max(1, min(cap, math.floor(self.spec_factor * match_length)))
        if self.costs is not None:      # then the prefix with the most expected tokens per cost (0: none)
            keep = 1 + best_nodes(1 + np.cumsum(np.r_[0.0, tree.probs[1:keep]]), self.costs)
        return Candidates(tree.parents[:keep], tree.tokens[:keep], tree.probs[:keep])

    def _value(self, tree: Candidates) -> float:
        """Expected tokens accepted (per verify cost, where the costs are known)."""
        if self.costs is None:
            return tree.score
        return (1 + tree.score) / self.costs[min(len(tree.tokens), len(self.costs) - 1)]
