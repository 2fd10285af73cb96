"""One graph serving several requests at once: S slots, each a batch row of the caches with its own
committed length (issue 35). A pass runs the calls of slots 0..B-1 as one [B, Tp] forward.

Layout: padded [B, Tp]. Every row of the pass is written at cache rows P..P+Tp-1 with P the largest
committed length among the B slots; a slot with fewer committed rows L < P has a hole [L, P) that its
mask hides, and commit copies its kept rows from P + keep down to L + k. Rows past a call's own T (the
padding up to Tp) and slots without a call this pass (dummies) see only themselves and are never
committed. Padding costs compute (on a CPU each row past a few costs ~0.4 of a one-row pass), so a
call much longer than the rest (a prompt chunk among one-token steps) runs alone in a pass of its own
slot when padding the others to it would cost more than re-reading the weights (`plan`). Why not
packed rows with a block-diagonal mask: the graph contract keeps one cache per batch row and one P per
pass (seqlens_k from the mask's width), so one batch row of several requests needs one shared cache,
and the kernels' attention computes a hidden key's dot product before it skips it: every row would
pay for every other request's keys. docs/serving.md has the measurements.

Exactness: a slot's rows see the same keys in the same cache order as alone (hidden keys are skipped,
not added as zeros, by the kernels' attention) and the matmuls' rows do not depend on the other rows
(plugins/cpu), so each slot's outputs equal its batch-1 outputs bit for bit where the build measured
the graph row-independent (`row_exact`). Elsewhere a batch holds one slot.

Slots stay packed at 0..n-1: before a pass, a request that sits past a freed slot moves down (its
committed rows copied), since a pass binds one contiguous range of the caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import (ATTENTION_MASK, AUX_HIDDEN_STATES, HIDDEN_STATES, INPUT_IDS, LOGITS, LOGITS_ROWS,
                                POSITION_IDS)
from specexport.runtime.backends.base import Backend, StepOutput


# A pass's fixed cost (reading the weights once) in rows of compute: what splitting a pass costs. Measured
# on Qwen2.5-Coder-1.5B Q4_K_M, this CPU (AVX2, 2 threads): one row 46 ms, each further row ~18 ms.
FIXED_ROWS = 1.6


@dataclass(eq=False)
class Call:
    """One slot's forward, waiting for a pass."""
    view: "SlotView"
    tokens: np.ndarray
    depths: np.ndarray | None
    tree_mask: np.ndarray | None
    last_only: bool
    out: StepOutput | None = None
    error: BaseException | None = None
    extra: object = None                # an EAGLE head's call: head_slots.HeadInputs


class Slots:
    """What every slotted graph shares: the slots in use (packed at 0..n-1, their caches moved down when one
    below is freed), the plan that groups a pass's calls, and the pass count. A subclass allocates the
    caches (`k`, `v`: lists of [slots, Hkv, rows, D]) and output buffers and implements `_pass`,
    `_rows_held` and `_grow`. submit(model, call) blocks until a pass has run the call (the scheduler in
    runtime/batch.py); run(calls) is that pass."""
    view_class: type = None                             # SlotView, set below

    def _setup(self, backend, slots: int, submit, name: str) -> None:
        from specexport.runtime.backends.ort import binding_calls

        if not hasattr(backend, "session"):
            raise SpecexportError(f"batched decoding runs on the onnxruntime CPU backend; the {name} is on "
                                  f"{type(backend).__name__}")
        self.io, self.name, self.slots, self.submit = backend.io, name, slots, submit
        self.capacity, self.max_tokens = backend.capacity, backend.max_tokens
        self.session = backend.session
        self.binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = binding_calls(require("onnxruntime"), self.session, self.binding)
        self.views: list[SlotView] = []                 # the slots in use, in slot order
        self.passes = 0                                 # passes run
        self.rows_run = 0                               # real rows over those passes
        self.observer = None                            # observer(name, B, Tp, real rows) after each pass
        self.fixed_rows = FIXED_ROWS

    def _caches(self, num_layers: int, kv_heads: int, rows: int, head_dim: int) -> None:
        shape = (self.slots, kv_heads, rows, head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(num_layers)]

    def view(self) -> "SlotView":
        """A new request's slot; SpecexportError when all are taken (the caller admits at most `slots`)."""
        if len(self.views) >= self.slots:
            raise SpecexportError(f"{self.name}: all {self.slots} slots are in use")
        view = self.view_class(self, len(self.views))
        self.views.append(view)
        return view

    def release(self, view: "SlotView") -> None:
        """Free a slot; the slots after it move down before the next pass (`_pack`)."""
        if view in self.views:
            self.views.remove(view)
            view.closed = True

    def _pack(self) -> None:
        for i, v in enumerate(self.views):
            if v.slot != i:                             # i < v.slot: a freed slot below it
                for buf in (*self.k, *self.v):
                    buf[i, :, :v.length] = buf[v.slot, :, :v.length]
                v.slot = i

    def run(self, calls: list[Call]) -> None:
        """Run every call: the plan's passes (`plan`), each call's `out` a view of its pass's outputs."""
        self._pack()
        group, singles = self.plan(calls)
        passes = [group, *([c] for c in singles)]             # the plan keeps one call in the group at least
        need = sum(self._extent(g)[0] * max(self.min_tokens, max(len(c.tokens) for c in g)) for g in passes)
        if need > self._rows_held():                           # a plan's rows past the buffers: grow them
            self._grow(need)
        offset = 0
        for g in passes:
            offset += self._pass(g, offset)

    def plan(self, calls: list[Call]) -> tuple[list[Call], list[Call]]:
        """(the calls that share one padded pass, the calls that run alone). Alone, a call costs a pass's
        fixed part (reading the weights: `fixed_rows`, in rows) but no padding; together, every slot in the
        range computes the longest call's rows. The cheapest number of the longest calls runs alone."""
        ordered = sorted(calls, key=lambda c: len(c.tokens))

        def cost(k: int) -> float:                  # the k longest alone, the rest together
            group, alone = ordered[:len(ordered) - k], ordered[len(ordered) - k:]
            rows = self._extent(group)[0] * max(self.min_tokens, len(group[-1].tokens)) if group else 0
            return self.fixed_rows * (len(alone) + bool(group)) + rows + \
                sum(max(self.min_tokens, len(c.tokens)) for c in alone)

        k = min(range(len(ordered)), key=cost)
        return ordered[:len(ordered) - k], ordered[len(ordered) - k:]

    def _run_pass(self, calls: list[Call], B: int, Tp: int) -> None:
        """Run the bound pass and count it (passes, real rows, the observer)."""
        self._run()
        real = sum(len(c.tokens) for c in calls)
        self.passes += 1
        self.rows_run += real
        if self.observer is not None:
            self.observer(self.name, B, Tp, real)

    @staticmethod
    def _extent(g: list[Call]) -> tuple[int, int]:
        """(slots in the pass, the first): the range from the lowest calling slot to the highest."""
        slots = [c.view.slot for c in g]
        return max(slots) - min(slots) + 1, min(slots)


