"""An EAGLE head serving several requests at once: each request's head cache a slot of one buffer, every
waiting head call (a catch-up or a draft level) of the batch in one padded pass (issue 35).

Layout and rules are the target's (slots.py): a pass over slots lo..lo+B-1 padded to Tp rows writes each
slot's rows at cache rows P..P+Tp-1, P the largest committed length among them; a slot with fewer rows L
hides [L, P) in its mask, and commit copies its kept rows down. What differs from a model's call: a head
call brings its own positions; each row reads the target's feature or the head's own state (the other
input zero, as alone); a draft level's rows see the cached rows `past_mask` names and themselves.

Exactness: the head runs on ONNX Runtime's own fp32 kernels, whose rows no build measures, so `rows_exact`
checks on the head itself, once: calls alone and the same calls in one padded pass beside another slot
(longer, so the first has a hole), every output bit compared. Where they differ, a batch gives each
request a head of its own instead (OrtEagleHead.sharing), unbatched but exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.errors import SpecexportError
from specexport.io_spec import (ATTENTION_MASK, DRAFT_HIDDEN, FEATURES, HIDDEN_STATES, INPUT_IDS, LOGITS_ROWS,
                                POSITION_IDS, TOPK_IDS, TOPK_LOGPROBS)
from specexport.runtime.backends.base import Backend
from specexport.runtime.backends.eagle import HeadStep, check_call
from specexport.runtime.backends.slots import Call, Slots, SlotView


@dataclass(frozen=True)
class HeadInputs:
    """What a head call brings besides its tokens (OrtEagleHead.draft's arguments)."""
    positions: np.ndarray               # [T]
    feats: np.ndarray | None            # [T, F] the target's features, or None
    own: np.ndarray | None              # [T, H] the head's own states, or None
    past_mask: np.ndarray | None        # [T, length] cached rows each row sees (None: all, a chain after them)


class EagleSlots(Slots):
    """The head caches and output buffers of `slots` requests over one OrtEagleHead's session."""

    def __init__(self, head, slots: int, submit, *, name: str = "eagle"):
        self._setup(head, slots, submit, name)
        io = self.io
        self.min_tokens = 1
        self.top_k, self.hidden_size, self.feature_width = io.top_k, io.hidden_size, io.feature_width
        self._caches(1, io.num_kv_heads, self.capacity + self.max_tokens, io.head_dim)
        self._grow(slots * self.max_tokens)

    def _rows_held(self) -> int:
        return self.hidden.size // self.hidden_size

    def _grow(self, rows: int) -> None:
        self.ids = np.zeros(rows * self.top_k, np.int64)
        self.logprobs = np.zeros(rows * self.top_k, np.float32)
        self.hidden = np.zeros(rows * self.hidden_size, np.float32)

    def _pass(self, calls: list[Call], offset: int) -> int:
        """One head pass over slots lo..lo+B-1 padded to Tp rows, outputs at row `offset`; returns B x Tp."""
        B, lo = self._extent(calls)
        by_slot = {c.view.slot - lo: c for c in calls}
        Tp = max(len(c.tokens) for c in calls)
        P = self._base(lo, B)
        R = 1 if all(c.last_only for c in calls) else Tp
        tokens = np.zeros((B, Tp), np.int64)
        positions = np.zeros((B, Tp), np.int64)
        mask = np.zeros((B, Tp, P + Tp), bool)
        features = np.zeros((B, Tp, self.feature_width), np.float32)
        own = np.zeros((B, Tp, self.hidden_size), np.float32)
        rows = np.zeros((B, R), np.int64) if R == 1 else np.tile(np.arange(Tp, dtype=np.int64), (B, 1))
        diag = np.arange(Tp)
        mask[:, diag, P + diag] = True                  # padding, dummies and draft levels see themselves
        for b, call in by_slot.items():
            L, T, x = self.views[lo + b].length, len(call.tokens), call.extra
            tokens[b, :T], tokens[b, T:] = call.tokens, call.tokens[-1]
            positions[b, :T], positions[b, T:] = x.positions, x.positions[-1]
            if x.feats is not None:
                features[b, :T] = x.feats
            else:
                own[b, :T] = x.own
            if x.past_mask is None:                  # catching up: every cached row, a chain after them
                mask[b, :T, :L] = True
                mask[b, :T, P:P + T] = np.tri(T, dtype=bool)
            else:
                mask[b, :T, :L] = x.past_mask
            if R == 1:
                rows[b, 0] = T - 1
        self._bind(tokens, positions, mask, rows, features, own, B, Tp, R, lo, offset)
        self._run_pass(calls, B, Tp)
        K, H = self.top_k, self.hidden_size
        ids = self.ids[offset * K:(offset + B * R) * K].reshape(B, R, K)
        logprobs = self.logprobs[offset * K:(offset + B * R) * K].reshape(B, R, K)
        hidden = self.hidden[offset * H:(offset + B * Tp) * H].reshape(B, Tp, H)
        for b, call in by_slot.items():
            T = len(call.tokens)
            call.view._scratch = P
            first = 0 if R == 1 else (T - 1 if call.last_only else 0)
            n = 1 if call.last_only else T
            call.out = HeadStep(ids[b, first:first + n], logprobs[b, first:first + n], hidden[b, :T])
        return B * Tp

    def _base(self, lo: int, B: int) -> int:
        """The cache row a pass over slots lo..lo+B-1 writes at: past every one's committed rows."""
        return max(v.length for v in self.views[lo:lo + B])

    def _bind(self, tokens, positions, mask, rows, features, own, B, Tp, R, lo, offset) -> None:
        bind_in, bind_out = self._bind_in, self._bind_out
        bind_in(INPUT_IDS, tokens)
        bind_in(POSITION_IDS, positions)
        bind_in(ATTENTION_MASK, mask)
        bind_in(LOGITS_ROWS, rows)
        bind_in(FEATURES, features)
        bind_in(DRAFT_HIDDEN, own)
        shape = (B, *self.k[0].shape[1:])
        start = lo * self.k[0][0].nbytes
        for (past, present), buf in zip(zip(self.io.past_names(0), self.io.present_names(0)), (self.k[0], self.v[0])):
            bind_in(past, shape, buf.ctypes.data + start)
            bind_out(present, shape, buf.ctypes.data + start)
        K, H = self.top_k, self.hidden_size
        bind_out(TOPK_IDS, (B, R, K), self.ids.ctypes.data + offset * K * 8, np.int64)
        bind_out(TOPK_LOGPROBS, (B, R, K), self.logprobs.ctypes.data + offset * K * 4)
        bind_out(HIDDEN_STATES, (B, Tp, H), self.hidden.ctypes.data + offset * H * 4)


class EagleSlotView(SlotView):
    """One request's head: OrtEagleHead's `draft`, commit and rollback, its call run in a batch pass."""

    def __init__(self, model: EagleSlots, slot: int):
        Backend.__init__(self, capacity=model.capacity, max_tokens=model.max_tokens, vocab_size=0)
        self.model, self.slot = model, slot
        self.top_k, self.hidden_size = model.top_k, model.hidden_size
        self._scratch = 0
        self.closed = False

    def draft(self, tokens, positions, *, features=None, own=None, past_mask=None, last_only: bool = False,
              phase: str = "decode") -> HeadStep:
        """As OrtEagleHead.draft (its checks too); the call waits for a pass of the batch."""
        T = len(tokens)
        if self.closed:
            raise SpecexportError(f"{self.model.name}: this request's slot was released")
        check_call(self, T, features, own=own)
        self._pending = T
        call = Call(self, np.asarray(tokens, np.int64), None, None, last_only,
                    extra=HeadInputs(np.asarray(positions, np.int64), features, own, past_mask))
        self.model.submit(self.model, call)
        if call.error is not None:
            raise call.error
        return call.out


EagleSlots.view_class = EagleSlotView


def rows_exact(head, seed: int = 0) -> bool:
    """Whether `head` (an OrtEagleHead) gives a call the same bits alone and in a padded pass beside a
    longer slot's call: a catch-up, then a draft level with a past mask, each compared in full."""
    rng = np.random.default_rng(seed)
    model = EagleSlots(head, 2, submit=None)
    a, b = model.view(), model.view()
    F, H, V = model.feature_width, model.hidden_size, 64      # token ids below 64: every vocabulary has them

    def call(view, T, *, level: bool):
        P = view.length
        states = rng.standard_normal((T, H if level else F)).astype(np.float32)
        extra = HeadInputs(np.full(T, P) if level else P + np.arange(T), None if level else states,
                           states if level else None, rng.random((T, P)) < 0.5 if level else None)
        return Call(view, rng.integers(0, V, T), None, None, False, extra=extra)

    def outputs(c) -> list[np.ndarray]:
        return [np.array(x) for x in (c.out.ids, c.out.logprobs, c.out.hidden)]

    for view, T in ((b, 6), (a, 3)):                # b's cache longer than a's: a pass of both leaves a hole
        model._pass([call(view, T, level=False)], 0)
        view._pending = T
        view.commit(T)
    for level in (False, True):
        calls = call(a, 2, level=level), call(b, 4, level=level)
        alone = []
        for c in calls:
            model._pass([c], 0)
            alone += outputs(c)
        model._pass(list(calls), 0)
        if not all(np.array_equal(x, y) for x, y in zip(alone, outputs(calls[0]) + outputs(calls[1]))):
            return False
    return True
