"""`specexport serve`: an OpenAI-compatible HTTP server on the embedded runtime (the `[serve]` extra:
FastAPI, uvicorn, prometheus-client for /metrics; jinja2, for chat templates, is in the base install).

    app.py       the routes, the OpenAI response and stream shapes
    guard.py     the API key, the body limit, malformed bodies; the Limits
    metrics.py   the Prometheus metrics
    protocol.py  request bodies (pydantic), what is refused, the error shape
    worker.py    one model, one decode at a time on its own thread; the queue bound, deadlines, cancellation
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.serve.net import is_loopback

API_KEY_ENV = "SPECEXPORT_API_KEY"
SERVER_PACKAGES = ("fastapi", "pydantic", "uvicorn", "prometheus_client")     # the `serve` extra


def require_server() -> None:
    """The server's packages, named with their extra in one line before anything is loaded."""
    for name in SERVER_PACKAGES:
        require(name)


def serve(output_dir, *, host: str = "127.0.0.1", port: int = 8000, method: str = "auto", name: str | None = None,
          log_level: str = "info", api_key: str | None = None, limits=None, suffix_cache: str | None = None,
          **load_options) -> None:
    """Load the build and serve it until SIGTERM or Ctrl-C (then shut down gracefully: see make_server)."""
    require_server()
    import specexport
    from specexport.serve.app import create_app
    from specexport.serve.guard import Limits

    limits = limits or Limits()
    warning = bind_warning(host, port, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    pipe = specexport.load(output_dir, **load_options)
    if suffix_cache is not None:
        print(f"specexport serve: {open_suffix_cache(pipe, suffix_cache)}", file=sys.stderr, flush=True)
    app = create_app(pipe, method=method, name=name, api_key=api_key, limits=limits, host=host)
    worker = app.state.worker
    print(f"specexport serve: {app.state.model_name} ({pipe.dir}, target {pipe.precision}); {worker.method_note}; "
          f"{worker.batch_note}; "
          f"{pipe.thread_note}{'; ' + pipe.kernel_note if pipe.kernel_note else ''}"
          f"{'; API key required' if api_key else ''}", flush=True)
    server = make_server(app, host=host, port=port, log_level=log_level)
    # uvicorn re-raises the signal that stopped it once it is done, which would end the process with
    # SIGTERM's status; a graceful shutdown is a success: exit 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if suffix_cache is not None:
            print(f"specexport serve: {save_suffix_cache(pipe, suffix_cache)}", file=sys.stderr, flush=True)


def open_suffix_cache(pipe, path) -> str:
    """Give the pipeline the suffix cache saved at `path` (--suffix-cache); a missing file starts an
    empty one, a damaged or foreign one too (never a crash). Returns the line to print."""
    from specexport.runtime.suffix import SuffixCache

    tokens = pipe.suffix_cache.max_tokens
    if not Path(path).exists():
        return f"suffix cache: {path} does not exist yet; starting empty (saved there at shutdown)"
    try:
        pipe.suffix_cache = SuffixCache.load(path, tokens)
    except SpecexportError as err:
        return f"warning: {err}; starting with an empty suffix cache"
    stats = pipe.suffix_cache.stats()
    return f"suffix cache: {stats['tokens']:,} tokens of {stats['sequences']:,} answers from {path}"


def save_suffix_cache(pipe, path) -> str:
    """Write the pipeline's suffix cache to `path` atomically (SuffixCache.save refuses to overwrite a
    file it did not write). Returns the line to print."""
    try:
        pipe.suffix_cache.save(path)
    except SpecexportError as err:
        return f"warning: the suffix cache was not saved: {err}"
    return f"suffix cache: saved {pipe.suffix_cache.tokens:,} tokens to {path}"


def make_server(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **config):
    """A uvicorn.Server for an app of create_app() that shuts down gracefully: on SIGTERM (or Ctrl-C,
    or `server.handle_exit(signal.SIGTERM, None)`) it stops accepting connections, /health answers 503
    and a request that still arrives gets a 503; the requests queued or running may finish within the
    app's `limits.shutdown_grace_s`, after which they are stopped and answered 503 (a stream gets an
    error event); then the process exits 0. A second Ctrl-C quits at once."""
    import uvicorn

    worker, grace = app.state.worker, app.state.limits.shutdown_grace_s

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.drain(grace)
            super().handle_exit(sig, frame)

    return GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=grace + 5, **config))


def bind_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The warning `specexport serve` prints when it listens beyond loopback without a key."""
    if api_key or is_loopback(host):
        return None
    return (f"specexport serve: warning: listening on {host}:{port} without an API key: anyone who can reach it "
            f"can use the model; set --api-key or {API_KEY_ENV}")
