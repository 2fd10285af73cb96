"""One loaded model, decoding up to `max_batch` requests at a time, each on a thread of its own.

Requests queue (FIFO) on an executor of max_batch threads; with max_batch > 1 the running ones decode
together, every round of each in one target pass (runtime/batch.py), each answer its batch-1 answer. The
event loop only waits on each job's asyncio queue, which the decode threads fill through
call_soon_threadsafe.
ONNX Runtime releases the GIL while it runs, so the server keeps answering (/health, new requests,
other streams) during a decode. A job whose client went away is cancelled: a queued one never
starts (and leaves the queue at once), a running one stops after the piece being decoded (one
speculative round at most) and frees the model.

Limits: at most `max_queue` jobs wait behind the running one (a further submit is refused with a 429
and a Retry-After estimated from recent decode times); a job past its deadline is stopped the same way
as a cancelled one and answered 504; once `drain(grace_s)` is called (graceful shutdown: the server
has stopped listening, so what still arrives was on its way) the jobs still queued or running when the
grace period ends are stopped, and any submitted after it refused (503).
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specexport.errors import SpecexportError
from specexport.runtime.batch import AUTO, batch_width
from specexport.runtime.methods import default_note
from specexport.runtime.request import TextStream
from specexport.serve.protocol import RequestError

log = logging.getLogger("specexport.serve")


@dataclass
class Event:
    kind: str                   # "text" | "done" | "error" | "cancelled"
    text: str = ""
    output: object = None       # GenerationOutput, with "done"
    method: str = ""            # what decoded it, with "done" (auto resolved to the method it chose)
    note: str = ""              # with "done" under auto: what it chose and why
    status: int = 0             # HTTP status, with "error"
    code: str | None = None     # OpenAI's error code, with "error"


@dataclass
class Job:
    prompt_ids: list[int]
    options: dict               # Pipeline.stream keyword arguments
    loop: asyncio.AbstractEventLoop
    stream: bool = True         # False: only the final event (nobody reads the pieces)
    deadline: float | None = None                        # time.monotonic() by which it must be done
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    state: str = "queued"       # queued | running | left (cancelled while queued) | finished
    reason: str = ""            # why it was cancelled (see cancel)
    worker: object = None

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the job (queued: it never starts; running: after the current piece). `reason` is its outcome
        in the metrics: cancelled (the client left or the answer is complete), timeout, shutdown."""
        if not self.cancelled.is_set():
            self.reason = reason
        self.cancelled.set()
        if self.worker is not None:
            self.worker._left(self)

    def expired(self) -> RequestError | None:
        """The error that ends this job now, if its deadline or the shutdown grace period has passed."""
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            return deadline_error(self.worker.request_timeout_s if self.worker else None, now - self.arrived)
        drain = self.worker.drain_deadline if self.worker is not None else None
        if drain is not None and now >= drain:
            return shutting_down(f"the grace period ({self.worker.grace_s:g} s) ended before this request finished")
        return None

    def time_left(self) -> float | None:
        """Seconds until expired() is an error (None: no limit)."""
        ends = [t for t in (self.deadline, self.worker.drain_deadline if self.worker else None) if t is not None]
        return min(ends) - time.monotonic() if ends else None


def deadline_error(timeout_s: float | None, elapsed_s: float) -> RequestError:
    return RequestError(f"the request did not finish within the server's deadline of {timeout_s:g} s "
                        f"(--request-timeout; {elapsed_s:.1f} s elapsed, queue included); ask for fewer tokens "
                        f"or retry when the server is less busy", status=504, kind="server_error", code="timeout")


def shutting_down(why: str = "it no longer accepts requests") -> RequestError:
    return RequestError(f"the server is shutting down: {why}", status=503, kind="server_error",
                        code="shutting_down")


