"""The HTTP app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions (plain and streamed as
server-sent events), /health and /metrics (Prometheus), on one loaded Pipeline.

    app = create_app(specexport.load("engines/demo"), method="auto", api_key="sk-...", limits=Limits())
    uvicorn.run(app, host="127.0.0.1", port=8000)          # `specexport serve` adds the graceful shutdown

Every response carries `usage` and, as an extension, `specexport`: the method that decoded it, tokens
per target pass, acceptance rate, target passes, TTFT and decode tokens/s. Errors use OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 for a bad request (422 is not used), 401 for a
missing or wrong API key, 404 for an unknown model name or path, 413 for a body over the limit, 429
(with Retry-After) when the queue is full, 503 while shutting down, 504 past the request deadline,
500 for a bug (logged; the server stays up).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid

from specexport._optional import require
from specexport.chat import load_chat_template
from specexport.serve.guard import Guard, Limits, is_loopback
from specexport.serve.metrics import CONTENT_TYPE, Metrics
from specexport.serve.protocol import ChatRequest, CompletionRequest, ErrorResponse, RequestError, error_body
from specexport.serve.worker import Event, ModelWorker

fastapi = require("fastapi")          # the [serve] extra; a missing one names it
Request = fastapi.Request               # module level: FastAPI resolves the handlers' annotations here
run_in_threadpool = require("starlette.concurrency").run_in_threadpool
log = logging.getLogger("specexport.serve")

POLL_S = 0.25          # how often a waiting non-streamed request checks that its client is still there

_ERROR = {"model": ErrorResponse}
ERRORS = {400: {**_ERROR, "description": "A bad request (also malformed JSON, and what the runtime cannot do)"},
          401: {**_ERROR, "description": "No API key, or a wrong one (when the server has a key)"},
          404: {**_ERROR, "description": "An unknown model name"},
          413: {**_ERROR, "description": "The request body is larger than --max-body-bytes"},
          429: {**_ERROR, "description": "The queue is full (--max-queue); see Retry-After"},
          500: {**_ERROR, "description": "A bug (logged)"},
          503: {**_ERROR, "description": "The server is shutting down"},
          504: {**_ERROR, "description": "The request passed its deadline (--request-timeout)"}}
AUTH_ERRORS = {k: ERRORS[k] for k in (401, 500)}
COMPLETION_RESPONSES = {200: {"description": "The completion (JSON), or with `stream: true` its chunks as "
                                             "server-sent events", "content": {"text/event-stream": {}}}, **ERRORS}


def create_app(pipe, *, method: str = "auto", name: str | None = None, api_key: str | None = None,
               limits: Limits | None = None, host: str = "127.0.0.1"):
    """host: where the server listens (a keyless one on loopback answers loopback Host names only: guard.py)."""
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    limits = limits or Limits()
    metrics = Metrics()
    worker = ModelWorker(pipe, method=method, max_queue=limits.max_queue, request_timeout_s=limits.request_timeout_s,
                         metrics=metrics, max_batch=limits.max_batch)
    metrics.queue_depth.set_function(lambda: worker.waiting)
    metrics.running.set_function(lambda: worker.running)
    metrics.watch_suffix_cache(lambda: pipe._suffix_cache)
    name = name or pipe.manifest.get("name") or pipe.dir.name
    chat_template = load_chat_template(pipe.dir / pipe.manifest["tokenizer"]["dir"])

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    app = fastapi.FastAPI(title="specexport", lifespan=lifespan)
    app.state.worker, app.state.model_name, app.state.metrics, app.state.limits = worker, name, metrics, limits
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, metrics=metrics,
                       loopback=is_loopback(host))

    _add_error_handlers(app)

    @app.get("/health", responses={503: {"description": "Shutting down"}})
    async def health():
        body = {"status": "draining" if worker.draining else "ok", "model": name, "pending": worker.pending}
        return JSONResponse(body, status_code=503 if worker.draining else 200)

    @app.get("/metrics", response_class=PlainTextResponse, responses=AUTH_ERRORS)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=AUTH_ERRORS)
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(pipe.dir.stat().st_mtime), "owned_by": "specexport",
            "specexport": {"methods": ["auto", *pipe.methods], "default_method": worker.default_method,
                           "precision": pipe.precision, "max_seq_len": pipe.capacity}}]}

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        arrived = time.monotonic()
        _check_model(body.model, name)
        # tokenizing a body of up to --max-body-bytes is CPU work: off the event loop, which serves everyone
        ids = await run_in_threadpool(_prompt_ids, pipe, body.prompt, param="prompt")
        return await _respond(app, body, request, ids, max_new=body.max_tokens, chat=False, arrived=arrived)

    @app.post("/v1/chat/completions", responses=COMPLETION_RESPONSES)
    async def chat_completions(body: ChatRequest, request: Request):
        arrived = time.monotonic()
        _check_model(body.model, name)
        if chat_template is None:
            raise RequestError(f"messages: the model {name!r} has no chat template (its tokenizer defines none); "
                               f"use /v1/completions", param="messages")

        def chat_ids() -> list[int]:
            text = chat_template.render(body.rendered_messages())
            return pipe.tokenizer.encode(text, add_special_tokens=False).ids

        ids = await run_in_threadpool(chat_ids)
        _check_length(pipe, ids, param="messages")
        max_new = body.max_completion_tokens or body.max_tokens or pipe.capacity - len(ids)
        return await _respond(app, body, request, ids, max_new=max_new, chat=True, arrived=arrived)

    return app


def _add_error_handlers(app) -> None:
    """Every error in OpenAI's shape: a body that fails validation (naming its field), a request refused, an
    unknown path or method, and a bug (its details logged, never sent)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err):
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":     # the guard catches these first; kept for safety
            return JSONResponse(error_body("the request body is not valid JSON", code="invalid_json"), status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        loc = tuple(first.get("loc", ()))
        tag_at = next((i for i, p in enumerate(loc) if _union_tag(p)), None)
        if tag_at is not None:                      # a Union field: name the forms it accepts
            forms = list(dict.fromkeys(str(e["loc"][tag_at]) for e in err.errors()
                                       if tuple(e.get("loc", ()))[:tag_at] == loc[:tag_at] and len(e["loc"]) > tag_at))
            message = f"expected one of: {', '.join(forms)}"
        if not where and ":" in message and message.split(":")[0].isidentifier():
            where = message.split(":")[0]           # a whole-body check names its field first
        return JSONResponse(error_body(f"{where}: {message}" if where and not message.startswith(where) else message,
                                       param=where or None), status_code=400)

    @app.exception_handler(RequestError)
    async def _refused(request, err: RequestError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)

    @app.exception_handler(HTTPException)
    async def _http(request, err: HTTPException):       # unknown paths and methods, in OpenAI's shape
        what = {404: f"no such path: {request.url.path}",
                405: f"method {request.method} is not allowed on {request.url.path}"}.get(err.status_code, err.detail)
        return JSONResponse(error_body(str(what), code={404: "not_found", 405: "method_not_allowed"}.get(err.status_code)),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request, err):           # the details go to the log, never to the client
        ref = uuid.uuid4().hex[:12]
        log.error("internal error %s on %s %s", ref, request.method, request.url.path, exc_info=err)
        return JSONResponse(error_body(f"internal error (logged as {ref})", kind="server_error"), status_code=500)


async def _respond(app, body, request, ids: list[int], *, max_new: int, chat: bool, arrived: float):
    """Submit a completion to the worker; its answer whole, or streamed (server-sent events)."""
    from fastapi.responses import Response, StreamingResponse

    worker, name, pipe = app.state.worker, app.state.model_name, app.state.worker.pipe
    if body.method not in (None, "auto", "vanilla", *pipe.methods):
        raise RequestError(f"method: {body.method!r} is not available; available: "
                           f"{', '.join(('auto', 'vanilla', *pipe.methods))}", param="method")
    job = worker.submit(ids, body.stream_kwargs(max_new), stream=body.stream, arrived=arrived)
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": name}
    try:
        first = await _next_event(job, request)
    except ClientGone:
        return Response(status_code=499)        # nobody reads it; the model is already free
    except BaseException:
        job.cancel()
        raise
    if first.kind == "error":
        job.cancel()
        raise RequestError(first.text, status=first.status, code=first.code,
                           kind="invalid_request_error" if first.status == 400 else "server_error")
    if not body.stream:
        event = first
        try:
            while event.kind == "text":
                event = await _next_event(job, request)
        except ClientGone:
            return Response(status_code=499)
        finally:
            job.cancel()
        if event.kind == "error":
            raise RequestError(event.text, status=event.status, kind="server_error", code=event.code)
        if event.kind != "done":                # cancelled: only when its client went away
            return Response(status_code=499)
        return _full_response(meta, event, len(ids), chat)
    return StreamingResponse(_sse(job, first, meta, prompt_tokens=len(ids), chat=chat,
                                  include_usage=body.include_usage),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class ClientGone(Exception):
    """The client disconnected while its request waited or decoded."""


async def _next_event(job, request=None) -> Event:
    """The job's next event; cancels the job and raises ClientGone if the client disconnects meanwhile
    (checked when `request` is given), or the RequestError (504, 503) of its deadline or the shutdown."""
    while True:
        left = job.time_left()
        if left is not None and left <= 0:
            err = job.expired() or RequestError("the request passed its deadline", status=504, kind="server_error",
                                                code="timeout")
            job.cancel("timeout" if err.status == 504 else "shutdown")
            raise err
        try:
            return await asyncio.wait_for(job.events.get(), POLL_S if left is None else min(POLL_S, left + 0.001))
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                job.cancel()
                raise ClientGone from None


async def _sse(job, first: Event, meta: dict, *, prompt_tokens: int, chat: bool, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict, **extra) -> str:
        return f"data: {json.dumps({**meta, 'object': kind, 'choices': [choice] if choice else [], **extra})}\n\n"

    def piece(text: str) -> dict:
        return ({"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None} if chat else
                {"index": 0, "text": text, "finish_reason": None, "logprobs": None})

    try:
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                         "logprobs": None})
        event = first
        while event.kind == "text":
            text = event.text
            while not job.events.empty():           # pieces that queued while the last one was sent:
                event = job.events.get_nowait()     # one chunk (a slow client gets fewer, larger ones)
                if event.kind != "text":
                    break
                text += event.text
            else:
                event = None
            yield chunk(piece(text))
            if event is None:
                try:
                    event = await _next_event(job)
                except RequestError as err:         # the deadline or the shutdown, mid-stream
                    event = Event("error", text=str(err), status=err.status, code=err.code)
        if event.kind == "done":
            end = piece("")
            end["finish_reason"] = event.output.finish_reason
            if chat:
                end["delta"] = {}
            usage = _usage(prompt_tokens, event.output)
            yield chunk(end, usage=usage, specexport=_stats(event))
            if include_usage:
                yield chunk({}, usage=usage)
        elif event.kind == "error":
            yield f"data: {json.dumps(error_body(event.text, kind='server_error', code=event.code))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()                # the client went away mid-stream (or we are done): free the model


def _full_response(meta: dict, event: Event, prompt_tokens: int, chat: bool) -> dict:
    out = event.output
    choice = ({"index": 0, "message": {"role": "assistant", "content": out.text}} if chat else
              {"index": 0, "text": out.text})
    choice.update(finish_reason=out.finish_reason, logprobs=None)
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": _usage(prompt_tokens, out), "specexport": _stats(event)}


def _usage(prompt_tokens: int, out) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
            "total_tokens": prompt_tokens + len(out.token_ids)}


