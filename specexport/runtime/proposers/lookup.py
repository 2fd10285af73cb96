"""Prompt lookup: a draft-free proposer that copies what followed an earlier occurrence of the text's
last n tokens (Saxena 2023; transformers' `prompt_lookup_num_tokens`, vLLM's and onnxruntime-genai's
n-gram, llama.cpp's `--spec-type ngram`). Runs on any build, the target alone.

Every earlier occurrence of the text's last token is a candidate; its match length L is how many of the
last tokens it matches (counted up to ngram_max; at least ngram_min). The candidate that most likely
continues wins: the highest L - log2(p + 1), p its distance from the end, so a match one token longer is
worth an occurrence twice as far back (ties: the most recent). A longer match says more about what comes
next, a nearer one too: a loop that has just begun (p small) beats an older, longer match it broke away
from, while a long copy from the prompt beats a stray recent token. Measured against "longest match
first" (benchmarks/lookup_rules.py, tokens per target pass at γ 4): +2-3% on looping outputs, the same or
better on outputs that copy their prompt. What followed the winner, up to `num_tokens` tokens, is the
proposal. An occurrence that overlaps the end (the text is looping) is continued periodically, so a loop
of any length proposes `num_tokens` tokens a round. With branches > 1 the continuations of the best
candidates are merged into a tree (a trie: equal prefixes share nodes, so siblings never repeat a token),
verified in one pass with the q-free rule.

With `costs` (the pass curve of this CPU, runtime/budget.py) a round's length is chosen, up to
`num_tokens`, where the tokens it is expected to emit per verify cost peak, from the acceptance by depth
of this generation's continuations so far: each round's whole continuation (num_tokens long, however much
of it was proposed) is judged in hindsight against the tokens the target went on to emit, so every depth
is measured, and a generation that stopped proposing starts again when its guesses would have held.

Worked example: context [5, 7, 1, 2, 9, 5, 7], num_tokens 3: the last token 7 occurred at 1 (p = 5; it
matches [5, 7]: L = 2, score 2 - log2(6) = -0.58), followed by [1, 2, 9] -> the chain root(7) -> 1 -> 2 -> 9.
"""
from __future__ import annotations

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.budget import DepthAcceptance, best_nodes
from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.tree import tree_of


class PromptLookup(Proposer):
    role = "lookup"                 # it makes no forwards of its own

    def __init__(self, num_tokens: int, *, ngram_max: int = 16, ngram_min: int = 1, branches: int = 1,
                 max_nodes: int | None = None, costs: np.ndarray | None = None):
        for name, value in (("num_tokens", num_tokens), ("ngram_min", ngram_min), ("branches", branches)):
            if not isinstance(value, int) or value < 1:
                raise SpecexportError(f"{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(ngram_max, int) or ngram_max < ngram_min:
            raise SpecexportError(f"ngram_max: expected an integer >= ngram_min ({ngram_min}), got {ngram_max!r}")
        self.max_depth, self.ngram_max, self.ngram_min, self.branches = num_tokens, ngram_max, ngram_min, branches
        self.max_nodes = max_nodes          # at most this many nodes besides the root (the graph's verify limit)
        self.costs = costs                  # c(T) / c(1) by the pass's rows T, or None: always num_tokens
        self.begin(np.zeros(0, np.int64), 0)

    def begin(self, prompt: np.ndarray, prefill_chunk: int) -> None:
        self.acceptance = DepthAcceptance(self.max_depth)
        self._pending: list[tuple[int, np.ndarray]] = []     # (position, continuation) not yet judged

    def propose(self, seq, n, limits: Limits, params, rng, stats) -> Proposal | None:
        if self.costs is not None:
            self._judge(seq, n)
        depth = min(self.max_depth, limits.max_depth)
        conts = continuations(seq[:n], depth=depth, ngram_max=self.ngram_max, ngram_min=self.ngram_min,
                              branches=self.branches)
        if not conts:
            return None
        if self.costs is not None:
            self._pending.append((n, conts[0]))
            depth = best_nodes(self.acceptance.expected(len(conts[0])), self.costs)
            if depth == 0:
                return None
            conts = [c[:depth] for c in conts]
        cap = limits.max_nodes if self.max_nodes is None else min(limits.max_nodes, self.max_nodes)
        parents, tokens = trie(int(seq[n - 1]), conts, max_nodes=cap)
        return Proposal(tree_of(parents), tokens)

    def _judge(self, seq: np.ndarray, n: int) -> None:
        """Each pending continuation against the tokens emitted since (seq[at:n]), once they decide it: its
        tokens up to the first that differs held (a chain's verdict, greedy or sampled: the target's token
        at each depth equal to the proposed one)."""
        keep = []
        for at, cont in self._pending:
            seen = seq[at:n]
            m = min(len(seen), len(cont))
            held = int(np.argmin(np.append(seen[:m] == cont[:m], False)))
            if held < m or m == len(cont):
                self.acceptance.observe(len(cont), held)
            else:
                keep.append((at, cont))
        self._pending = keep


def continuations(context: np.ndarray, *, depth: int, ngram_max: int, ngram_min: int = 1,
                  branches: int = 1) -> list[np.ndarray]:
    """Up to `branches` distinct continuations (each [<= depth]) of the context's last tokens, the
    likeliest first (module docstring: the highest L - log2(p + 1), then the most recent).

    Example: context [5, 7, 1, 2, 9, 5, 7], depth 3 -> [array([1, 2, 9])].
    """
    ends, score = _candidates(np.asarray(context), ngram_max, ngram_min)
    found: list[np.ndarray] = []
    for at in ends[np.lexsort((-ends, -score))]:                    # best score first, then most recent
        cont = _continue(context, int(at), depth)
        if len(cont) and not any(len(f) >= len(cont) and np.array_equal(f[:len(cont)], cont) for f in found):
            found.append(cont)
            if len(found) == branches:
                break
    return found


def _candidates(context: np.ndarray, ngram_max: int, ngram_min: int) -> tuple[np.ndarray, np.ndarray]:
    """(ends [C], scores [C]) of the earlier occurrences of the last token: `ends` where what followed
    each begins, the score L - log2(p + 1) with L its match length (<= ngram_max) and p = N - end.
    Vectorized over the candidates, one step per token of match length."""
    N = len(context)
    if N < 2:
        return np.zeros(0, np.int64), np.zeros(0)
    ends = np.flatnonzero(context[:N - 1] == context[N - 1]) + 1
    length, alive = np.ones(len(ends), np.int64), np.ones(len(ends), bool)
    for k in range(1, min(ngram_max, N - 1)):
        at = ends - 1 - k                                         # the candidate's k-th token back
        alive &= at >= 0
        alive[alive] = context[at[alive]] == context[N - 1 - k]
        if not alive.any():
            break
        length += alive
    keep = length >= ngram_min
    ends, length = ends[keep], length[keep]
    return ends, length - np.log2(N - ends + 1)


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
