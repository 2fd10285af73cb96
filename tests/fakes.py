"""Numpy fakes and statistics helpers for the speculative-decoding tests (no torch, no ONNX).

`TabularBackend` is a toy LM whose next-token logits depend only on the last two tokens of the
context: `table[prev2, prev1]` -> logits [V]. Missing previous tokens (position 0 and 1 of the
sequence) read as token BOS = 0. Because the model is a lookup table, the exact probability of
every k-token continuation is computable (`exact_continuation_probs`), which is what the
sequence-level G-tests compare the decode loop against.

    table [V, V, V] (prev2, prev1, next) log-probs, float64; the backend serves them as float32
    history [capacity]   the "KV cache": the token at each committed position
    hidden  [T, 2]       each row's (previous token, token), the state its logits come from, as floats
                         (what heads-based proposers such as Medusa read)

`goodness_of_fit` is the one G-test both statistics files use (cells with small expected counts are
pooled, so sparse tables stay valid; an observed impossible outcome is an immediate failure).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from specexport.runtime.backends.base import Backend, StepOutput
from specexport.runtime.backends.eagle import HeadStep
from specexport.runtime.sampling import SamplingParams, warp

BOS = 0


# ------------------------------------------------------------------------------------------------
# The tabular backend
# ------------------------------------------------------------------------------------------------
class TabularBackend(Backend):
    """A second-order Markov "LM" behind the Backend interface, with a real (token) KV history.

    Each forward row's context is the committed history [0, length) plus that row's ancestors among
    the new tokens (tree_mask; default causal). The fake checks what a real attention kernel would
    silently get wrong: the mask must be a tree's ancestor-or-self mask (lower triangular, unit
    diagonal, closed under ancestry) and `depths` must equal each row's number of ancestors.
    Logits come back in one reused [max_tokens, V] buffer, as an engine's output binding would.
    """

    def __init__(self, table: np.ndarray, *, capacity: int, max_tokens: int):
        table = np.asarray(table)
        V = table.shape[-1]
        if table.shape != (V, V, V):
            raise ValueError(f"table: expected shape [V, V, V], got {table.shape}")
        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=V)
        self.table = table.astype(np.float32)                       # [V, V, V] served logits
        self.history = np.full(capacity, -1, dtype=np.int64)        # [capacity] token per KV row
        self._out = np.empty((max_tokens, V), dtype=np.float32)     # [max_tokens, V] reused
        self._hidden = np.empty((max_tokens, 2), dtype=np.float32)  # [max_tokens, 2] "hidden": (prev2, token)
        self.forward_calls = 0
        self.forward_tokens = 0

    def _forward(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        T, L = len(tokens), self.length
        if T == 1 and tree_mask is None:                             # draft and vanilla steps: Python scalars
            return self._forward_one(int(tokens[0]), depths, L)
        # [T] each row's parent among the new tokens (clipped to 0), whether it has one, its depth (as bytes)
        src, has, expected_depths, depth_bytes, root_only = _chain_rows(T) if tree_mask is None else \
            _check_tree_mask(np.asarray(tree_mask, dtype=bool))
        if depths is not None:
            depths = np.asarray(depths)
            assert (depths.tobytes() == depth_bytes if depths.dtype == np.int64 else
                    np.array_equal(depths, expected_depths)), \
                f"depths {depths.tolist()} != {expected_depths.tolist()}"
        ids = tokens.tolist()
        if not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise AssertionError(f"token ids out of range: {ids}")
        self.history[L:L + T] = tokens
        before = self.history[L - 1] if L > 0 else BOS             # last committed token
        prev2 = tokens[src]                                         # [T]
        if root_only:                                               # row 0 alone has no parent (a tree, a chain)
            prev2[0] = before
        else:
            prev2[~has] = before
        logits = self._out[:T]
        logits[:] = self.table[prev2, tokens]                        # [T, V]
        self.forward_calls += 1
        self.forward_tokens += T
        hidden = self._hidden[:T]                                    # [T, 2] what the logits depend on
        hidden[:, 0], hidden[:, 1] = prev2, tokens
        return StepOutput(logits=logits[-1:] if last_only else logits, hidden=hidden)

    def _forward_one(self, token: int, depths, L: int) -> StepOutput:
        if depths is not None:
            assert len(depths) == 1 and depths[0] == 0, f"depths {np.asarray(depths).tolist()} != [0]"
        if not 0 <= token < self.vocab_size:
            raise AssertionError(f"token ids out of range: [{token}]")
        self.history[L] = token
        prev2 = int(self.history[L - 1]) if L > 0 else BOS
        logits = self._out[:1]
        logits[0] = self.table[prev2, token]
        self.forward_calls += 1
        self.forward_tokens += 1
        hidden = self._hidden[:1]
        hidden[0, 0], hidden[0, 1] = prev2, token
        return StepOutput(logits=logits, hidden=hidden)

    def _move_rows(self, keep: np.ndarray) -> None:
        L = self.length
        self.history[L:L + len(keep)] = self.history[L + keep]      # fancy index copies first

    def context(self) -> np.ndarray:
        """[length] the committed tokens."""
        return self.history[:self.length].copy()


_CHECKED_MASKS: dict = {}      # a tree's mask repeats round after round: each one checked once
_CHAINS: dict = {}


def _rows(parents: np.ndarray, depths: np.ndarray) -> tuple:
    """(parent clipped to 0, has a parent, depth, depth's int64 bytes, whether row 0 alone has no parent)."""
    depths = depths.astype(np.int64)
    out = (np.maximum(parents, 0), parents >= 0, depths)
    for a in out:
        a.flags.writeable = False
    return out + (depths.tobytes(), bool(len(parents)) and bool(parents[0] < 0 and (parents[1:] >= 0).all()))


def _chain_rows(T: int) -> tuple:
    """(parent clipped to 0, has a parent, depth) of each row of a T-token chain."""
    if T not in _CHAINS:
        _CHAINS[T] = _rows(np.arange(-1, T - 1), np.arange(T))
    return _CHAINS[T]


def _check_tree_mask(mask: np.ndarray) -> tuple:
    """_chain_rows for an ancestor-or-self mask [T, T], checked to be one."""
    key = (mask.shape, mask.tobytes())
    if key not in _CHECKED_MASKS:
        _CHECKED_MASKS[key] = _rows(_tree_mask_parents(mask), mask.sum(1) - 1)
    return _CHECKED_MASKS[key]


def _tree_mask_parents(mask: np.ndarray) -> np.ndarray:
    T = len(mask)
    assert mask.shape == (T, T), mask.shape
    assert np.all(np.diag(mask)), "tree_mask: every row must see itself"
    assert not np.any(np.triu(mask, 1)), "tree_mask: a row sees a later row"
    below = np.tril(mask, -1)                                   # vectorized: the statistical tests call it per pass
    has = below.any(1)
    parents = np.where(has, T - 1 - np.argmax(below[:, ::-1], axis=1), -1).astype(np.int64)
    closure = np.where(has[:, None], mask[np.maximum(parents, 0)], False)
    closure[np.arange(T), np.arange(T)] = True
    bad = np.flatnonzero((closure != mask).any(1))
    assert not len(bad), f"tree_mask row {bad[0]} is not its parent's row plus itself"
    return parents


# ------------------------------------------------------------------------------------------------
# Tables and exact distributions
# ------------------------------------------------------------------------------------------------
def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def make_table(rng: np.random.Generator, V: int, sharpness: float = 1.0) -> np.ndarray:
    """[V, V, V] log-probs; sharpness 0 = uniform, ~1 = moderate, >= 3 = nearly deterministic."""
    return log_softmax(sharpness * rng.standard_normal((V, V, V)))


def perturb_table(rng: np.random.Generator, table: np.ndarray, noise: float) -> np.ndarray:
    """A draft for `table`: the same logits plus Gaussian noise (noise 0 = the target itself)."""
    return log_softmax(table + noise * rng.standard_normal(table.shape))


def _context(prompt) -> tuple[int, int]:
    prompt = [int(t) for t in prompt]
    padded = [BOS, BOS] + prompt
    return padded[-2], padded[-1]


def exact_continuation_probs(table: np.ndarray, prompt, k: int, params: SamplingParams) -> np.ndarray:
    """[V] * k: the exact probability of every k-token continuation of `prompt` when each token is
    drawn from `warp(target logits, params)`; the logits are the float32 values the backend serves.

    Example: k = 1 gives warp(table[prompt[-2], prompt[-1]]) (BOS = 0 for a missing token).
    """
    V = table.shape[-1]
    W = warp(np.asarray(table, dtype=np.float32), params)         # [V, V, V] next-token probs
    a, b = _context(prompt)
    out = W[a, b]                                                  # [V]
    if k >= 2:
        out = out[:, None] * W[b]                                  # [V, V]
    for _ in range(k - 2):
        out = out[..., None] * W                                   # [..., V, V] * [V, V, V] on the last two axes
    assert out.shape == (V,) * k
    return out


def greedy_reference(table: np.ndarray, prompt, n: int) -> np.ndarray:
    """[n] plain greedy continuation computed straight from the float32 table (no Backend, no loop)."""
    t32 = np.asarray(table, dtype=np.float32)
    a, b = _context(prompt)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(t32[a, b]))
        out.append(nxt)
        a, b = b, nxt
    return np.asarray(out, dtype=np.int64)


