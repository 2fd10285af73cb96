"""The decode loop: prefill, then rounds of propose -> verify -> commit. Knows only the Backend and
Proposer interfaces (runtime/proposers) and the verifiers (accept.py).

`decode` is a generator of emitted-token chunks; the caller decides when to stop early (EOS, stop
strings) by closing it. It never writes past the KV buffers: it stops when prompt + emitted tokens
reach `capacity`, and limits the last rounds' trees (depth and node count) so they fit.

Invariant at the start of each round, with N tokens so far (prompt + emitted):
    target.length == N - 1            the last token (the root) is not yet in the target's cache
One round:
    proposer: a tree of T nodes, node 0 the root seq[N-1] (a chain of γ for a draft model, a trie of
              n-gram continuations for prompt lookup, a static tree of heads' top-k for Medusa); None
              when it has nothing: a plain target step. A proposer with `wants_features` is handed the
              target's final hidden states of every row the target commits (prefill chunks included)
    target:   feed the T tokens at positions N-1 + depth with the tree's ancestor mask -> p per node
    verdict:  greedy (longest matching path), the chain rejection rule (a chain sampled from q), the
              multi-draft rule (a tree of children sampled from q), or the q-free tree rule (children
              chosen deterministically); the target commits the root and
              the accepted path's rows, compacted; the proposer is told the verdict.
Per-depth statistics: proposed_at[d] counts rounds whose tree reached depth d + 1, accepted_at[d]
rounds that accepted d + 1 tokens or more (for a chain: proposal positions).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.accept import accept_chain, accept_greedy, accept_tree, accept_tree_sampled
from specexport.runtime.backends.base import Backend, prefill  # noqa: F401  (prefill: loop.prefill for callers)
from specexport.runtime.proposers.base import Limits
from specexport.runtime.sampling import Coins, SamplingParams, sample, warp


@dataclass
class DecodeStats:
    """What one generation did and how long it took. Times come from the loop's clock.

    Accounting (what `specexport bench` reads):
      ttft_s     prompt in -> first token out: the target's prefill, the draft's prefill, the first choice
      decode_s   first token -> the chunk holding the last delivered token (total_s - ttft_s)
      delivered  tokens handed to the user: the emitted ones, cut after EOS or a stop string by the caller
      tokens_per_second, tpot_s   on decode time and delivered tokens: (delivered - 1) / decode_s
      rounds     one (proposals, accepted) pair per decode-time target pass; (0, 0) is a plain step
      forwards   decode-time forwards by (role, T); prefill forwards are not in it
    """
    gamma: int = 0
    prompt_tokens: int = 0
    emitted: int = 0                        # tokens the loop emitted, the first (from prefill) included
    delivered: int = 0                      # tokens the caller kept (see above); the loop sets it to emitted
    target_passes: int = 0                  # decode-time target calls (prefill excluded)
    draft_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # [γ] per position
    accepted_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # [γ]
    rounds: list = field(default_factory=list)          # [(proposals, accepted)] per target pass
    forwards: dict = field(default_factory=dict)        # {(role, T): calls} at decode time
    proposer: dict = field(default_factory=dict)        # what the proposer reports (suffix: lookups, hits, µs)
    prefill_s: float = 0.0                  # the target's prefill
    draft_prefill_s: float = 0.0            # the draft's prefill
    ttft_s: float = 0.0                     # both prefills + the first token
    total_s: float = 0.0                    # until the last emitted chunk

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (nan when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per decode-time target pass, bonus included."""
        return (self.emitted - 1) / self.target_passes if self.target_passes else float("nan")

    @property
    def acceptance_per_position(self) -> np.ndarray:
        """[γ] P(proposal i accepted | it was proposed)."""
        return self.accepted_at / np.maximum(self.proposed_at, 1)

    @property
    def decode_s(self) -> float:
        return self.total_s - self.ttft_s

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: delivered tokens after the first, per second of decode time."""
        return (self.delivered - 1) / self.decode_s if self.delivered > 1 and self.decode_s > 0 else float("nan")

    @property
    def tpot_s(self) -> float:
        """Mean time per delivered output token after the first."""
        return self.decode_s / (self.delivered - 1) if self.delivered > 1 else float("nan")

    def count_forward(self, role: str, tokens: int) -> None:
        key = (role, tokens)
        self.forwards[key] = self.forwards.get(key, 0) + 1


def decode(target: Backend, proposer, prompt: np.ndarray, *, max_new_tokens: int, params: SamplingParams,
           rng: np.random.Generator, stats: DecodeStats, prefill_chunk: int = 64, clock=time.perf_counter,
           coins: Coins | None = None):
    """Yield chunks of emitted tokens ([k] int64 arrays).

    proposer: a Proposer (runtime/proposers; a draft model runs as DraftChain(draft, gamma)); None is
    vanilla decoding. rng: the proposers' own randomness (a draft model's samples). coins: the
    verification's, keyed by position (sampling.Coins; default: seeded from rng), so a deterministic
    proposer emits vanilla's text for the same coins. clock: seconds, for the stats (the bench
    injects one in its tests)."""
    start = clock()
    capacity = min(target.capacity, proposer.capacity or target.capacity) if proposer else target.capacity
    if not 1 <= len(prompt) < capacity:
        raise SpecexportError(f"prompt: {len(prompt)} tokens; expected 1..{capacity - 1} (max_seq_len {capacity} "
                              f"holds the prompt and at least one generated token)")
    if max_new_tokens < 1:
        raise SpecexportError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    seq = np.zeros(capacity, dtype=np.int64)                   # prompt + emitted; fixed size
    n = len(prompt)
    seq[:n] = prompt
    depth = min(proposer.max_depth, target.max_tokens - 1) if proposer else 0   # verify takes depth + 1 rows
    stats.gamma, stats.prompt_tokens = depth, n
    stats.proposed_at, stats.accepted_at = np.zeros(depth, np.int64), np.zeros(depth, np.int64)
    target.reset()
    coins = Coins.from_rng(rng) if coins is None else coins
    features = _feature_sink(proposer) if depth and proposer.wants_features else None
    logits = prefill(target, prompt, prefill_chunk, features=features)
    stats.prefill_s = clock() - start
    if depth:
        proposer.begin(prompt, prefill_chunk)
        stats.draft_prefill_s = clock() - start - stats.prefill_s
    seq[n] = _choose(logits, params, coins, n)
    n += 1
    stats.emitted = stats.delivered = 1
    stats.ttft_s = stats.total_s = clock() - start
    yield seq[n - 1:n].copy()
    while stats.emitted < max_new_tokens and n < capacity:
        proposal = None
        # a batch's slot: its share of the pass (kept at batch-1's where a seeded output depends on the rounds)
        rows = target.max_tokens if depth and proposer.round_keyed and not params.greedy else target.round_rows
        room = min(depth, rows - 1, capacity - n - 1, max_new_tokens - stats.emitted - 1)
        if room > 0:                                # vanilla (depth 0) never builds limits or asks anyone
            limits = Limits(max_depth=room, max_nodes=min(rows - 1, capacity - n,
                                                          proposer.max_nodes or capacity))
            proposal = proposer.propose(seq, n, limits, params, rng, stats)
        if proposal is not None and not target.exact_trees and not proposal.is_chain:
            proposal = proposal.first_chain()       # this graph's sibling rows differ from decoding
        if proposal is None or proposal.tree.size < 2:
            out = target.forward(seq[n - 1:n])
            target.commit(1)
            new = np.array([_choose(out.logits[0], params, coins, n)])
            if features is not None:
                features(out, slice(0, 1), target.length - 1)
            stats.count_forward("target", 1)
            stats.rounds.append((0, 0))
        else:
            new = _verify(target, proposer, proposal, seq, n, params, coins, stats, features)
        stats.target_passes += 1
        seq[n:n + len(new)] = new
        n += len(new)
        stats.emitted += len(new)
        stats.delivered = stats.emitted
        stats.total_s = clock() - start
        yield new


def _verify(target, proposer, proposal, seq, n, params, coins, stats, features) -> np.ndarray:
    """One target pass over the proposed tree, the verdict, the commit of the accepted path. A token
    emitted at depth d lands at position n + d and is drawn with that position's coin (draws[d]);
    acceptance tests take TEST coins keyed by this round's first position (never reused: n grows)."""
    tree, tokens = proposal.tree, proposal.tokens
    T = tree.size
    chain = proposal.is_chain
    out = target.forward(tokens, depths=None if chain else tree.depths, tree_mask=None if chain else tree.mask)
    stats.count_forward("target", T)
    draws = None if params.greedy else coins.span(n, T, Coins.DRAW)                   # sampling only
    if params.greedy:
        verdict = accept_greedy(tree, tokens, out.logits[:T].argmax(-1))
    elif proposal.q is not None:                # sampled from the draft: a rejection rule, its tests' coins
        tests = coins.span(n * _TESTS_PER_ROUND, 2 * T, Coins.TEST)
        if chain:                               # the chain rejection rule
            verdict = accept_chain(tokens[1:], proposal.q, warp(out.logits[:T], params), uniforms=tests[:T],
                                   draws=draws)
        else:                                   # a tree of sampled children: the multi-draft rule
            verdict = accept_tree_sampled(tree, tokens, warp(out.logits[:T], params), draft_probs=proposal.q,
                                          uniforms=tests,
                                          replacement=proposal.replacement, draws=draws)
    else:                                       # children chosen deterministically: the q-free rule
        verdict = accept_tree(tree, tokens, warp(out.logits[:T], params), uniforms=draws)
    k = verdict.n_accepted
    if features is not None:                    # before the commit moves rows (hidden is per forward row)
        features(out, verdict.path, target.length)
    target.commit(k + 1 if chain else verdict.path)     # only the accepted rows, compacted
    proposer.accepted(seq, n, proposal, verdict)
    stats.proposed += T - 1
    stats.accepted += k
    stats.proposed_at[:int(tree.depths.max())] += 1
    stats.accepted_at[:k] += 1
    stats.rounds.append((T - 1, k))
    return verdict.tokens


def _feature_sink(proposer):
    """features(out, rows, start): hand the proposer the target states it reads (proposer.feature_source)
    of the given rows of a forward, which the target commits at positions start, start + 1, ..."""
    aux = proposer.feature_source == "aux"

    def sink(out, rows, start: int) -> None:
        states = out.aux if aux else out.hidden
        if states is None:
            raise SpecexportError("the target graph exports no aux_hidden_states, which this proposer reads "
                                  "(rebuild it with the head in the model.yaml)")
        proposer.features(states[rows], start)

    return sink


_TESTS_PER_ROUND = 1 << 16      # TEST coin counters: round start n * this + the test's index (< 2T)


def _choose(logits: np.ndarray, params: SamplingParams, coins: Coins, position: int) -> int:
    """The token at `position` from the target's logits: vanilla decoding's draw (and a plain step's)."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(warp(logits, params), coins.one(position, Coins.DRAW))
