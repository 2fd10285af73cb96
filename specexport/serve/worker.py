"""One loaded model, decoding one request at a time on its own thread.

The runtime is batch 1, so requests queue (FIFO) on a single-thread executor; the event loop only
waits on each job's asyncio queue, which the decode thread fills through call_soon_threadsafe.
ONNX Runtime releases the GIL while it runs, so the server keeps answering (/health, new requests,
other streams) during a decode. A job whose client went away is cancelled: a queued one never
starts, a running one stops after the piece being decoded (one speculative round at most) and
frees the model.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specexport.errors import SpecexportError
from specexport.gamma import lookup as lookup_choice

log = logging.getLogger("specexport.serve")


@dataclass
class Event:
    kind: str                   # "text" | "done" | "error" | "cancelled"
    text: str = ""
    output: object = None       # GenerationOutput, with "done"
    method: str = ""            # what decoded it, with "done" (auto resolved to the method it chose)
    note: str = ""              # with "done" under auto: what it chose and why
    status: int = 0             # HTTP status, with "error"


@dataclass
class Job:
    prompt_ids: list[int]
    options: dict               # Pipeline.stream keyword arguments
    loop: asyncio.AbstractEventLoop
    stream: bool = True         # False: only the final event (nobody reads the pieces)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


class ModelWorker:
    def __init__(self, pipe, *, method: str = "auto"):
        self.pipe = pipe
        self.default_method, self.method_note = resolve_default_method(pipe, method)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specexport-decode")
        self._lock = threading.Lock()
        self.pending = 0            # queued or running jobs

    def submit(self, prompt_ids: list[int], options: dict, *, stream: bool = True) -> Job:
        job = Job(prompt_ids, options, asyncio.get_running_loop(), stream=stream)
        with self._lock:
            self.pending += 1
        self._executor.submit(self._run, job)
        return job

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.pipe.close()

    def _run(self, job: Job) -> None:
        try:
            job.emit(self._decode(job))
        except SpecexportError as err:               # bad parameters for this build: the client's error
            job.emit(Event("error", text=str(err), status=400))
        except Exception as err:                     # a bug: logged, answered as 500, the server stays up
            log.exception("decode failed")
            job.emit(Event("error", text=f"internal error: {type(err).__name__}: {err}", status=500))
        finally:
            with self._lock:
                self.pending -= 1

    def _decode(self, job: Job) -> Event:
        if job.cancelled.is_set():
            return Event("cancelled")
        options = dict(job.options)
        method = options.pop("method", None) or self.default_method
        self.pipe.auto_note = None
        stream = self.pipe.stream(prompt_ids=job.prompt_ids, method=method, **options)
        try:
            for piece in stream:
                if job.cancelled.is_set():
                    return Event("cancelled")
                if job.stream:
                    job.emit(Event("text", text=piece))
        finally:
            stream.close()
        used = self._auto_choice()["method"] if method == "auto" else method
        return Event("done", output=self.pipe.last_output, method=used,
                     note=(self.pipe.auto_note or "") if method == "auto" else "")

    def _auto_choice(self) -> dict:
        return auto_choice(self.pipe) or {"method": "vanilla"}


def auto_choice(pipe) -> dict | None:
    """The configuration `specexport bench` stored for the pipeline's precisions, if any."""
    dp = pipe.draft_precision if "draft" in pipe.manifest["models"] else "-"
    return lookup_choice(pipe.manifest, pipe.precision, dp, section="method_auto")


def resolve_default_method(pipe, method: str) -> tuple[str, str]:
    """(the method requests get by default, a line saying why). `auto` without a measured choice in the
    build decodes vanilla (and says to run `specexport bench`) rather than refusing every request."""
    if method != "auto":
        if method != "vanilla" and method not in pipe.methods:
            raise SpecexportError(f"--method: {method!r} is not available in {pipe.dir}; available: "
                                  f"{', '.join(('auto', 'vanilla', *pipe.methods))}")
        return method, f"method {method}"
    choice = auto_choice(pipe)
    if choice is None:
        return "vanilla", (f"method auto: {pipe.dir} has no measured choice for target {pipe.precision!r}; "
                           f"serving vanilla (run `specexport bench {pipe.dir}` to measure one)")
    speed = f"{choice['speedup']:.2f}x" if choice.get("speedup") else "not measured"
    if choice["method"] == "vanilla":
        return "auto", f"method auto: vanilla, the bench measured every speculative configuration slower (best {speed})"
    return "auto", f"method auto: {choice['method']}, the bench's fastest ({speed} over vanilla)"