def _stats(event: Event) -> dict:
    s = event.output.stats

    def number(x):
        return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), 4)

    return {"method": event.method, **({"auto": event.note} if event.note else {}), "tokens_per_target_pass": number(s.mean_accepted_tokens),
            "acceptance_rate": number(s.acceptance_rate), "target_passes": s.target_passes,
            "ttft_s": number(s.ttft_s), "tokens_per_second": number(s.tokens_per_second),
            **({"suffix": {k: number(v) if isinstance(v, float) else v for k, v in s.proposer.items()}}
               if event.method == "suffix" and s.proposer else {})}


def _union_tag(part) -> bool:
    """pydantic's name for a member of a Union in an error's location ('str', 'list[int]', ...), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none", "list", "dict")
                                      or "[" in part or part.startswith("function-"))


def _check_model(requested: str | None, name: str) -> None:
    if requested not in (None, name):
        raise RequestError(f"model: {requested!r} is not served here; this server serves {name!r}", param="model",
                           status=404, code="model_not_found")


def _prompt_ids(pipe, prompt, *, param: str) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = list(prompt)
        vocab = pipe.manifest["models"]["target"]["vocab_size"]
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"{param}: token ids must be in 0..{vocab - 1}", param=param)
    else:
        text = prompt[0] if isinstance(prompt, list) else prompt
        if not isinstance(text, str):
            raise RequestError(f"{param}: expected a string, a list of strings or a list of token ids", param=param)
        ids = pipe.tokenizer.encode(text).ids     # once, as generate() feeds it; too long: said below
    _check_length(pipe, ids, param=param)
    return ids


def _check_length(pipe, ids: list[int], *, param: str) -> None:
    if not ids:
        raise RequestError(f"{param}: empty (no tokens)", param=param)
    if len(ids) >= pipe.capacity:
        raise RequestError(f"{param}: {len(ids)} tokens leave no room to generate within the model's "
                           f"max_seq_len {pipe.capacity} (at most {pipe.capacity - 1})", param=param,
                           code="context_length_exceeded")