class SlotModel(Slots):
    """A target or draft graph's slots over its OrtBackend's session (the weights are not loaded twice)."""

    def __init__(self, backend, slots: int, submit, *, name: str = "target", rows_per_pass: int | None = None):
        self._setup(backend, slots, submit, name)
        io = self.io
        self.vocab_size = io.vocab_size
        self.min_tokens = backend.min_tokens
        self.rows_per_pass = rows_per_pass or self.max_tokens   # shared out among the slots in use (share)
        self.exact_trees = backend.exact_trees
        # P <= capacity - 1, plus a padded pass of Tp rows
        self._caches(io.num_layers, io.num_kv_heads, self.capacity + self.max_tokens, io.head_dim)
        T, aux_width = min(self.max_tokens, self.rows_per_pass), len(io.aux_hidden_layers) * io.hidden_size
        self.logits = np.zeros(slots * T * io.vocab_size, np.float32)      # flat: each pass views [B, R, V]
        self.hidden = np.zeros(slots * T * io.hidden_size, np.float32)
        self.aux_width = aux_width
        self.aux = np.zeros(slots * T * aux_width, np.float32) if aux_width else None

    def share(self) -> int:
        """Rows a slot's round (or prompt chunk) takes now: a lone request's as batch-1's; else the pass's
        rows over the slots in use, each a row at least (rows cost compute past a few on a CPU)."""
        n = len(self.views)
        return self.max_tokens if n <= 1 else max(1, min(self.max_tokens, self.rows_per_pass // n))

    def _rows_held(self) -> int:
        return self.logits.size // self.vocab_size

    def _grow(self, rows: int) -> None:
        self.logits = np.zeros(rows * self.vocab_size, np.float32)
        self.hidden = np.zeros(rows * self.io.hidden_size, np.float32)
        if self.aux is not None:
            self.aux = np.zeros(rows * self.aux_width, np.float32)

    def _pass(self, calls: list[Call], offset: int) -> int:
        """One forward over slots lo..lo+B-1 padded to Tp rows, its outputs at row `offset` of the output
        buffers; returns the rows it used there (B x Tp)."""
        B, lo = self._extent(calls)
        by_slot = {c.view.slot - lo: c for c in calls}
        Tp = max(self.min_tokens, max(len(c.tokens) for c in calls))
        P = max(v.length for v in self.views[lo:lo + B])
        W = P + Tp
        R = 1 if all(c.last_only for c in calls) else Tp        # prefill chunks only: the last row's logits
        tokens = np.zeros((B, Tp), np.int64)
        positions = np.zeros((B, Tp), np.int64)
        mask = np.zeros((B, Tp, W), bool)
        rows = np.zeros((B, R), np.int64) if R == 1 else np.tile(np.arange(Tp, dtype=np.int64), (B, 1))
        self_rows = np.arange(Tp)
        mask[:, self_rows, P + self_rows] = True                 # padding and dummies see themselves only
        for b in range(B):
            L = self.views[lo + b].length
            positions[b] = L
            call = by_slot.get(b)
            if call is None:
                continue
            T = len(call.tokens)
            tokens[b, :T], tokens[b, T:] = call.tokens, call.tokens[-1]
            positions[b, :T] = L + (self_rows[:T] if call.depths is None else call.depths)
            mask[b, :T, :L] = True
            mask[b, :T, P:P + T] = np.tri(T, dtype=bool) if call.tree_mask is None else call.tree_mask
            if R == 1:
                rows[b, 0] = T - 1
        self._bind_pass(tokens, positions, mask, rows, B, Tp, R, lo, offset)
        self._run_pass(calls, B, Tp)
        V, H = self.vocab_size, self.io.hidden_size
        logits = self.logits[offset * V:(offset + B * R) * V].reshape(B, R, V)
        hidden = self.hidden[offset * H:(offset + B * Tp) * H].reshape(B, Tp, H)
        aux = None if self.aux is None else \
            self.aux[offset * self.aux_width:(offset + B * Tp) * self.aux_width].reshape(B, Tp, self.aux_width)
        for b, call in by_slot.items():
            T = len(call.tokens)
            call.view._scratch = P
            first = 0 if R == 1 else (T - 1 if call.last_only else 0)
            call.out = StepOutput(logits[b, first:first + (1 if call.last_only else T)], hidden[b, :T],
                                  None if aux is None else aux[b, :T])
        return B * Tp

    def _bind_pass(self, tokens, positions, mask, rows, B, Tp, R, lo, offset) -> None:
        bind_in, bind_out = self._bind_in, self._bind_out
        bind_in(INPUT_IDS, tokens)
        bind_in(POSITION_IDS, positions)
        bind_in(ATTENTION_MASK, mask)
        bind_in(LOGITS_ROWS, rows)
        shape = (B, *self.k[0].shape[1:])               # slots lo..lo+B-1: one contiguous range of each cache
        start = lo * self.k[0][0].nbytes
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            (pk, pv), (nk, nv) = self.io.past_names(i), self.io.present_names(i)
            bind_in(pk, shape, k.ctypes.data + start)
            bind_in(pv, shape, v.ctypes.data + start)
            bind_out(nk, shape, k.ctypes.data + start)
            bind_out(nv, shape, v.ctypes.data + start)
        f32 = 4
        bind_out(LOGITS, (B, R, self.vocab_size), self.logits.ctypes.data + offset * self.vocab_size * f32)
        bind_out(HIDDEN_STATES, (B, Tp, self.io.hidden_size), self.hidden.ctypes.data + offset * self.io.hidden_size * f32)
        if self.aux is not None:
            bind_out(AUX_HIDDEN_STATES, (B, Tp, self.aux_width), self.aux.ctypes.data + offset * self.aux_width * f32)


class SlotView(Backend):
    """One request's slot, driven like any Backend: forward hands the call to the scheduler and returns
    when a pass has run it; commit copies the kept rows from the pass's scratch rows (P + keep) down to
    the slot's committed length."""

    def __init__(self, model: SlotModel, slot: int):
        super().__init__(capacity=model.capacity, max_tokens=model.max_tokens, vocab_size=model.vocab_size)
        self.model, self.slot = model, slot
        self.exact_trees, self.min_tokens = model.exact_trees, model.min_tokens
        self._scratch = 0                   # the cache row where the last pass wrote this slot's first row
        self.closed = False

    @property
    def round_rows(self) -> int:
        return self.model.share()

    def _forward(self, tokens, depths, tree_mask, last_only) -> StepOutput:
        if self.closed:
            raise SpecexportError(f"{self.model.name}: this request's slot was released")
        call = Call(self, tokens, None if depths is None else np.asarray(depths, np.int64), tree_mask, last_only)
        self.model.submit(self.model, call)
        if call.error is not None:
            raise call.error
        return call.out

    def commit(self, keep) -> None:
        if isinstance(keep, (int, np.integer)) and self._scratch != self.length:
            keep = np.arange(int(keep))      # the rows sit at the pass's P, not at this slot's length
        super().commit(keep)

    def _needs_move(self, rows: list) -> bool:
        return self._scratch != self.length or super()._needs_move(rows)

    def _move_rows(self, keep: np.ndarray) -> None:
        dest = self.length + np.arange(len(keep))
        src = self._scratch + keep
        s = self.slot
        for buf in (*self.model.k, *self.model.v):
            buf[s, :, dest] = buf[s, :, src]           # fancy indexing copies the source rows first


Slots.view_class = SlotView