# ------------------------------------------------------------------------------------------------
# Vectorized sampling and the goodness-of-fit test
# ------------------------------------------------------------------------------------------------
def draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Vectorized inverse-CDF draw: probs [N, V] (rows need not be normalized), u [N] -> [N] tokens."""
    cdf = np.cumsum(probs, axis=-1)                                  # [N, V]
    idx = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)                 # zero-mass tokens are skipped
    last = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(idx, last)


@dataclass(frozen=True)
class Fit:
    pvalue: float
    tv: float              # total variation between the empirical and the exact distribution
    n: int                 # trials
    cells: int             # outcomes in the exact distribution (before pooling)

    @property
    def tv_bound(self) -> float:
        """4 sqrt(V / N) (ANCHORS.md "How to prove losslessness")."""
        return 4.0 * np.sqrt(self.cells / self.n)

    def __str__(self):
        return f"G-test p = {self.pvalue:.3g}, TV = {self.tv:.4f} (bound {self.tv_bound:.4f}), N = {self.n}"


def counts_of(outcomes: np.ndarray, shape: tuple) -> np.ndarray:
    """outcomes [N, k] int -> counts with `shape` (V,) * k."""
    flat = np.ravel_multi_index(tuple(np.asarray(outcomes).T), shape)
    return np.bincount(flat, minlength=int(np.prod(shape))).reshape(shape)


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray, *, min_expected: float = 5.0) -> Fit:
    """G-test (log-likelihood ratio) of observed counts against exact probabilities (same shape).

    Cells whose expected count is below `min_expected` are pooled into one cell (chosen from the
    exact distribution, not the data, so the test stays valid). Any count in a zero-probability cell
    gives p = 0: the sampler produced an impossible outcome.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape and probs.min() >= 0
    probs = probs / probs.sum()
    n = int(counts.sum())
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    if np.any(counts[probs == 0] > 0):
        return Fit(0.0, tv, n, len(probs))
    expected = probs * n
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    small = ~big & (probs > 0)
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp >= min_expected or not exp:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
        else:                                       # too small even pooled: fold into the smallest cell
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
    if len(obs) < 2:
        return Fit(1.0, tv, n, len(probs))           # one possible outcome, and only it was seen
    res = sps.power_divergence(np.asarray(obs), np.asarray(exp), lambda_="log-likelihood")
    return Fit(float(res.pvalue), tv, n, len(probs))


