"""Many requests on one model: every active request's round goes through one target pass (issue 35).

    with pipe.batch(max_batch=4) as batch:
        handles = [batch.submit(prompt_ids=ids, method="suffix") for ids in prompts]
        outputs = [h.result() for h in handles]          # GenerationOutput each, as pipe.generate's

Each request runs the unchanged decode loop (runtime/loop.py) on its own thread, against a slot of the
shared target (backends/slots.py) and, when it drafts with the draft model or an EAGLE head, a slot of the
shared draft or head (backends/head_slots.py: where the head's rows are exact in a pass, else a head of
its own); Medusa requests get heads of their own on the shared session (stateless: `sharing()`).
A slot's forward blocks in the Scheduler until every live request is blocked too; then one pass runs:
the draft's or head's waiting calls first (those drafting), else the target's, which by then holds every live
request's call (each round ends with exactly one target call, a prefill chunk counts as one). So the
target's passes are lockstep rounds over all requests, and requests join and leave at round
boundaries without anyone waiting for a whole generation.

Why threads and a rendezvous instead of an explicit batched loop: the loop, the proposers and the
verifiers stay the single code path that the batch-1 tests prove lossless; a request in a batch runs
exactly the code it runs alone, and only the forward underneath is shared.
"""
from __future__ import annotations

import queue
import threading
from typing import NamedTuple

from specexport.errors import SpecexportError
from specexport.runtime.backends import on_our_kernels
from specexport.runtime.backends.head_slots import EagleSlots, rows_exact
from specexport.runtime.backends.slots import SlotModel


AUTO = "auto"                   # max_batch=AUTO: measured here (batch_width), the default everywhere


class Scheduler:
    """A rendezvous of request threads: calls wait until every live thread waits, then one pass runs."""

    def __init__(self):
        self._cond = threading.Condition()
        self._live = 0                      # request threads that may still call a model
        self._waiting: dict = {}            # SlotModel -> [Call]
        self._blocked = 0                  # calls waiting for a pass
        self._running = False

    def join(self) -> None:
        with self._cond:
            self._live += 1

    def between_passes(self, fn):
        """fn() with no pass running (taking or freeing a slot moves the slots a pass binds)."""
        with self._cond:
            while self._running:
                self._cond.wait()
            return fn()

    def leave(self) -> None:
        with self._cond:
            self._live -= 1
            self._cond.notify_all()          # the rest may all be waiting now

    def submit(self, model: SlotModel, call) -> None:
        """Wait until a pass has run `call` (its out or error set)."""
        with self._cond:
            self._waiting.setdefault(model, []).append(call)
            self._blocked += 1              # until its pass has run (not until this thread wakes: its
            while call.out is None and call.error is None:    # outputs are views the next pass overwrites)
                if not self._running and self._blocked >= self._live:
                    self._pass()
                else:
                    self._cond.wait()

    def _pass(self) -> None:
        """Run one model's waiting calls (called with the lock held; released while the pass runs)."""
        models = [m for m, calls in self._waiting.items() if calls]
        model = min(models, key=lambda m: m.name == "target")      # drafts before the target
        calls = self._waiting.pop(model)
        self._running = True
        self._cond.release()
        try:
            model.run(calls)
        except BaseException as err:        # every caller of this pass sees the failure
            for c in calls:
                c.error = err
        finally:
            self._cond.acquire()
            self._running = False
            self._blocked -= len(calls)
            self._cond.notify_all()