class ModelWorker:
    def __init__(self, pipe, *, method: str = "auto", max_queue: int = 64, request_timeout_s: float | None = None,
                 metrics=None, max_batch: int | str = AUTO):
        self.pipe = pipe
        self.default_method, self.method_note = method, default_note(pipe.view(), method)   # each request resolves it
        self.max_queue, self.request_timeout_s, self.metrics = max_queue, request_timeout_s, metrics
        width = batch_width(pipe, max_batch)                # decided once, here, and handed to the Batch
        self.max_batch, self.batch_note = width.max_batch, width.note   # requests decoding together
        self.batch = pipe.batch(width) if self.max_batch > 1 else None
        if metrics is not None:
            metrics.watch_batch(self.max_batch, lambda: self.running)
            if self.batch is not None:
                self.batch.observer = metrics.batch_pass
        self._executor = ThreadPoolExecutor(max_workers=self.max_batch, thread_name_prefix="specexport-decode")
        self._lock = threading.Lock()
        self.waiting = 0            # queued jobs
        self.running = 0            # decoding jobs (up to max_batch)
        self.drain_deadline: float | None = None             # set by drain(): time.monotonic() the grace ends
        self.grace_s = 0.0
        self._service_s = 0.0       # moving average of a job's decode time (for Retry-After)

    @property
    def pending(self) -> int:
        """Queued or running jobs."""
        return self.waiting + self.running

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def submit(self, prompt_ids: list[int], options: dict, *, stream: bool = True, arrived: float | None = None) -> Job:
        """Queue a job, or raise RequestError: 429 (the queue is full) or 503 (shutting down)."""
        job = Job(prompt_ids, options, asyncio.get_running_loop(), stream=stream, worker=self)
        if arrived is not None:
            job.arrived = arrived
        if self.request_timeout_s:
            job.deadline = job.arrived + self.request_timeout_s
        with self._lock:
            if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
                raise shutting_down()       # (during the grace period: requests that were on their way when it began)
            if self.pending >= self.max_queue + self.max_batch:
                raise RequestError(
                    f"the server is busy: {self.waiting} requests are waiting for the model (--max-queue "
                    f"{self.max_queue}); retry after the Retry-After seconds", status=429, kind="rate_limit_error",
                    code="queue_full", headers={"Retry-After": str(self.retry_after())})
            self.waiting += 1
        self._executor.submit(self._run, job)
        return job

    def retry_after(self) -> int:
        """Whole seconds until the queue has likely room again (1..60)."""
        return int(min(60, max(1, math.ceil(self._service_s))))

    def drain(self, grace_s: float) -> None:
        """Graceful shutdown: refuse new jobs; stop those not finished `grace_s` seconds from now."""
        with self._lock:
            if self.drain_deadline is None:
                self.grace_s = grace_s
                self.drain_deadline = time.monotonic() + grace_s

    def close(self) -> None:
        with self._lock:
            if self.drain_deadline is None:
                self.drain_deadline = time.monotonic()       # stop what still runs
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.pipe.close()

    def _left(self, job: Job) -> None:
        """A queued job's client went away: it leaves the queue now (the executor skips it later)."""
        with self._lock:
            if job.state == "queued":
                job.state = "left"
                self.waiting -= 1
                if self.metrics is not None:
                    self.metrics.decodes.labels(job.reason or "cancelled").inc()

    def _run(self, job: Job) -> None:
        with self._lock:
            if job.state != "queued":
                return
            job.state, self.waiting, self.running = "running", self.waiting - 1, self.running + 1
        started = time.monotonic()
        outcome, event = "error", None
        try:
            if self.metrics is not None:
                self.metrics.queue_time.observe(started - job.arrived)
            event = self._decode(job)
            outcome = {"done": "done", "cancelled": job.reason or "cancelled"}.get(event.kind) or {
                504: "timeout", 503: "shutdown"}.get(event.status, "error")
        except SpecexportError as err:               # bad parameters for this build: the client's error
            outcome = "invalid"
            event = Event("error", text=str(err), status=400)
        except Exception:                            # a bug: logged, answered as 500, the server stays up
            ref = uuid.uuid4().hex[:12]
            log.exception("decode failed (internal error %s)", ref)
            event = Event("error", text=f"internal error (logged as {ref})", status=500)
        finally:
            ended = time.monotonic()
            with self._lock:
                job.state, self.running = "finished", self.running - 1
                self._service_s = 0.8 * self._service_s + 0.2 * (ended - started) if self._service_s else ended - started
            if self.metrics is not None and outcome != "done":
                self.metrics.decodes.labels(outcome).inc()
            if event is not None:                    # last: a client that has its answer sees the metrics count it
                job.emit(event)

    def _decode(self, job: Job) -> Event:
        if job.cancelled.is_set():
            return Event("cancelled")
        if (err := job.expired()) is not None:
            return Event("error", text=str(err), status=err.status, code=err.code)
        options = dict(job.options)
        method = options.pop("method", None) or self.default_method
        if self.batch is not None:
            request = self.batch.request(prompt_ids=job.prompt_ids, method=method, **options)
            stream = TextStream(lambda done: self.batch.stream(request, done=done))
        else:                   # without a batch the executor has one thread: one request at a time on the pipeline
            stream = self.pipe.stream(prompt_ids=job.prompt_ids, method=method, **options)
        return self._pieces(job, stream)

    def _pieces(self, job: Job, stream: TextStream) -> Event:
        """Run a decode's pieces into the job's events; the stream's output at the end."""
        first = None
        try:
            for piece in stream:
                if first is None:
                    first = time.monotonic()
                if job.cancelled.is_set():
                    return Event("cancelled")
                if (err := job.expired()) is not None:
                    return Event("error", text=str(err), status=err.status, code=err.code)
                if job.stream:
                    job.emit(Event("text", text=piece))
        finally:
            stream.close()
        output = stream.output
        if self.metrics is not None:
            self.metrics.finished(output=output, prompt_tokens=len(job.prompt_ids), arrived=job.arrived,
                                  first_token=first, ended=time.monotonic())
        return Event("done", output=output, method=output.method, note=output.note)
