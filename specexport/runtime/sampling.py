"""Logit warping and inverse-CDF sampling, with the randomness passed in.

`warp` turns logits into the distribution tokens are actually drawn from: temperature, then top-k,
then top-p (the order transformers applies). The same function with the same settings is applied to
the draft's and the target's logits, so q and p in the acceptance rule are the distributions that
produced (or would produce) the tokens (transformers #47932 computed q from unwarped logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


MIN_TEMPERATURE = 1e-5       # below it a temperature samples like greedy decoding (as vLLM treats it)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise ValueError(f"top_k: expected an integer >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1] or None, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one below MIN_TEMPERATURE: logits / T would overflow to inf (5e-324 gave NaN
        probabilities and a crash), and the distribution is the argmax's to float precision anyway."""
        return self.temperature < MIN_TEMPERATURE


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities [..., V] (float64) after temperature, top-k and top-p.

    Example: logits [2, 1, 0, -1], temperature 1, top_k 2 -> [0.731, 0.269, 0, 0].
    Greedy (temperature 0) gives the one-hot argmax.
    """
    if params.greedy:
        logits = np.asarray(logits, dtype=np.float64)
        probs = np.zeros_like(logits)
        np.put_along_axis(probs, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return probs
    # ufuncs called directly, in place: the loop warps a few rows per round (the same values as a z - z.max())
    z = np.divide(logits, params.temperature, dtype=np.float64)
    if params.top_k is not None and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]   # [..., 1]
        keep = ~(z < kth)                            # ties with the k-th value stay, as in transformers
        z -= np.maximum.reduce(z, axis=-1, keepdims=True)
        # the rest are 0 (what exp(-inf) gave) without calling exp on them: a vocabulary's worth of exp(-inf)
        # costs more than the k that matter (4 rows of 152k tokens: ~4 ms)
        probs = np.zeros_like(z)
        np.exp(z, out=probs, where=keep)
    else:
        z -= np.maximum.reduce(z, axis=-1, keepdims=True)
        probs = np.exp(z, out=z)
    probs /= np.add.reduce(probs, axis=-1, keepdims=True)
    if params.top_p is not None and params.top_p < 1:
        probs = _top_p(probs, params.top_p)
    return probs


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    if probs.ndim == 1:
        return _top_p_row(probs, top_p)
    flat = probs.reshape(-1, probs.shape[-1])                          # [N, V]
    if flat.shape[1] > _SORT_ALL:               # a real vocabulary: row by row, each sorting only its head
        return np.stack([_top_p_row(row, top_p) for row in flat]).reshape(probs.shape)
    rows = np.arange(len(flat))[:, None]        # plain fancy indexing, no take_along_axis (slow for a few rows)
    order = np.argsort(-flat, axis=-1, kind="stable")                 # [N, V]
    sorted_p = flat[rows, order]
    mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p             # mass of strictly more likely tokens
    keep = np.empty(flat.shape, dtype=bool)
    keep[rows, order] = mass_before < top_p
    out = np.where(keep.reshape(probs.shape), probs, 0.0)
    return out / np.add.reduce(out, axis=-1, keepdims=True)


_SORT_ALL = 1024        # rows this short are sorted whole; longer ones sort their most likely tokens only


def _top_p_row(probs: np.ndarray, top_p: float) -> np.ndarray:
    """_top_p of one row. A vocabulary's row is not sorted whole (a stable argsort of Qwen's 152k values is
    ~25 ms, a forward's price): the tokens at or above a threshold come first in the whole sort's order, so
    their sorted prefix and its running sums are that sort's; when their mass clears top_p by more than
    rounding no later token can be kept, else the threshold drops (at worst to the whole row)."""
    V = len(probs)
    if V <= _SORT_ALL:
        order = (-probs).argsort(kind="stable")
    else:
        cut, head = float(probs.max()), None
        while cut > 0:                                              # 0 once it underflows: every token
            cut *= 0.1
            head = probs >= cut
            if float(np.add.reduce(probs, where=head)) - top_p > 1e-6:
                break
        order = np.arange(V) if head is None else np.flatnonzero(head)      # None: NaN rows, sorted whole
        order = order[(-probs[order]).argsort(kind="stable")]
    sorted_p = probs[order]
    keep = (sorted_p.cumsum() - sorted_p) < top_p
    out = np.zeros(V, probs.dtype)
    out[order[keep]] = sorted_p[keep]
    out /= np.add.reduce(out)
    return out


class Coins:
    """Uniforms in [0, 1) keyed by (seed, stream, counter): a counter-based generator, so a draw's coin
    depends on where it is used, not on how many draws came before.

    The loop draws every emitted token with the coin of its position (stream DRAW, counter = the
    token's index in prompt + output). Vanilla decoding does the same, so under the q-free tree rule
    (which draws y ~ p at each level, p being exactly the distribution vanilla samples from at that
    position) every deterministic proposer (lookup, suffix, Medusa, EAGLE, top-ranked draft trees)
    emits the vanilla text for the same seed. Acceptance tests of the rejection rules use stream TEST,
    keyed by the round's first position and the test's index, so no coin is ever used twice.

    SplitMix64 (Steele et al. 2014: a Weyl counter through a 64-bit mixer; passes BigCrush) computed in
    numpy uint64 for a whole round at once, rather than numpy's Philox: that needs a Generator per
    counter (~20 µs each) to address positions directly.

    Example: Coins(0).at([5, 6]) and then Coins(0).at([6]) give the same coin for 6.
    """
    DRAW, TEST = 0, 1

    def __init__(self, seed: int):
        self._key = _mix_int(int(seed) % 2**64)
        self._keys = {}                                  # stream -> its key (a Python int)

    @classmethod
    def from_rng(cls, rng: np.random.Generator) -> "Coins":
        """Coins seeded by one draw of `rng` (callers that hold a Generator, e.g. tests)."""
        return cls(int(rng.integers(0, 2**63)))

    def _stream(self, stream: int) -> int:
        key = self._keys.get(stream)
        if key is None:
            key = self._keys[stream] = _mix_int(self._key ^ (stream * 0x2545F4914F6CDD1D % 2**64))
        return key

    def at(self, counters, stream: int = 0) -> np.ndarray:
        """[k] float64 coins for these counters (non-negative integers) in `stream`."""
        key = self._stream(stream)
        c = np.asarray(counters, dtype=np.uint64).reshape(-1)
        if len(c) <= _PY_COINS:                          # a round's few coins: Python ints beat ~10 numpy calls
            return np.array([_coin(key, int(i)) for i in c.tolist()], dtype=np.float64)
        x = _mix(np.uint64(key) + (c + np.uint64(1)) * _WEYL64)          # arrays wrap silently (no errstate)
        return (x >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)

    def span(self, start: int, count: int, stream: int = 0) -> np.ndarray:
        """at(range(start, start + count)): a round's consecutive counters, without building the array first."""
        if count > _PY_COINS:
            return self.at(np.arange(start, start + count, dtype=np.uint64), stream)
        key = self._stream(stream)
        return np.array([_coin(key, c) for c in range(start, start + count)], dtype=np.float64)

    def one(self, counter: int, stream: int = 0) -> float:
        return _coin(self._stream(stream), int(counter))


_PY_COINS = 16
_WEYL = 0x9E3779B97F4A7C15                      # SplitMix64's increment (a Python int; _WEYL64 numpy's)
_WEYL64 = np.uint64(_WEYL)
_M64 = 2**64 - 1


def _coin(key: int, counter: int) -> float:
    """The coin of one counter, in Python ints: the same bits as `Coins.at`'s numpy path."""
    return (_mix_int((key + (counter + 1) * _WEYL) & _M64) >> 11) * (1.0 / 2**53)


def _mix_int(x: int) -> int:
    """SplitMix64's finaliser on one 64-bit Python int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (array arithmetic wraps without a warning)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from probs [V] with a uniform u in [0, 1). Zero-probability tokens never come out.

    Example: probs [0.5, 0, 0.5]: u = 0.2 -> 0, u = 0.7 -> 2.
    """
    cdf = probs.cumsum() if isinstance(probs, np.ndarray) else np.cumsum(probs)
    idx = int(cdf.searchsorted(u * float(cdf[-1]), side="right"))
    if idx >= len(probs) or not probs[idx] > 0:     # u * total rounded up onto the last boundary
        idx = int(np.flatnonzero(probs > 0)[-1])
    return idx
