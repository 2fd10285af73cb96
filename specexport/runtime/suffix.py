"""The store behind SuffixDecoding (Oliaro et al., NeurIPS 2025; Arctic Inference): token sequences
that, given the current context, yield the longest suffix of the context that occurred before, what
followed each occurrence, and a candidate token tree grown best-first by empirical probability.

`SuffixIndex` holds one scope's sequences (a request's own prompt and output, extended as it grows);
`SuffixCache` holds finished sequences of several scopes under one token budget, thread-safe, and saves
to and loads from one file. Longer than 420 lines because the three share one private layout (absolute
positions, separators, per-level tails, the bulk-load path the file uses): kept in one module, it stays
private.

Why not a library: Arctic Inference's C++ suffix tree ships only as an sdist whose build requires
torch>=2.10 and vLLM's toolchain, and the runtime installs without torch. Why not a pointer-based suffix
tree in Python: a Python object per node costs ~100+ bytes and a depth-bounded suffix trie of 1M tokens
has millions of nodes. So nothing here is a Python object per stored token: memory is O(tokens) in numpy
arrays (`nbytes`): 4-6 bytes per token of store plus 8 per token per gram level.

Design. The tokens of all sequences sit in one int32 store, each sequence preceded by a separator (-1),
so a backwards comparison stops at a sequence's start by itself. For each gram length K in `levels` (the
powers of two below max_match, and max_match: 1, 2, 4, 8, 16, 32), a sorted uint64 array holds
`key << 32 | position` for every position whose K-gram (the K tokens ending there) lies inside one
sequence and is followed by a token of it; the key is token + 1 for K = 1, a 32-bit hash of the gram
otherwise. Two `searchsorted` calls find every occurrence of the context's last K tokens, ordered by
position, so the most recent are the range's end: taking max_occurrences of them costs that many, however
common the gram. The levels are tried longest first: at level K, when the next level K' had no real hit,
every hit matches K..K' - 1 tokens, so only these hits are compared backwards (vectorised) up to K' - 1;
and as every hit's tokens are compared, a hash collision costs time, never a wrong match. The newest
positions sit in unsorted per-level tails, scanned directly (a request's index grows a few tokens per
round); a level's tail is merged into its sorted array (an O(N) insert) once it outgrows max(4096, 1/32
of that array), one level per call, so a 1M-token cache pauses for one array's copy, not six. Positions
are absolute and only grow: evicting the oldest sequence only raises `_base`, the lower bound of every
range; the evicted tokens and entries are dropped once they pass 1/8 of the live ones, and positions are
renumbered before they outgrow 32 bits. Measured at 1M tokens: ~53-56 bytes per token.

Why not a suffix array over the reversed text (one position per token): it finds the longest match by
binary search, but the occurrences of a short match are spread over a range ordered by the tokens before
them, so "most recent first" needs a top-k over that whole range (tens of thousands of entries for a
common token) on every lookup, and each inserted position needs a binary search of multi-token
comparisons.

Worked example: sequences [[1, 2, 3, 1, 2, 4]], context [9, 1, 2]: the longest suffix that occurred is
[1, 2] (m = 2), at offsets 0 and 3, followed by the continuations [4] (the most recent, offset 5) and
[3, 1] (offset 2; max_depth 2). The trie under the root has 3 (count 1), 3 -> 1 (count 1) and 4 (count
1) of 2 occurrences, so best-first: 3 (0.5), 4 (0.5; same probability, smaller depth than 3 -> 1), then
3 -> 1 (0.5): parents [-1, 0, 0, 1], tokens [root, 3, 4, 1], probs [1, 0.5, 0.5, 0.5], score 1.5.
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.errors import SpecexportError, shown

MAX_TOKEN = 2**31 - 2           # token ids are stored as int32; the level-1 key is token + 1 (never 0)
_LOW = np.uint64(0xFFFFFFFF)    # the position half of a packed key
_MAX_POSITION = 2**32 - 2       # positions share a uint64 with a 32-bit key
_B = 0x9E3779B97F4A7C15         # the polynomial hash's base (odd, so no token's weight vanishes mod 2^64)
_M64 = 2**64


@dataclass(frozen=True)
class Match:
    length: int              # m >= 1: tokens of the context's suffix that matched
    starts: np.ndarray       # [k] int64: store positions where each occurrence's continuation starts,
    #                          most recent first, at most max_occurrences; valid until the index changes


@dataclass(frozen=True)
class Candidates:
    parents: np.ndarray   # [T] int64, node 0 = root (parent -1), parents before children
    tokens: np.ndarray    # [T] int64, tokens[0] = root
    probs: np.ndarray     # [T] float64, probs[0] = 1.0, each node's empirical path probability

    @property
    def score(self) -> float:
        """Expected tokens accepted if the store's statistics hold (the sum of the nodes' probabilities)."""
        return float(self.probs[1:].sum())


def as_tokens(tokens, what: str = "tokens") -> np.ndarray:
    """`tokens` as a 1-D int64 array of ids in 0..MAX_TOKEN, or SpecexportError (one line)."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise SpecexportError(f"{what}: expected a 1-D sequence of integer token ids, got {arr.dtype} of shape "
                              f"{arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN:
        raise SpecexportError(f"{what}: token ids must lie in 0..{MAX_TOKEN}, got {int(arr.min())}..{int(arr.max())}")
    return arr


