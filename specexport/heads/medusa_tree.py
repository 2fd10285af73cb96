"""`tree: auto` for Medusa: a sparse tree made from the heads' measured accuracy and the target's
measured verify cost, the way Medusa makes its sparse trees (Cai et al. 2024, section 3.3.1).

1. Accuracy: on the target's greedy continuations of the held-out sequences' first PREFIX tokens
   (what greedy decoding feeds the heads; sampled text is noisier than that), teacher-forced, acc[k, r] = the share of positions i where the
   target's argmax at position i + 1 + k (the token k + 2 places after i) is head k's rank-r token at i.
2. Tree: with independent heads, the node with rank path (r_1, ..., r_d) is accepted with probability
   prod_j acc[j - 1, r_j]; adding nodes greedily by that probability (a child never beats its parent,
   so every prefix of the order is a tree) gives, for each size n, the tree of n nodes with the most
   expected tokens per pass E(n) = 1 + sum of the n nodes' probabilities.
3. Size: the n that maximises E(n) / (c(n + 1) + c_heads) * c(1), the predicted speedup over vanilla,
   with c(T) the target's measured cost of a T-token pass at a context of 64 tokens.
"""
from __future__ import annotations

import heapq
import statistics
import time

import numpy as np

from specexport.io_spec import HEAD_TOPK_IDS, HIDDEN_STATES, LOGITS

CONTEXT = 64            # committed tokens when timing the verify pass
REPS = 15
PREFIX = 16             # accuracy is measured on the target's greedy continuations of prefixes this long


def head_accuracy(target_session, target_io, heads_session, *, sequences, top_k: int, start: int = 0) -> np.ndarray:
    """acc [N, K] over the positions i >= start of `sequences` (token arrays) where the truth exists
    (start = PREFIX - 1: from the last prefix token on, the part the target continued itself)."""
    from specexport.heads.medusa import target_states

    hits, total = None, None
    for seq in sequences:
        hidden, logits = target_states(target_session, target_io, seq, outputs=(HIDDEN_STATES,
                                                                                LOGITS))  # [S, H], [S, V]
        argmax = logits.argmax(-1)                                                             # [S]
        ids = heads_session.run([HEAD_TOPK_IDS], {HIDDEN_STATES: hidden[None]})[0][0]          # [S, N, K]
        S, N, K = ids.shape
        if hits is None:
            hits, total = np.zeros((N, K)), np.zeros(N)
        for k in range(N):
            rows = np.arange(start, S - 1 - k)
            if len(rows) == 0:
                continue
            truth = argmax[rows + 1 + k]                                                        # [R]
            hits[k] += (ids[rows, k] == truth[:, None]).sum(0)
            total[k] += len(rows)
    return hits / np.maximum(total, 1)[:, None]


def greedy_continuation(backend, prefix, length: int) -> np.ndarray:
    """[length] the prefix and the target's greedy continuation of it (vanilla decoding on `backend`)."""
    from specexport.runtime.loop import DecodeStats, decode
    from specexport.runtime.sampling import SamplingParams

    chunks = decode(backend, None, np.asarray(prefix), max_new_tokens=length - len(prefix),
                    params=SamplingParams(0.0), rng=np.random.default_rng(0), stats=DecodeStats())
    return np.concatenate([np.asarray(prefix), *chunks])


def greedy_tree(acc: np.ndarray, max_nodes: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """Rank paths in the order of their acceptance probability (each a valid tree prefix), and
    those probabilities. Example: acc [[0.6, 0.2], [0.5, 0.1]], 3 nodes -> [(0,), (0, 0), (1,)],
    [0.6, 0.3, 0.2]."""
    N, K = acc.shape
    frontier = [(-float(acc[0, r]), (r,)) for r in range(K)]
    heapq.heapify(frontier)
    paths, probs = [], []
    while frontier and len(paths) < max_nodes:
        neg, path = heapq.heappop(frontier)
        paths.append(path)
        probs.append(-neg)
        if len(path) < N:
            for r in range(K):
                heapq.heappush(frontier, (neg * float(acc[len(path), r]), path + (r,)))
    return paths, probs


def choose_tree(acc: np.ndarray, costs: dict[int, float], heads_cost: float, *, max_nodes: int) -> dict:
    """The tree size with the best predicted speedup; costs {T: seconds} for T = 1..max_nodes + 1."""
    paths, probs = greedy_tree(acc, max_nodes)
    c1 = costs[1]
    predicted = {n: (1 + sum(probs[:n])) * c1 / (costs[n + 1] + heads_cost) for n in range(1, len(paths) + 1)}
    best = max(predicted, key=predicted.get)
    return {"paths": [list(p) for p in paths[:best]], "nodes": best, "expected_tokens": 1 + sum(probs[:best]),
            "predicted_speedup": predicted[best], "predicted_by_nodes": {str(n): s for n, s in predicted.items()}}


def verify_costs(backend, sizes, *, context: int = CONTEXT, reps: int = REPS,
                 clock=time.perf_counter) -> dict[int, float]:
    """Median seconds of a T-token target pass for each T in `sizes`, at `context` committed tokens
    (fewer when the capacity is small), sizes interleaved so drift hits all alike. The scratch rows
    are simply overwritten by the next pass."""
    from specexport.runtime.loop import prefill

    ctx = (3 + np.arange(max(1, min(context, backend.capacity - max(sizes))))) % backend.vocab_size
    backend.reset()
    prefill(backend, ctx, backend.max_tokens)
    times = {t: [] for t in sizes}
    for _ in range(reps):
        for t in times:
            tokens = np.resize(ctx, t)
            start = clock()
            backend.forward(tokens)
            times[t].append(clock() - start)
    return {t: statistics.median(v) for t, v in times.items()}


def heads_cost(heads, hidden_size: int, *, clock=time.perf_counter) -> float:
    x = np.zeros(hidden_size, np.float32)
    heads(x)
    times = []
    for _ in range(REPS):
        start = clock()
        heads(x)
        times.append(clock() - start)
    return statistics.median(times)