class Handle:
    """One submitted request: iterate it for text pieces, or result() for its GenerationOutput."""

    def __init__(self):
        self._events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.output = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def __iter__(self):
        while True:
            kind, value = self._events.get()
            if kind == "piece":
                yield value
            elif kind == "error":
                raise value
            else:
                return

    def result(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self.error is not None:
            raise self.error
        return self.output

    def cancel(self) -> None:
        """Stop after the current round; the slot goes back to the batch, the others' streams untouched."""
        self.cancelled.set()


class Batch:
    """Up to `max_batch` requests decoding together on one pipeline; more wait for a slot (FIFO)."""

    def __init__(self, pipe, max_batch: "int | str | Width" = AUTO, *, rows_per_pass: int | None = None):
        """max_batch: AUTO, an integer, or the Width batch_width already decided for this pipeline."""
        self.pipe = pipe
        width = max_batch if isinstance(max_batch, Width) else batch_width(pipe, max_batch)
        self.max_batch, self.note, self.exact = width
        self.scheduler = Scheduler()
        self.rows_per_pass = rows_per_pass or pipe.max_verify_tokens
        if not isinstance(self.rows_per_pass, int) or self.rows_per_pass < 1:
            raise SpecexportError(f"rows_per_pass: expected an integer >= 1, got {rows_per_pass!r}")
        self.target = SlotModel(pipe.target, self.max_batch, self.scheduler.submit, rows_per_pass=self.rows_per_pass)
        self.target.observer = self._observe
        self._drafts: dict[str, SlotModel] = {}             # the shared draft's slots, by precision
        self._eagle: EagleSlots | bool | None = None        # False: the head's rows are not exact in a pass
        self.observer = None                # observer(model name, B, Tp, real rows) after each pass (metrics)
        self._open_lock = threading.Lock()       # opens the shared draft / heads once
        self._admit = threading.Semaphore(self.max_batch)
        self._threads: list[threading.Thread] = []

    def draft_model(self, precision: str) -> SlotModel:
        """The slots of the pipeline's draft in `precision` (opened once)."""
        with self._open_lock:
            if precision not in self._drafts:
                model = SlotModel(self.pipe.draft_of(precision), self.max_batch, self.scheduler.submit, name="draft",
                                  rows_per_pass=self.rows_per_pass)
                model.observer = self._observe
                self._drafts[precision] = model
            return self._drafts[precision]

    def eagle_model(self) -> EagleSlots | None:
        """The EAGLE head's slots (opened once), None where its rows are not exact in a pass (rows_exact)."""
        with self._open_lock:
            if self._eagle is None:
                head = self.pipe.eagle
                self._eagle = EagleSlots(head, self.max_batch, self.scheduler.submit) if rows_exact(head) else False
                if self._eagle:
                    self._eagle.observer = self._observe
            return self._eagle or None

    def medusa(self):
        """A request's own Medusa heads on the pipeline's heads session (stateless: nothing to batch but the
        read of their weights, a small part of a round)."""
        with self._open_lock:
            shared = self.pipe.medusa
        return shared.sharing()

    def _observe(self, *args) -> None:
        if self.observer is not None:
            self.observer(*args)

    def request(self, prompt: str | None = None, **options):
        """A request's options checked (Pipeline.request's, its proposer's too), in the caller's thread."""
        request = self.pipe.request(prompt, **options)
        o = request.options
        if self.max_batch > 1 and o.method == "draft":          # the draft's rows share passes too
            exact, why = row_exact(self.pipe, "draft", o.draft_precision)
            if not exact:
                raise SpecexportError(f"draft_precision: {why}, so it cannot draft in a batch; draft in a precision "
                                      f"on specexport's kernels (gguf) or decode one request at a time (max_batch 1)")
        return request

    def submit(self, prompt: str | None = None, **options) -> Handle:
        """Start a request (Pipeline.stream's options) on a thread of its own; it waits for a slot if all
        are taken."""
        request = self.request(prompt, **options)
        handle = Handle()
        thread = threading.Thread(target=self._serve, args=(request, handle), daemon=True,
                                  name="specexport-batch")
        self._threads.append(thread)
        thread.start()
        return handle

    def stream(self, request, *, done):
        """Yield `request`'s text pieces, decoded in this thread as one of the batch (it waits for a slot
        first); done(GenerationOutput) when it ends. Closing the generator frees the slot."""
        with self._admit:
            self.scheduler.join()
            between = self.scheduler.between_passes
            target = between(self.target.view)
            taken = [target]                # slots this request holds, released at its end

            def draft(precision: str):      # the draft's slot, taken when the proposer first asks for it
                taken.append(between(self.draft_model(precision).view))
                return taken[-1]

            def heads(kind: str):           # its Medusa heads or EAGLE head, when the proposer first asks
                if kind == "medusa":
                    return self.medusa()
                model = self.eagle_model()
                if model is None:           # rows not exact in a pass: a head of its own, unbatched
                    return self.pipe.eagle.sharing()
                taken.append(between(model.view))
                return taken[-1]

            try:
                pieces = self.pipe.decode_request(request, target, self.pipe.resources(draft=draft, heads=heads),
                                                  done=done)
                try:
                    yield from pieces
                finally:
                    pieces.close()
            finally:
                between(lambda: [v.model.release(v) for v in taken])
                self.scheduler.leave()

    def _serve(self, request, handle: Handle) -> None:
        try:
            if handle.cancelled.is_set():
                return
            pieces = self.stream(request, done=lambda out: setattr(handle, "output", out))
            try:
                for piece in pieces:
                    handle._events.put(("piece", piece))
                    if handle.cancelled.is_set():
                        break
            finally:
                pieces.close()
        except BaseException as err:        # this request's failure; the others go on
            handle.error = err
            handle._events.put(("error", err))
        finally:
            handle._events.put(("end", None))
            handle._done.set()

    def close(self) -> None:
        for t in self._threads:
            t.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def row_exact(pipe, role: str = "target", precision: str | None = None) -> tuple[bool, str]:
    """(whether a row's outputs are independent of its batch neighbours on the pipeline's target, or its
    draft in `precision`, why not): the build measured the graph's rows independent (row_dependence 0.0)
    on specexport's own CPU kernels."""
    precision = precision or pipe.precision
    entry = pipe.manifest["models"][role]["precisions"][precision]
    dependence = entry.get("row_dependence") or {}
    graph = precision if role == "target" else f"{role}'s {precision}"
    if not on_our_kernels(entry):
        return False, f"the {graph} graph runs on ONNX Runtime's own kernels, whose rows depend on the pass"
    if any(v != 0.0 for v in dependence.values()) or not dependence:
        return False, f"the build measured the {graph} graph's rows dependent ({dependence})"
    return True, ""


def check_max_batch(value) -> int | str:
    """max_batch as given, checked (the one check from the CLI to the worker): AUTO (None too) or an
    integer >= 1."""
    if value is None or value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecexportError(f"max_batch: expected {AUTO!r} or an integer >= 1, got {value!r}")
    return value


class Width(NamedTuple):
    """How many requests decode together on a pipeline, decided once (batch_width)."""
    max_batch: int
    note: str                   # the line that says why
    exact: bool                 # the target's rows are independent of their batch neighbours (row_exact)


def batch_width(pipe, max_batch: int | str = AUTO) -> Width:
    """max_batch checked, then as given, or measured here when AUTO (auto_max_batch); 1 where a row's outputs
    depend on its batch neighbours. The server decides it once and hands it to its Batch."""
    max_batch = check_max_batch(max_batch)
    exact, why = row_exact(pipe)
    if not exact:
        return Width(1, f"max_batch 1: {why}, so a request's output would depend on its batch neighbours", False)
    if max_batch == AUTO:
        return Width(*auto_max_batch(pipe), True)
    return Width(max_batch, f"max_batch {max_batch} (as given)", True)


AUTO_MAX_BATCH = (8, 4, 2)          # the batch sizes auto_max_batch tries, largest first
AUTO_BOUND = 2.0                # ... the largest whose pass costs at most this many one-row passes


def auto_max_batch(pipe, *, clock=None, reps: int = 5) -> tuple[int, str]:
    """(max_batch, why): measured here, the largest of AUTO_MAX_BATCH whose one-row-per-request pass costs at
    most AUTO_BOUND one-row passes (so a request's time per token stays within about twice a lone
    request's), 1 where none qualifies; on a row-exact target (batch_width checks). A few target passes."""
    import time

    import numpy as np

    clock = clock or time.perf_counter
    target = pipe.target
    tokens = np.zeros(max(AUTO_MAX_BATCH), np.int64)

    sizes = [1, *(n for n in AUTO_MAX_BATCH if n <= target.max_tokens)]
    times: dict = {n: [] for n in sizes}
    for rep in range(reps + 1):                     # sizes interleaved (the machine drifts); the first round warms
        for n in sizes:
            target.reset()
            start = clock()
            target.forward(tokens[:n])
            if rep:
                times[n].append(clock() - start)
    target.reset()
    one = min(times[1])                             # the least of each: a neighbour's load only ever adds
    costs = {n: min(times[n]) / one for n in sizes[1:]}
    chosen = next((n for n, c in costs.items() if c <= AUTO_BOUND), 1)
    measured = ", ".join(f"{n} rows {c:.2f}" for n, c in sorted(costs.items()))
    return chosen, (f"max_batch {chosen} (measured here, in one-row passes: {measured}; the largest at most "
                    f"{AUTO_BOUND:g})")