def chain(draft, gamma: int, *, draft_stop: float = 0.0):
    """The proposer of a draft model at γ (DraftChain), or None (vanilla) for γ 0 or no draft."""
    from specexport.runtime.proposers import DraftChain

    return DraftChain(draft, gamma, draft_stop=draft_stop) if draft is not None and gamma else None


def decode_many(target, proposer, prompt, params, runs: int, *, max_new: int, seed: int, after=None):
    """tokens [runs, max_new] from `runs` decodes through the whole loop sharing one rng, and the
    summed proposed / accepted counts (the proposal and verdict paths were both exercised if 0 <
    accepted < proposed). after(tokens): called with each run's tokens (a cache that learns)."""
    from specexport.runtime.loop import DecodeStats, decode

    rng = np.random.default_rng(seed)
    out = np.empty((runs, max_new), dtype=np.int64)
    proposed = accepted = 0
    for r in range(runs):
        stats = DecodeStats()
        out[r] = np.concatenate(list(decode(target, proposer, np.asarray(prompt), max_new_tokens=max_new,
                                            params=params, rng=rng, stats=stats)))
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
        if after is not None:
            after(out[r])
    return out, proposed, accepted


# ------------------------------------------------------------------------------------------------
# A tabular EAGLE head
# ------------------------------------------------------------------------------------------------
class TabularEagleHead(Backend):
    """An EAGLE head behind OrtEagleHead's interface (`draft`), with a real (token) KV cache.

    Row j's prediction is `table[prev, token]` over the draft vocabulary `vocab_ids` (its top K, in
    draft ids), where prev is the previous token as the row's input state says it (the target's
    feature of position j, or the parent's own state: `(prev2, prev)` is both what TabularBackend
    reports as hidden and what this head returns as its state). With the target's own table it is an
    oracle: its top-1 is the target's most likely token within the draft vocabulary. What a real head
    would silently get wrong is checked: the last cached row the mask lets a row see (for a catch-up
    row the row before it; for a draft level its parent's row, or the root's for depth 1) must hold
    that same previous token, so a cache that kept another branch's rows, or a feature or state fed to
    the wrong row, fails at once.
    """

    def __init__(self, table: np.ndarray, *, vocab_ids=None, top_k: int = 3, capacity: int, max_tokens: int):
        V = table.shape[-1]
        super().__init__(capacity=capacity, max_tokens=max_tokens, vocab_size=0)
        self.vocab_ids = np.arange(V) if vocab_ids is None else np.asarray(vocab_ids, np.int64)   # [Vd]
        logits = np.asarray(table, np.float32)[..., self.vocab_ids]                               # [V, V, Vd]
        self.logprobs_table = log_softmax(logits.astype(np.float64)).astype(np.float32)
        self.order = np.argsort(-self.logprobs_table, axis=-1, kind="stable")[..., :top_k]         # [V, V, K]
        self.top_logprobs = np.take_along_axis(self.logprobs_table, self.order, -1)                # [V, V, K]
        self.top_k, self.hidden_size = top_k, 2
        self.rows = np.full(capacity, -1, np.int64)                                # [capacity] token per cache row
        self.calls = 0

    def draft(self, tokens, positions, *, features=None, own=None, past_mask=None, last_only=False, phase="decode"):
        T, P = len(tokens), self.length
        assert 1 <= T <= self.max_tokens and P + T <= self.capacity
        assert (features is None) != (own is None)
        states = features if features is not None else own
        positions = positions.tolist() if isinstance(positions, np.ndarray) else list(positions)
        assert positions == list(range(P, P + T)) if past_mask is None else len(set(positions)) == 1
        toks = np.asarray(tokens, np.int64)
        self.rows[P:P + T] = toks
        self._pending = T
        # the statistical tests call it ~10^5 times: a few rows, so Python lists; the last row each row sees
        prevs = np.asarray(states)[:, -1].astype(np.int64)                        # [T]
        if past_mask is None:
            last = range(P - 1, P + T - 1)
        else:
            seen = np.asarray(past_mask, bool)
            width = seen.shape[1]
            last = (np.where(seen.any(1), width - 1 - np.argmax(seen[:, ::-1], axis=1), -1) if width
                    else np.full(T, -1)).tolist()
        cached, wanted = self.rows.tolist(), prevs.tolist()
        for i, j in enumerate(last):
            if j >= 0 and cached[j] != wanted[i]:
                raise AssertionError(f"row {P + i}: its input state says previous token {wanted[i]}, its cache "
                                     f"{cached[j]}")
        hidden = np.empty((T, 2), np.float32)                                     # [T, 2]
        hidden[:, 0], hidden[:, 1] = prevs, toks
        ids = self.order[prevs, toks]                                             # [T, K]
        lps = self.top_logprobs[prevs, toks]
        self.calls += 1
        return HeadStep(ids[-1:] if last_only else ids, lps[-1:] if last_only else lps, hidden)