def levels_for(max_match: int) -> tuple[int, ...]:
    """The gram lengths indexed: powers of two below max_match, then max_match. Example: 32 ->
    (1, 2, 4, 8, 16, 32); 5 -> (1, 2, 4, 5)."""
    out, k = [], 1
    while k < max_match:
        out.append(k)
        k *= 2
    return (*out, max_match)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every output bit depends on every input bit, so the top 32 bits make a key.
    (A module function so a test can swap in one that collides everywhere.)"""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def gram_keys(window: np.ndarray, levels: tuple[int, ...], first: int) -> list[np.ndarray]:
    """For each level K, the uint32 key of the K-gram ending at each index first.. of `window` (tokens,
    -1 = separator), 0 where that gram is not inside one sequence. The window must start at a separator or
    hold max(levels) - 1 tokens before `first`. Example: window [-1, 5, 6], levels (1, 2), first 1 ->
    [[6, 7], [0, h(5, 6)]] (level 1 is token + 1: exact).
    """
    x = (window.astype(np.int64) + 1).astype(np.uint64)          # separator -> 0
    idx = np.arange(len(window))
    run = idx - np.maximum.accumulate(np.where(window < 0, idx, -1))   # tokens since the last separator, incl.
    memo: dict[int, np.ndarray] = {1: x}

    def poly(n: int) -> np.ndarray:         # sum_j x[i - j] * B^j over j < n (0 before the window's start)
        if n not in memo:
            a = 1 << (n.bit_length() - 1)
            if a == n:
                a //= 2
            lo, hi = poly(a), poly(n - a)   # the a newest tokens, then the n - a before them
            shifted = np.zeros_like(hi)
            if a < len(hi):
                shifted[a:] = hi[:-a]
            memo[n] = lo + shifted * np.uint64(pow(_B, a, _M64))
        return memo[n]

    out = []
    for k in levels:
        if k == 1:
            key = x[first:].astype(np.uint32)
        else:
            h = _mix(poly(k)[first:])
            key = ((h >> np.uint64(32)) | np.uint64(1)).astype(np.uint32)     # | 1: never the 0 of "no gram"
            key[run[first:] < k] = 0
        out.append(key)
    return out


def context_keys(ctx: np.ndarray, levels: list[int]) -> list[int]:
    """`gram_keys` of the grams ending at ctx's last token, one per level (each <= len(ctx)), by a Python
    loop: a lookup hashes one position, where numpy's per-call cost would be most of the time.
    Example: ctx [5, 6], levels [1, 2] -> [7, h(5, 6)], as gram_keys([-1, 5, 6], (1, 2), 2)."""
    sums, h, w, want = [], 0, 1, set(levels[1:])
    for j, t in enumerate(ctx[::-1][:levels[-1]].tolist(), 1):
        h = (h + (t + 1) * w) % _M64                 # sum_j x[-j] * B^(j - 1), as poly() in gram_keys
        w = w * _B % _M64
        if j in want:
            sums.append(h)
    mixed = _mix(np.array(sums, dtype=np.uint64))
    keys = ((mixed >> np.uint64(32)) | np.uint64(1)).astype(np.uint32)
    return [int(ctx[-1]) + 1, *keys.tolist()]


class SuffixIndex:
    """One scope's sequences. Only the most recently added sequence may be extended."""

    _TAIL_MIN = 4096        # a level's unsorted tail is merged beyond max(_TAIL_MIN, sorted entries // _TAIL_SHARE)
    _TAIL_SHARE = 32
    _DEAD_SHARE = 8         # evicted tokens and entries are dropped once more than live // _DEAD_SHARE (and _TAIL_MIN)
    _POSITIONS = _MAX_POSITION      # positions are renumbered (one pass over everything) before they pass this

    def __init__(self, *, max_match: int = 32, max_occurrences: int = 256):
        for name, value in (("max_match", max_match), ("max_occurrences", max_occurrences)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecexportError(f"{name}: expected an integer >= 1, got {value!r}")
        self.max_match, self.max_occurrences = max_match, max_occurrences
        self.levels = levels_for(max_match)
        self._starts: deque[int] = deque()            # each live sequence's first position, oldest first
        self._first_id = 0                            # the id of _starts[0]
        self._next_id = 0
        self._live = 0                                # tokens in live sequences
        self._hold = False                            # defer merges (a bulk load merges once at the end)
        self._reset()

    def _reset(self) -> None:
        """Empty arrays, positions from 0 (when no sequence is live)."""
        L = len(self.levels)
        self._buf = np.zeros(64, dtype=np.int32)     # the store's positions _origin.._n: [-1, seq0..., -1, ...]
        self._origin = self._n = 0                    # _buf[0] is position _origin, always a separator
        self._base = 0                                # positions below it are evicted
        self._main = [np.zeros(0, dtype=np.uint64) for _ in range(L)]    # per level: sorted key << 32 | position
        self._clean = [0] * L                         # the _base a level's sorted array was last purged at
        self._tail = [np.zeros(64, dtype=np.uint32) for _ in range(L)]   # per level: keys of _tail_start[j]..
        self._tail_start = [0] * L

    # -- what it holds ------------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return self._live

    @property
    def sequences(self) -> int:
        return len(self._starts)

    @property
    def nbytes(self) -> int:
        return int(self._buf.nbytes + sum(a.nbytes for a in self._main) + sum(a.nbytes for a in self._tail)
                   + 8 * len(self._starts))

    def sequence(self, seq_id: int) -> np.ndarray:
        """The tokens of live sequence seq_id (a copy)."""
        i = self._slot(seq_id)
        end = self._starts[i + 1] - 1 if i + 1 < len(self._starts) else self._n
        return self._buf[self._starts[i] - self._origin:end - self._origin].astype(np.int64)

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(sequence ids, offsets in them) of store positions, e.g. a Match's starts (valid until the index
        changes). Example: sequences [[1, 2], [3]] are stored [-1, 1, 2, -1, 3]: positions [4, 2] ->
        ([1, 0], [0, 1])."""
        pos = np.asarray(positions, dtype=np.int64)
        starts = np.fromiter(self._starts, dtype=np.int64, count=len(self._starts))
        i = np.searchsorted(starts, pos, side="right") - 1
        if len(pos) and (int(i.min()) < 0 or int(pos.max()) >= self._n):
            raise SpecexportError("positions: outside the live store (a match from before the index changed?)")
        return i + self._first_id, pos - starts[i]

    def _slot(self, seq_id: int) -> int:
        if not isinstance(seq_id, (int, np.integer)) or not self._first_id <= seq_id < self._next_id:
            raise SpecexportError(f"sequence {seq_id!r}: not a live sequence of this index (evicted or never added)")
        return int(seq_id) - self._first_id

    # -- growing ------------------------------------------------------------------------------------------
    def add(self, tokens) -> int:
        """Store a new sequence (extendable until the next add); returns its id."""
        arr = as_tokens(tokens)
        self._append(np.concatenate([[-1], arr]))
        if not self._starts:
            self._base = self._n - len(arr)           # the oldest live sequence's first position, as always
        self._starts.append(self._n - len(arr))
        self._next_id += 1
        self._live += len(arr)
        self._maybe_merge()
        return self._next_id - 1

    def extend(self, seq_id: int, tokens) -> None:
        """Append tokens to sequence seq_id, which must be the most recently added one."""
        if self._slot(seq_id) != len(self._starts) - 1:
            raise SpecexportError(f"sequence {seq_id}: only the most recently added sequence can be extended")
        arr = as_tokens(tokens)
        self._append(arr)
        self._live += len(arr)
        self._maybe_merge()

    def _append(self, arr: np.ndarray) -> None:
        k = len(arr)
        if self._n + k > self._POSITIONS:
            self._renumber()
            if self._n + k > self._POSITIONS:
                raise SpecexportError(f"suffix index: more than {self._POSITIONS} positions in one index")
        n, o = self._n, self._origin
        self._buf = _room(self._buf, n + k - o)
        self._buf[n - o:n + k - o] = arr
        self._n = n + k
        lo = max(o, n - self.max_match + 1)       # the grams ending at the new positions reach back this far
        keys = gram_keys(self._buf[lo - o:n + k - o], self.levels, n - lo)
        for j, key in enumerate(keys):
            t0, t1 = n - self._tail_start[j], n + k - self._tail_start[j]
            self._tail[j] = _room(self._tail[j], t1)
            self._tail[j][t0:t1] = key

    def evict_oldest(self) -> int:
        """Drop the oldest sequence; returns how many tokens that freed (0 when the index is empty)."""
        if not self._starts:
            return 0
        start = self._starts.popleft()
        self._first_id += 1
        end = self._starts[0] - 1 if self._starts else self._n
        self._base = self._starts[0] if self._starts else self._n
        self._live -= end - start
        self._maybe_merge()
        return end - start

    def _maybe_merge(self) -> None:
        """Merge the longest tail when it outgrows its limit (one level per call: a merge is an O(N) copy,
        and six at once would be one long pause), and any tail past twice the limit; drop evicted tokens."""
        if self._hold:
            return
        if not self._starts:
            self._reset()
            return
        limit = max(self._TAIL_MIN, len(self._main[0]) // self._TAIL_SHARE)
        longest = int(np.argmin(self._tail_start))
        for j in range(len(self.levels)):
            if self._n - self._tail_start[j] > (limit if j == longest else 2 * limit):
                self._merge_level(j)
        if self._base - 1 - self._origin > self._dead_limit():
            self._drop_dead_tokens()

    def _dead_limit(self) -> int:
        return max(self._TAIL_MIN, self._live // self._DEAD_SHARE)

    def _merge_level(self, j: int) -> None:
        """Move level j's tail positions with a known continuation (all but the store's last, whose may
        still come) into its sorted array, purging evicted entries from it once they are many."""
        n, base, ts = self._n, self._base, self._tail_start[j]
        lo = max(ts, base)
        pos = np.arange(lo, n - 1, dtype=np.int64)
        pos = pos[self._buf[lo + 1 - self._origin:n - self._origin] >= 0]     # followed by a token of its sequence
        key = self._tail[j][pos - ts].astype(np.uint64)
        keep = key != 0
        new = np.sort((key[keep] << np.uint64(32)) | pos[keep].astype(np.uint64))
        old = self._main[j]
        if base - self._clean[j] > self._dead_limit():
            old = old[(old & _LOW) >= np.uint64(base)]
            self._clean[j] = base
        self._main[j] = np.insert(old, np.searchsorted(old, new), new) if len(new) else old
        last = self._tail[j][n - 1 - ts]
        self._tail[j] = np.zeros(64, dtype=np.uint32)
        self._tail[j][0] = last
        self._tail_start[j] = n - 1

    def _drop_dead_tokens(self) -> None:
        """Forget the evicted tokens: the store then starts at the oldest live sequence's separator."""
        cut, o = self._base - 1, self._origin
        live = self._buf[cut - o:self._n - o]
        self._buf = np.zeros(max(64, len(live) * 5 // 4), dtype=np.int32)
        self._buf[:len(live)] = live
        self._origin = cut

    def _merge_all(self) -> None:
        for j in range(len(self.levels)):
            self._merge_level(j)

    def _renumber(self) -> None:
        """Renumber positions from 0 (the oldest live sequence's separator): positions only grow, and share
        a uint64 with a 32-bit key. One pass over everything, once per ~4G tokens appended."""
        if not self._starts:
            self._reset()
            return
        self._merge_all()
        self._drop_dead_tokens()
        shift, base = self._origin, np.uint64(self._base)
        for j, old in enumerate(self._main):
            self._main[j] = old[(old & _LOW) >= base] - np.uint64(shift)   # >= base > shift: positions only
            self._clean[j] = self._base - shift
        self._tail_start = [t - shift for t in self._tail_start]
        self._starts = deque(s - shift for s in self._starts)
        self._origin, self._n, self._base = 0, self._n - shift, self._base - shift

    # -- looking up ---------------------------------------------------------------------------------------
    def match(self, context) -> Match | None:
        """The longest suffix of `context` (at most max_match tokens) that occurred in a stored sequence with
        a token after it, and where each occurrence's continuation starts; None when no token of it did."""
        ctx = as_tokens(context, "context")
        if len(ctx) == 0 or not self._starts:
            return None
        ctx = ctx[-self.max_match:]
        L = len(ctx)
        levels = [k for k in self.levels if k <= L]
        qkeys = context_keys(ctx, levels)
        rev = ctx[::-1]                               # rev[j] = the token j before the context's last
        for li in range(len(levels) - 1, -1, -1):
            top = min(levels[li + 1] if li + 1 < len(levels) else self.max_match + 1, L + 1) - 1  # m <= top
            found = self._occurrences(li, qkeys[li], rev, top)
            if found is not None:
                return found
        return None

    def _hits(self, j: int, key: int):
        """Positions whose level-j gram key is `key`, live and followed by a token of their sequence, in
        chunks from the most recent: the tail's (scanned), then the sorted range's from its end."""
        ts, o = self._tail_start[j], self._origin
        pos = np.flatnonzero(self._tail[j][:self._n - ts] == key) + ts
        pos = pos[pos >= self._base]
        if len(pos):
            nxt = np.take(self._buf, pos + 1 - o, mode="clip")
            pos = pos[(pos + 1 < self._n) & (nxt >= 0)]
            if len(pos):
                yield pos[::-1]
        main = self._main[j]                          # all its positions precede the tail's
        lo = int(np.searchsorted(main, np.uint64((key << 32) | self._base)))
        hi = int(np.searchsorted(main, np.uint64((key + 1) << 32))) if key < 0xFFFFFFFF else len(main)
        step = max(64, 2 * self.max_occurrences)
        while hi > lo:
            a = max(lo, hi - step)
            yield (main[a:hi][::-1] & _LOW).astype(np.int64)
            hi, step = a, step * 4

    def _occurrences(self, j: int, key: int, rev: np.ndarray, top: int) -> Match | None:
        """The occurrences among level j's hits that match most (K..top tokens), or None if none is real."""
        K, best, kept = self.levels[j], 0, []
        for pos in self._hits(j, key):
            # the gram's tokens (a hash can collide), then, where a longer match is possible, further back:
            # the first mismatch (a separator never equals a token) ends each match
            back = np.take(self._buf, pos[:, None] - self._origin - np.arange(top), mode="clip")  # [0]: a separator
            eq = back == rev[:top]
            lengths = np.where(eq.all(axis=1), top, eq.argmin(axis=1))
            good = lengths >= K
            if not good.any():
                continue
            pos, lengths = pos[good], lengths[good]
            m = int(lengths.max())
            if m > best:
                best, kept = m, [pos[lengths == m]]
            elif m == best:
                kept.append(pos[lengths == m])
            if best == top and sum(len(p) for p in kept) >= self.max_occurrences:
                break                                 # nothing later can match longer: the most recent suffice
        if not best:
            return None
        starts = np.concatenate(kept)[:self.max_occurrences] + 1
        return Match(length=best, starts=starts.astype(np.int64))

    def tree(self, match: Match, *, root: int, max_depth: int, max_nodes: int, min_prob: float = 0.0) -> Candidates:
        """The best-first tree of the match's continuations (each up to max_depth tokens of its own sequence):
        node probability = continuations through it / occurrences; nodes with probability >= min_prob, at
        most max_nodes besides the root, the most probable first (ties: smaller depth, smaller token, then
        the lexicographically smaller path), parents before children."""
        for name, value in (("max_depth", max_depth), ("max_nodes", max_nodes)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise SpecexportError(f"{name}: expected an integer >= 0, got {value!r}")
        starts = np.asarray(match.starts, dtype=np.int64)
        if len(starts) and (int(starts.min()) <= self._origin or int(starts.max()) >= self._n):
            raise SpecexportError("match: its positions lie outside the store (a match from before the index changed?)")
        return continuation_tree(self._buf[:self._n - self._origin], starts - self._origin, root=root,
                                 max_depth=int(max_depth), max_nodes=int(max_nodes), min_prob=min_prob)


def scan_match(context, *, max_match: int = 32, max_occurrences: int = 256) -> Match | None:
    """`SuffixIndex.match` for one open sequence, `context` itself, by a direct scan: what a request's
    own text needs each round. Its text is short (the prompt and output: up to max_seq_len tokens), so
    comparing backwards from every earlier occurrence of its last token costs less than keeping an
    index up to date a few tokens a round (per round over a 542-token code-edit request: 17-22 µs
    against 176-179 µs for SuffixIndex.extend + match). Starts index `context`; continuation_tree(context, starts, ...) grows its tree.

    Example: context [1, 2, 3, 1, 2] -> m = 2 ([1, 2] at 0), starts [2].
    """
    context = np.asarray(context)
    N = len(context)
    if N < 2:
        return None
    ends = np.flatnonzero(context[:N - 1] == context[N - 1])          # occurrences followed by a token
    if not len(ends):
        return None
    J = min(max_match, N - 1)
    offsets = np.arange(J)
    back = ends[:, None] - offsets                                     # [k, J] positions compared
    same = (back >= 0) & (context[np.maximum(back, 0)] == context[N - 1 - offsets])
    length = np.where(same.all(1), J, same.argmin(1))                  # the first mismatch
    m = int(length.max())
    starts = ends[length >= m][::-1][:max_occurrences] + 1            # most recent first
    return Match(m, starts.astype(np.int64))


def continuation_tree(store: np.ndarray, starts: np.ndarray, *, root: int, max_depth: int, max_nodes: int,
                      min_prob: float = 0.0) -> Candidates:
    """The best-first trie of the continuations store[s:s + max_depth] (cut at the first separator) of each
    start s. Example: store [-1, 1, 2, 3, 1, 2, 4], starts [6, 3], root 2, max_depth 2 -> continuations
    [4], [3, 1] -> parents [-1, 0, 0, 1], tokens [2, 3, 4, 1], probs [1, .5, .5, .5].
    """
    k = len(starts)
    if k == 0 or max_depth == 0 or max_nodes == 0:
        return _candidates([-1], [root], [1.0])
    max_depth = min(max_depth, len(store) - int(starts.min()))     # no continuation is longer
    idx = starts[:, None] + np.arange(max_depth)
    rows = np.take(store, idx, mode="clip")
    ok = np.logical_and.accumulate((rows >= 0) & (idx < len(store)), axis=1)    # ends at its sequence's end
    # rows in lexicographic order: as big-endian bytes of token + 1 (0 = ended), memcmp order is that order
    key = np.where(ok, rows + 1, 0).astype(">u4")
    order = np.argsort(key.view(f"V{4 * max_depth}").ravel(), kind="stable")
    tok, ok = key[order].astype(np.int64) - 1, ok[order]
    # a group is a run of rows sharing their first d + 1 tokens (a trie node at depth d + 1 when they are
    # tokens); numbered depth-major, so the groups of one depth come in the rows' lexicographic order
    new = np.ones((max_depth, k), dtype=bool)
    if k > 1:
        new[:, 1:] = np.logical_or.accumulate(tok[1:] != tok[:-1], axis=1).T
    group = (np.cumsum(new) - 1).reshape(max_depth, k)
    count = np.bincount(group.ravel())
    d, r = np.nonzero(new & ok.T)                  # each node's depth - 1 and first row
    c = count[group[d, r]]
    # best-first is the order (-count, depth, token, first row): a child never has more count than its
    # parent, and a tie goes to the smaller depth, so every node comes after its parent. Only the nodes
    # that can be among the first max_nodes are sorted: those with more count than the max_nodes-th
    # largest, and of those with just that count, the ones at the smallest depths.
    keep = np.flatnonzero(c / k >= min_prob)
    if len(keep) > max_nodes:
        ck = c[keep]
        c_star = np.partition(ck, len(ck) - max_nodes)[len(ck) - max_nodes]
        above, tie = ck > c_star, ck == c_star
        need = max_nodes - int(above.sum())
        dk = d[keep]
        d_star = np.partition(dk[tie], need - 1)[need - 1]
        keep = keep[above | (tie & (dk <= d_star))]
    d, r, c = d[keep], r[keep], c[keep]
    token = tok[r, d]
    sel = np.lexsort((r, token, d, -c))[:max_nodes]
    d, r, c, token = d[sel], r[sel], c[sel], token[sel]
    out_index = np.zeros(len(count), dtype=np.int64)               # a group's place in the output
    out_index[group[d, r]] = np.arange(1, len(sel) + 1)
    parents = np.where(d > 0, out_index[group[np.maximum(d - 1, 0), r]], 0)
    return _candidates(np.concatenate([[-1], parents]), np.concatenate([[root], token]),
                       np.concatenate([[1.0], c / k]))


def _candidates(parents, tokens, probs) -> Candidates:
    return Candidates(np.asarray(parents, dtype=np.int64), np.asarray(tokens, dtype=np.int64),
                      np.asarray(probs, dtype=np.float64))


def _room(arr: np.ndarray, size: int) -> np.ndarray:
    """`arr`, or a copy 1.5x larger when it holds fewer than `size` (amortised O(1) appends)."""
    if size <= len(arr):
        return arr
    out = np.zeros(max(size, len(arr) * 3 // 2), dtype=arr.dtype)
    out[:len(arr)] = arr
    return out


# -- the cache: several scopes, one budget, one file ---------------------------------------------------------
MAGIC = b"SPXSUFX\x00"
VERSION = 1
_HEAD = struct.Struct("<8sIIQQ")     # magic, version, scopes, sequences, tokens
_DIGEST = 32                         # sha256 of everything before it, at the end


class SuffixCache:
    """Finished sequences of several scopes under one token budget (eviction order shared by all scopes);
    a lookup sees only its own scope. Thread-safe: one lock around every public method."""

    def __init__(self, max_tokens: int, *, max_match: int = 32, max_occurrences: int = 256):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise SpecexportError(f"max_tokens: expected an integer >= 0, got {max_tokens!r}")
        SuffixIndex(max_match=max_match, max_occurrences=max_occurrences)       # checks them
        self._max_tokens, self._kw = max_tokens, {"max_match": max_match, "max_occurrences": max_occurrences}
        self._scopes: dict[str, SuffixIndex] = {}
        self._order: deque[str] = deque()         # each stored sequence's scope, oldest first
        self._tokens = 0
        self._lookups = self._hits = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        with self._lock:
            return self._tokens

    @property
    def sequences(self) -> int:
        with self._lock:
            return len(self._order)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(ix.nbytes for ix in self._scopes.values())

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    @property
    def lookups(self) -> int:
        with self._lock:
            return self._lookups

    @property
    def hits(self) -> int:
        with self._lock:
            return self._hits

    def stats(self) -> dict:
        with self._lock:
            return {"tokens": self._tokens, "sequences": len(self._order), "scopes": len(self._scopes),
                    "nbytes": sum(ix.nbytes for ix in self._scopes.values()), "max_tokens": self._max_tokens,
                    "lookups": self._lookups, "hits": self._hits}

    def add(self, tokens, scope: str = "") -> None:
        """Store a finished sequence under `scope`, first evicting the oldest sequences (of any scope) it
        needs room from; one longer than max_tokens keeps its last max_tokens tokens; an empty one is not
        stored."""
        arr = as_tokens(tokens)
        if not isinstance(scope, str):
            raise SpecexportError(f"scope: expected a string, got {scope!r}")
        with self._lock:
            self._add(arr[len(arr) - min(len(arr), self._max_tokens):], scope)

    def _add(self, arr: np.ndarray, scope: str) -> None:
        if len(arr) == 0:
            return
        while self._order and self._tokens + len(arr) > self._max_tokens:
            old = self._order.popleft()
            self._tokens -= self._scopes[old].evict_oldest()
            if not self._scopes[old].sequences:
                del self._scopes[old]
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = SuffixIndex(**self._kw)
        index.add(arr)
        self._order.append(scope)
        self._tokens += len(arr)

    def candidates(self, context, *, scope: str = "", root: int, max_depth: int, max_nodes: int,
                   min_prob: float = 0.0) -> tuple[Match | None, Candidates | None]:
        """(the match, its tree) for `context` in `scope`, or (None, None) when nothing of it occurred there."""
        with self._lock:
            self._lookups += 1
            index = self._scopes.get(scope)
            found = index.match(context) if index is not None else None
            if found is None:
                return None, None
            self._hits += 1
            return found, index.tree(found, root=root, max_depth=max_depth, max_nodes=max_nodes, min_prob=min_prob)

    # -- the file -----------------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the cache to `path` atomically (a temporary file beside it, then os.replace). Refuses to
        replace a file that is not a suffix cache (any version: an older cache of ours is stale, not foreign)."""
        path = Path(path)
        if path.is_dir():
            raise SpecexportError(f"{shown(path)}: is a folder, not a suffix cache file")
        if path.exists():
            try:
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC))
            except OSError as err:
                raise SpecexportError(f"{shown(path)}: cannot read it to check it is a suffix cache ({err.strerror})") from None
            if head != MAGIC:
                raise SpecexportError(f"{shown(path)}: exists and is not a suffix cache; refusing to overwrite it")
        with self._lock:
            data = self._serialize()
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as err:
            raise SpecexportError(f"{shown(path)}: cannot write the suffix cache ({err.strerror or err})") from None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _serialize(self) -> bytes:
        names = list(self._scopes)
        which = {name: i for i, name in enumerate(names)}
        cursor = {name: self._scopes[name]._first_id for name in names}
        seq_scope, seqs = [], []
        for name in self._order:                          # oldest first, across scopes
            seq_scope.append(which[name])
            seqs.append(self._scopes[name].sequence(cursor[name]).astype(np.int32))
            cursor[name] += 1
        parts = [_HEAD.pack(MAGIC, VERSION, len(names), len(seqs), self._tokens)]
        for name in names:
            raw = name.encode("utf-8", "surrogatepass")
            parts += [struct.pack("<I", len(raw)), raw]
        parts += [np.asarray(seq_scope, dtype="<u4").tobytes(),
                  np.asarray([len(s) for s in seqs], dtype="<u8").tobytes(),
                  (np.concatenate(seqs) if seqs else np.zeros(0, np.int32)).astype("<i4").tobytes()]
        body = b"".join(parts)
        return body + hashlib.sha256(body).digest()

    @classmethod
    def load(cls, path, max_tokens: int, **kw) -> SuffixCache:
        """A cache saved by `save`, under a (possibly different) budget: the oldest sequences beyond it are
        dropped. Any problem with the file is a one-line SpecexportError naming it."""
        cache = cls(max_tokens, **kw)
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise SpecexportError(f"{shown(path)}: cannot read the suffix cache ({err.strerror or err})") from None
        try:
            names, seq_scope, lengths, tokens = _parse(data)
        except _Damaged as err:
            raise SpecexportError(f"{shown(path)}: {err}") from None
        except Exception as err:  # noqa: BLE001 -- a damaged file must never surface as another exception
            raise SpecexportError(f"{shown(path)}: damaged suffix cache ({type(err).__name__})") from None
        # adding them all under the budget would keep the longest run of newest sequences that fits it (each
        # eviction is of a sequence that cannot fit with everything after it): add only those, oldest first,
        # into indexes that merge once at the end
        clipped = np.minimum(lengths, max_tokens).tolist()
        keep, total = len(clipped), 0
        while keep > 0 and clipped[keep - 1] and total + clipped[keep - 1] <= max_tokens:
            keep -= 1
            total += clipped[keep]
        ends = np.cumsum(lengths)
        with cache._lock:
            for i in range(keep, len(lengths)):
                seq = tokens[ends[i] - min(lengths[i], max_tokens):ends[i]]
                scope = names[seq_scope[i]]
                if scope not in cache._scopes:
                    cache._scopes[scope] = SuffixIndex(**cache._kw)
                    cache._scopes[scope]._hold = True
                cache._add(seq.astype(np.int64), scope)
            for index in cache._scopes.values():
                index._hold = False
                index._merge_all()
        return cache


class _Damaged(Exception):
    """Why a cache file is unreadable, in words (load turns it into a SpecexportError naming the file)."""


def _parse(data: bytes):
    if len(data) < len(MAGIC) or data[:len(MAGIC)] != MAGIC:
        raise _Damaged("not a suffix cache (wrong magic)")
    if len(data) < _HEAD.size + _DIGEST:
        raise _Damaged(f"truncated suffix cache ({len(data)} bytes)")
    _, version, n_scopes, n_seqs, n_tokens = _HEAD.unpack_from(data)
    if version != VERSION:
        raise _Damaged(f"suffix cache version {version}, this specexport reads version {VERSION}")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    at, names = _HEAD.size, []
    for _ in range(n_scopes):
        if at + 4 > len(body):
            raise _Damaged("truncated suffix cache (in the scope names)")
        (size,) = struct.unpack_from("<I", body, at)
        if at + 4 + size > len(body):
            raise _Damaged("truncated suffix cache (in the scope names)")
        names.append(body[at + 4:at + 4 + size].decode("utf-8", "surrogatepass"))
        at += 4 + size
    if at + 12 * n_seqs + 4 * n_tokens != len(body):
        raise _Damaged(f"truncated or damaged suffix cache (expected {at + 12 * n_seqs + 4 * n_tokens + _DIGEST} "
                       f"bytes, found {len(data)})")
    if hashlib.sha256(body).digest() != digest:
        raise _Damaged("damaged suffix cache (checksum mismatch)")
    seq_scope = np.frombuffer(body, dtype="<u4", count=n_seqs, offset=at).astype(np.int64)
    lengths = np.frombuffer(body, dtype="<u8", count=n_seqs, offset=at + 4 * n_seqs).astype(np.int64)
    tokens = np.frombuffer(body, dtype="<i4", count=n_tokens, offset=at + 12 * n_seqs)
    if len(set(names)) != len(names) or (n_seqs and int(seq_scope.max()) >= n_scopes) \
            or int(lengths.sum()) != n_tokens or (n_tokens and not 0 <= int(tokens.min()) <= int(tokens.max()) <= MAX_TOKEN) or (n_seqs and lengths.min() < 1):
        raise _Damaged("damaged suffix cache (inconsistent tables)")
    return names, seq_scope, lengths, tokens
