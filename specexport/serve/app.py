"""The HTTP app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions (plain and streamed as
server-sent events), and /health, on one loaded Pipeline.

    app = create_app(specexport.load("engines/demo"), method="auto")
    uvicorn.run(app, host="127.0.0.1", port=8000)              # what `specexport serve` does

Every response carries `usage` and, as an extension, `specexport`: the method that decoded it, tokens
per target pass, acceptance rate, target passes, TTFT and decode tokens/s. Errors use OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with 400 for a bad request (422 is not used), 404
for an unknown model name, 500 for a bug (logged; the server stays up).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.chat import load_chat_template
from specexport.serve.protocol import ChatRequest, CompletionRequest, RequestError, error_body
from specexport.serve.worker import Event, ModelWorker

fastapi = require("fastapi")          # the [serve] extra; a missing one names it
Request = fastapi.Request               # module level: FastAPI resolves the handlers' annotations here

POLL_S = 0.25          # how often a waiting non-streamed request checks that its client is still there


def create_app(pipe, *, method: str = "auto", name: str | None = None):
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    worker = ModelWorker(pipe, method=method)
    name = name or pipe.manifest.get("name") or pipe.dir.name
    chat_template = load_chat_template(pipe.dir / pipe.manifest["tokenizer"]["dir"])

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    app = fastapi.FastAPI(title="specexport", lifespan=lifespan)
    app.state.worker, app.state.model_name = worker, name

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err):
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if not where and ":" in message and message.split(":")[0].isidentifier():
            where = message.split(":")[0]           # a whole-body check names its field first
        return JSONResponse(error_body(f"{where}: {message}" if where and not message.startswith(where) else message,
                                       param=where or None), status_code=400)

    @app.exception_handler(RequestError)
    async def _refused(request, err: RequestError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def _bug(request, err):
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", kind="server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "pending": worker.pending}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(pipe.dir.stat().st_mtime), "owned_by": "specexport",
            "specexport": {"methods": ["auto", *pipe.methods], "default_method": worker.default_method,
                           "precision": pipe.precision, "max_seq_len": pipe.capacity}}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, name)
        ids = _prompt_ids(pipe, body.prompt, param="prompt")
        return await _respond(body, request, ids, max_new=body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        _check_model(body.model, name)
        if chat_template is None:
            raise RequestError(f"messages: the model {name!r} has no chat template (its tokenizer defines none); "
                               f"use /v1/completions", param="messages")
        text = chat_template.render(body.rendered_messages())
        ids = pipe.tokenizer.encode(text, add_special_tokens=False).ids
        _check_length(pipe, ids, param="messages")
        max_new = body.max_completion_tokens or body.max_tokens or pipe.capacity - len(ids)
        return await _respond(body, request, ids, max_new=max_new, chat=True)

    async def _respond(body, request, ids: list[int], *, max_new: int, chat: bool):
        if body.method not in (None, "auto", "vanilla", *pipe.methods):
            raise RequestError(f"method: {body.method!r} is not available; available: "
                               f"{', '.join(('auto', 'vanilla', *pipe.methods))}", param="method")
        job = worker.submit(ids, body.stream_kwargs(max_new), stream=body.stream)
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
            raise RequestError(first.text, status=first.status,
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
                raise RequestError(event.text, status=event.status, kind="server_error")
            if event.kind != "done":                # cancelled: only when its client went away
                return Response(status_code=499)
            return _full_response(meta, event, len(ids), chat)
        return StreamingResponse(_sse(job, first, meta, len(ids), chat, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


class ClientGone(Exception):
    """The client disconnected while its request waited or decoded."""


async def _next_event(job, request) -> Event:
    """The job's next event; cancels the job (and raises ClientGone) if the client disconnects meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone from None


async def _sse(job, first: Event, meta: dict, prompt_tokens: int, chat: bool, include_usage: bool):
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
                event = await job.events.get()
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
            yield f"data: {json.dumps(error_body(event.text, kind='server_error'))}\n\n"
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
            "ttft_s": number(s.ttft_s), "tokens_per_second": number(s.tokens_per_second)}


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
        try:
            ids = pipe.encode(text)
        except SpecexportError as err:
            raise RequestError(str(err), param=param) from None
    _check_length(pipe, ids, param=param)
    return ids


def _check_length(pipe, ids: list[int], *, param: str) -> None:
    if not ids:
        raise RequestError(f"{param}: empty (no tokens)", param=param)
    if len(ids) >= pipe.capacity:
        raise RequestError(f"{param}: {len(ids)} tokens leave no room to generate within the model's "
                           f"max_seq_len {pipe.capacity} (at most {pipe.capacity - 1})", param=param,
                           code="context_length_exceeded")
