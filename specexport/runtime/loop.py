"""The decode loop: prefill, then rounds of draft -> verify -> commit. Knows only the Backend interface.

`decode` is a generator of emitted-token chunks; the caller decides when to stop early (EOS, stop
strings) by closing it. It never writes past the KV buffers: it stops when prompt + emitted tokens
reach `capacity`, and shortens the last rounds' proposals so they fit.

Invariant at the start of each round, with N tokens so far (prompt + emitted):
    target.length == N - 1            the last token (the root) is not yet in the target's cache
    draft.length  <= N - 1            the draft catches up on seq[draft.length:N] in its first call
One round with γ proposals (chain):
    draft:   feed seq[draft.length:N] -> q_1, x_1; feed x_1 -> q_2, x_2; ... x_γ   (γ calls)
             with draft_stop > 0 the round proposes fewer: drafting stops after the first x_i the
             draft itself gives probability < draft_stop (its own confidence; the target is not
             consulted, so the output distribution is unchanged, greedy or sampled)
    target:  feed [root, x_1..x_γ] at positions N-1..N-1+γ -> p_0..p_γ            (1 call)
    verdict: n accepted + 1 bonus/recovered token; target commits root + n accepted rows,
             the draft rolls back to N + min(n, γ - 1) (it never saw x_γ).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.accept import accept_chain, accept_greedy
from specexport.runtime.backends.base import Backend
from specexport.runtime.sampling import SamplingParams, sample, warp
from specexport.runtime.tree import Tree


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


def decode(target: Backend, draft: Backend | None, prompt: np.ndarray, *, max_new_tokens: int,
           params: SamplingParams, gamma: int, rng: np.random.Generator, stats: DecodeStats,
           prefill_chunk: int = 64, draft_stop: float = 0.0, clock=time.perf_counter):
    """Yield chunks of emitted tokens ([k] int64 arrays). draft None or gamma 0 = vanilla decoding.
    draft_stop: end a round's drafting early once the draft's probability of its proposal is below it.
    clock: seconds, for the stats (the bench injects one in its tests)."""
    if not 0.0 <= draft_stop < 1.0:
        raise SpecexportError(f"draft_stop: expected a probability in [0, 1), got {draft_stop!r}")
    start = clock()
    capacity = target.capacity if draft is None else min(target.capacity, draft.capacity)
    if not 1 <= len(prompt) < capacity:
        raise SpecexportError(f"prompt: {len(prompt)} tokens; expected 1..{capacity - 1} (max_seq_len {capacity} "
                              f"holds the prompt and at least one generated token)")
    if max_new_tokens < 1:
        raise SpecexportError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    seq = np.zeros(capacity, dtype=np.int64)                   # prompt + emitted; fixed size
    n = len(prompt)
    seq[:n] = prompt
    gamma = min(gamma, target.max_tokens - 1) if draft is not None else 0     # verify takes γ+1 tokens
    stats.gamma, stats.prompt_tokens = gamma, n
    stats.proposed_at, stats.accepted_at = np.zeros(gamma, np.int64), np.zeros(gamma, np.int64)
    target.reset()
    logits = _prefill(target, prompt, prefill_chunk)
    stats.prefill_s = clock() - start
    if draft is not None and gamma > 0:
        draft.reset()
        _prefill(draft, prompt, prefill_chunk)
        stats.draft_prefill_s = clock() - start - stats.prefill_s
    seq[n] = _choose(logits, params, rng)
    n += 1
    stats.emitted = stats.delivered = 1
    stats.ttft_s = stats.total_s = clock() - start
    yield seq[n - 1:n].copy()
    while stats.emitted < max_new_tokens and n < capacity:
        g = min(gamma, capacity - n - 1, max_new_tokens - stats.emitted - 1)
        if g <= 0:
            out = target.forward(seq[n - 1:n])
            target.commit(1)
            new = np.array([_choose(out.logits[0], params, rng)])
            stats.count_forward("target", 1)
            stats.rounds.append((0, 0))
        else:
            new = _speculate(target, draft, seq, n, g, params, rng, stats, draft_stop)
        stats.target_passes += 1
        seq[n:n + len(new)] = new
        n += len(new)
        stats.emitted += len(new)
        stats.delivered = stats.emitted
        stats.total_s = clock() - start
        yield new


def _speculate(target, draft, seq, n, g, params, rng, stats, draft_stop=0.0) -> np.ndarray:
    proposal = np.empty(g, dtype=np.int64)                     # [γ]
    q = None if params.greedy else np.empty((g, target.vocab_size))   # [γ, V]
    feed = seq[draft.length:n]
    for i in range(g):
        out = draft.forward(feed)
        draft.commit(len(feed))
        stats.count_forward("draft", len(feed))
        logits = out.logits[-1]
        if params.greedy:
            proposal[i] = x = int(logits.argmax())
            confident = not draft_stop or _top_probability(logits, x) >= draft_stop
        else:
            q[i] = warp(logits, params)
            proposal[i] = x = sample(q[i], rng.random())
            confident = q[i][x] >= draft_stop
        feed = proposal[i:i + 1]
        if not confident and i + 1 < g:
            g = i + 1
            proposal, q = proposal[:g], None if q is None else q[:g]
            break
    stats.draft_passes += g
    verify = np.concatenate([seq[n - 1:n], proposal])            # [γ+1] root, x_1..x_γ
    out = target.forward(verify)
    stats.count_forward("target", g + 1)
    if params.greedy:
        verdict = accept_greedy(Tree.chain(g), verify, out.logits[:g + 1].argmax(-1))
    else:
        verdict = accept_chain(proposal, q, warp(out.logits[:g + 1], params), rng.random(g + 1))
    k = verdict.n_accepted
    target.commit(k + 1)
    draft.rollback(n + min(k, g - 1))
    stats.proposed += g
    stats.accepted += k
    stats.proposed_at[:g] += 1
    stats.accepted_at[:k] += 1
    stats.rounds.append((g, k))
    return verdict.tokens


def _top_probability(logits: np.ndarray, top: int) -> float:
    """softmax(logits)[top] where `top` is the argmax."""
    return 1.0 / float(np.exp(logits - logits[top], dtype=np.float64).sum())


def _prefill(backend: Backend, prompt: np.ndarray, chunk: int) -> np.ndarray:
    """Run the prompt in chunks and commit it; returns the last position's logits [V] (a copy)."""
    chunk = min(chunk, backend.max_tokens)
    for s in range(0, len(prompt), chunk):
        part = prompt[s:s + chunk]
        out = backend.forward(part, phase="prefill")
        backend.commit(len(part))
    return np.array(out.logits[-1])


def _choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    return sample(warp(logits, params), rng.random())
