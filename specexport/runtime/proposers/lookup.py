"""Prompt lookup: a draft-free proposer that copies what followed an earlier occurrence of the text's
last n tokens (Saxena 2023; transformers' `prompt_lookup_num_tokens`, vLLM's and onnxruntime-genai's
n-gram, llama.cpp's `--spec-type ngram`). Runs on any build, the target alone.

The last n tokens (n from ngram_max down to ngram_min: the longest that matches wins) are searched for
in the prompt and the output so far, the most recent occurrence first; what followed it, up to
`num_tokens` tokens, is the proposal. An occurrence that overlaps the end (the text is looping) is
continued periodically, so a loop of any length proposes `num_tokens` tokens a round. With branches > 1 the continuations of several occurrences are
merged into a tree (a trie: equal prefixes share nodes, so siblings never repeat a token), verified in
one pass with the q-free rule.

Worked example: context [5, 7, 1, 2, 9, 5, 7], ngram_max 2, num_tokens 3: the last 2 tokens [5, 7]
occurred at 0, followed by [1, 2, 9] -> the chain root(7) -> 1 -> 2 -> 9.
"""
from __future__ import annotations

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.tree import Tree


class PromptLookup(Proposer):
    role = "lookup"                 # it makes no forwards of its own

    def __init__(self, num_tokens: int, *, ngram_max: int = 3, ngram_min: int = 1, branches: int = 1,
                 max_nodes: int | None = None):
        for name, value in (("num_tokens", num_tokens), ("ngram_min", ngram_min), ("branches", branches)):
            if not isinstance(value, int) or value < 1:
                raise SpecexportError(f"{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(ngram_max, int) or ngram_max < ngram_min:
            raise SpecexportError(f"ngram_max: expected an integer >= ngram_min ({ngram_min}), got {ngram_max!r}")
        self.max_depth, self.ngram_max, self.ngram_min, self.branches = num_tokens, ngram_max, ngram_min, branches
        self.max_nodes = max_nodes          # at most this many nodes besides the root (the graph's verify limit)

    def propose(self, seq, n, limits: Limits, params, rng, stats) -> Proposal | None:
        depth = min(self.max_depth, limits.max_depth)
        conts = continuations(seq[:n], depth=depth, ngram_max=self.ngram_max, ngram_min=self.ngram_min,
                              branches=self.branches)
        if not conts:
            return None
        cap = limits.max_nodes if self.max_nodes is None else min(limits.max_nodes, self.max_nodes)
        parents, tokens = trie(int(seq[n - 1]), conts, max_nodes=cap)
        return Proposal(Tree(parents), tokens)


def continuations(context: np.ndarray, *, depth: int, ngram_max: int, ngram_min: int = 1,
                  branches: int = 1) -> list[np.ndarray]:
    """Up to `branches` distinct continuations (each [<= depth]) of the context's last n tokens.

    Longest n first; within one n, the most recent occurrence first. Example: context
    [5, 7, 1, 2, 9, 5, 7], depth 3, ngram_max 2 -> [array([1, 2, 9])].
    """
    N = len(context)
    found: list[np.ndarray] = []
    for n in range(min(ngram_max, N - 1), ngram_min - 1, -1):
        key = context[N - n:]
        windows = np.lib.stride_tricks.sliding_window_view(context[:N - 1], n)     # [N - n, n] starts 0..N-1-n
        for start in np.flatnonzero((windows == key).all(axis=1))[::-1]:            # most recent first
            cont = _continue(context, start + n, depth)
            if len(cont) and not any(len(f) >= len(cont) and np.array_equal(f[:len(cont)], cont) for f in found):
                found.append(cont)
                if len(found) == branches:
                    return found
        if found:
            return found
    return found


def _continue(context: np.ndarray, at: int, depth: int) -> np.ndarray:
    """What followed an occurrence, from `at`, `depth` tokens: context[at:at + depth], continued past
    the end by copying what the continuation itself just produced. The occurrence found at distance p
    = N - at before the end says the text repeats with period p, so the proposal repeats it too (with
    only the text that exists, a loop of k tokens would propose k - n tokens a round, not γ).

    Example: context [1, 2, 3, 1, 2], the last 2 tokens occurred at 0, at = 2, depth 4 -> p = 3:
    [3, 1, 2, 3] (context alone gives only [3, 1, 2]).
    """
    period = len(context) - at
    return context[at + np.arange(depth) % period]


def trie(root: int, conts: list[np.ndarray], *, max_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(parents [T], tokens [T]) of the prefix tree of `conts` under `root`, at most max_nodes + 1
    nodes, parents before children, children in the order the continuations came.

    Example: root 7, conts [[1, 2], [1, 4], [3]] -> parents [-1, 0, 1, 1, 0], tokens [7, 1, 2, 4, 3].
    """
    parents, tokens, children = [-1], [root], [{}]
    for cont in conts:
        node = 0
        for tok in cont.tolist():
            if tok not in children[node]:
                if len(tokens) > max_nodes:
                    break
                children[node][tok] = len(tokens)
                parents.append(node)
                tokens.append(tok)
                children.append({})
            node = children[node][tok]
    return np.asarray(parents, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
