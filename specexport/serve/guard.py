"""What every request passes before a route sees it (a plain ASGI middleware): the API key, the body's
size, and that a JSON route's body is UTF-8 JSON holding an object. Each refusal is one response in
OpenAI's error shape naming what was wrong: 401 (no or a wrong key), 413 (the body is larger than
`max_body_bytes`), 400 (not UTF-8, not JSON, not an object). Every response is counted in the
metrics by route and status.

The key: `Authorization: Bearer KEY`, compared in constant time (hmac.compare_digest of SHA-256
digests, so neither the content nor the length leaks through timing). /health stays open (load
balancers and orchestrators probe it without credentials).

Without a key, a web page the user visits could reach a loopback server: by DNS rebinding (a name of the
page's that now points at 127.0.0.1: its Host header is that name) or by a cross-site POST (a "simple"
text/plain request a browser sends without asking; it carries an Origin header). So a keyless server on
loopback answers only Host headers that are loopback names, and any keyless server refuses a request whose
Origin is another site's (403). Clients that are not browsers (curl, the openai client) send no Origin.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from specexport.serve.net import is_loopback
from specexport.serve.protocol import error_body

OPEN_PATHS = frozenset({"/health"})
JSON_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DRAIN_LIMIT = 64 * 2 ** 20      # an oversized body is read (and dropped) up to this, so the client sees the 413


@dataclass(frozen=True)
class Limits:
    """The server's limits (`specexport serve` flags in brackets)."""
    max_body_bytes: int = 4 * 2 ** 20           # a request body larger than this: 413 [--max-body-bytes]
    max_queue: int = 64                         # requests waiting behind the running ones; more: 429 [--max-queue]
    request_timeout_s: float | None = 300.0     # arrival -> done, queue included; later: 504 [--request-timeout]
    shutdown_grace_s: float = 20.0              # SIGTERM: finish within this, then stop what runs [--shutdown-grace]
    max_batch: int | str = "auto"               # requests decoding together; auto: measured [--max-batch]
                                                # (checked once, where the worker decides it: runtime/batch.py)

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes: expected >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue: expected >= 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s: expected > 0 (or None: no deadline)")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s: expected >= 0")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _host_of(value: str) -> str:
    """A Host header's or an Origin's host, without port or scheme."""
    try:
        return urlsplit(value if "//" in value else f"//{value}").hostname or ""
    except ValueError:
        return ""


class Guard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, metrics=None, loopback: bool = False):
        """loopback: the server listens on loopback only (then, keyless, it answers loopback Host names only)."""
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self._digest = key_digest(api_key) if api_key else None
        self.loopback = loopback

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def counted(message):
            if message["type"] == "http.response.start" and self.metrics is not None:
                self.metrics.response(path, message["status"])
            await send(message)

        headers = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        if self._digest is not None and path not in OPEN_PATHS:
            problem = self._key_problem(headers.get(b"authorization"))
            if problem:
                return await _reply(counted, 401, error_body(problem, code="invalid_api_key"),
                                    [(b"www-authenticate", b'Bearer realm="specexport"')])
        if self._digest is None:
            problem = self._site_problem(headers)
            if problem:
                return await _reply(counted, 403, error_body(problem, code="forbidden"))
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE") and b"content-length" not in headers \
                and b"transfer-encoding" not in headers:
            return await self.app(scope, receive, counted)

        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _reply(counted, 400, error_body("Content-Length: not an integer"))
            if declared > self.max_body_bytes:
                if headers.get(b"expect", b"").lower() != b"100-continue":      # else the client has not sent it
                    await _drain(receive, min(declared, DRAIN_LIMIT))
                return await _reply(counted, 413, self._too_large(f"{declared} bytes"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                                           # the client left while sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                if message.get("more_body"):
                    await _drain(receive, DRAIN_LIMIT - size)
                return await _reply(counted, 413, self._too_large(f"more than {self.max_body_bytes} bytes"))
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)

        if path in JSON_PATHS and scope.get("method") == "POST":
            problem = _json_problem(body)
            if problem:
                return await _reply(counted, 400, error_body(problem, code="invalid_json"))
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                     + [(b"content-type", b"application/json")]}    # JSON whatever it was labelled (curl -d)

        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()                                # then: the disconnect, when it comes

        return await self.app(scope, replay, counted)

    def _key_problem(self, header: bytes | None) -> str | None:
        if not header:
            return ("missing API key: this server needs 'Authorization: Bearer KEY' (the key it was started "
                    "with, --api-key or SPECEXPORT_API_KEY)")
        scheme, _, token = header.decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the Authorization header must be 'Bearer KEY'"
        if not hmac.compare_digest(key_digest(token.strip()), self._digest):
            return "incorrect API key provided"
        return None

    def _site_problem(self, headers: dict) -> str | None:
        """Why a keyless server refuses this request's Host or Origin (the module's docstring), or None."""
        host = _host_of(headers.get(b"host", b"").decode("latin-1"))
        if self.loopback and not is_loopback(host):
            return (f"Host {host or '(none)'!r}: this server listens on loopback without an API key and answers "
                    "loopback names only (localhost, 127.0.0.1, [::1]); start it with --api-key to serve others")
        origin = headers.get(b"origin")
        if origin is not None and origin.decode("latin-1") != "null":
            site = _host_of(origin.decode("latin-1"))
            if not (is_loopback(site) or site == host):
                return (f"Origin {origin.decode('latin-1')!r}: a page of another site may not use this server "
                        "without an API key (start it with --api-key)")
        elif origin is not None:
            return "Origin 'null': a sandboxed page may not use this server without an API key"
        return None

    def _too_large(self, size: str) -> dict:
        return error_body(f"the request body is {size}; this server accepts at most {self.max_body_bytes} bytes "
                          f"(--max-body-bytes)", code="request_too_large")


def _json_problem(body: bytes) -> str | None:
    """What is wrong with a JSON route's body, or None."""
    if not body.strip():
        return "the request body is empty; expected a JSON object"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"the request body is not valid UTF-8 (byte {err.start}: {err.reason})"
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        return f"the request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
    except (ValueError, RecursionError) as err:
        return f"the request body is not valid JSON: {str(err) or type(err).__name__}"
    if not isinstance(value, dict):
        return f"the request body must be a JSON object, got {_json_kind(value)}"
    where = _surrogate_at(value)
    if where is not None:
        return (f"{where or 'a key'}: a lone surrogate (an unpaired \\ud800-\\udfff escape) is not a character; "
                "the text must be valid Unicode")
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def _surrogate_at(value, path: str = ""):
    """The dotted path of the first string (or key) holding a lone surrogate, or None. Iterative: the body's
    depth is bounded by the parser, not by this walk."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if any("\ud800" <= c <= "\udfff" for c in v):
                return at
        elif isinstance(v, dict):
            for k, x in v.items():
                if any("\ud800" <= c <= "\udfff" for c in k):
                    return f"{at}.{k.encode('utf-8', 'backslashreplace').decode()}".lstrip(".")
                stack.append((x, f"{at}.{k}".lstrip(".")))
        elif isinstance(v, list):
            stack.extend((x, f"{at}.{i}".lstrip(".")) for i, x in enumerate(v))
    return None


def _json_kind(value) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


async def _drain(receive, limit: int) -> None:
    """Read and drop up to `limit` bytes of the body still coming, so the client reads the answer."""
    seen = 0
    while seen < limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body"):
            return


async def _reply(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})
