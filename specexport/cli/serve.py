"""specexport serve OUTPUT_DIR: an OpenAI-compatible HTTP server on a build (the [serve] extra)."""
from __future__ import annotations

import re
from pathlib import Path

import click

from specexport.errors import SpecexportError
from specexport.serve import API_KEY_ENV    # light: the server's own packages load when it runs


class ByteSize(click.ParamType):
    """A size in bytes: 4194304, 4MiB, 4M (= MiB), 512KiB, 1GiB."""
    name = "size"
    UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kb": 10 ** 3, "kib": 2 ** 10, "m": 2 ** 20, "mb": 10 ** 6, "mib": 2 ** 20,
             "g": 2 ** 30, "gb": 10 ** 9, "gib": 2 ** 30}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in self.UNITS:
            self.fail(f"{value!r}: expected a size such as 4194304, 4MiB or 512KiB", param, ctx)
        size = int(float(m.group(1)) * self.UNITS[m.group(2).lower()])
        if size < 1:
            self.fail(f"{value!r}: expected at least 1 byte", param, ctx)
        return size


class BatchSize(click.ParamType):
    """auto (measured at start) or an integer >= 1 (runtime/batch.py's check_max_batch)."""
    name = "auto|N"

    def convert(self, value, param, ctx):
        from specexport.runtime.batch import check_max_batch

        text = str(value).strip().lower()
        try:
            return check_max_batch(int(text) if text.lstrip("-").isdigit() else text)
        except SpecexportError:
            self.fail(f"{value!r}: expected auto or an integer >= 1", param, ctx)


@click.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--method", default="auto", show_default=True,
              help="The default speculative method: auto (what `specexport bench` measured fastest; vanilla "
                   "when the build has no measurement) | vanilla | draft | lookup | suffix | medusa | eagle. A "
                   "request may pick another with the extension field `method`.")
@click.option("--precision", default=None, help="The target's precision (default: fp32, or gguf in a lean build).")
@click.option("--draft-precision", default=None, help="The draft's precision (default: --precision).")
@click.option("--threads", default=None, type=int,
              help="Target's ONNX Runtime intra-op threads (default: the threads and spinning the build's bench "
                   "measured fastest, else all cores).")
@click.option("--name", default=None, help="The model name clients use (default: the build's name).")
@click.option("--spin/--no-spin", default=None,
              help="Let ONNX Runtime's idle threads spin between forwards (default: as the build's bench measured "
                   "fastest, else on; benchmarks/serve_bench.py on the demo, 2 cores: the server's overhead per "
                   "request was 28 ms with spinning, 97 ms without).")
@click.option("--api-key", envvar=API_KEY_ENV, default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every route but /health (401 otherwise). Prefer the "
                   f"environment variable {API_KEY_ENV}: a flag shows in the process list. Without a key, "
                   "binding to anything but loopback prints a warning.")
@click.option("--max-body-bytes", default="4MiB", show_default=True, type=ByteSize(),
              help="The largest request body accepted (413 beyond it); 4194304, 4MiB, 512KiB.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait behind the ones decoding; more get a 429 with Retry-After.")
@click.option("--max-batch", default="auto", show_default=True, type=BatchSize(),
              help="Requests that decode together, every round of each in one target pass, each answer its "
                   "lone answer (on graphs the build measured row-exact: specexport's CPU kernels). auto: "
                   "measured at start, the largest of 8, 4, 2 whose pass costs at most two one-row passes.")
@click.option("--request-timeout", default=300.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds a request may take from arrival to its last token, queue included (504 after "
                   "it; a stream gets an error event); 0: no deadline.")
@click.option("--shutdown-grace", default=20.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM or Ctrl-C: stop accepting, let queued and running requests finish for this many "
                   "seconds, then stop them (503) and exit 0.")
@click.option("--suffix-cache", "suffix_cache", default=None, type=click.Path(dir_okay=False),
              help="Keep the cache of earlier answers that --method suffix reads in this file: loaded at start "
                   "(a damaged file: a warning and an empty cache), written atomically at shutdown.")
@click.option("--suffix-cache-tokens", default=500_000, show_default=True, type=click.IntRange(min=0),
              help="The suffix cache's bound in tokens (oldest answers evicted first; about 55 bytes a token).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
def serve(output_dir, host, port, method, precision, draft_precision, threads, name, spin, api_key, max_body_bytes,
          max_queue, max_batch, request_timeout, shutdown_grace, suffix_cache, suffix_cache_tokens, log_level, verbose):
    """Serve the build in OUTPUT_DIR: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics."""
    from specexport.serve import require_server

    require_server()                    # the `serve` extra, named before anything loads
    from specexport.runtime.pipeline import MEASURED
    from specexport.serve import serve as run
    from specexport.serve.guard import Limits

    limits = Limits(max_body_bytes=max_body_bytes, max_queue=max_queue, max_batch=max_batch,
                    request_timeout_s=request_timeout or None,
                    shutdown_grace_s=shutdown_grace)
    run(output_dir, host=host, port=port, method=method, name=name, log_level=log_level, api_key=api_key or None,
        limits=limits, precision=precision, draft_precision=draft_precision,
        threads=MEASURED if threads is None else threads, **({} if spin is None else {"spin": spin}),
        suffix_cache=suffix_cache, suffix_cache_tokens=suffix_cache_tokens)


@click.command("export-triton")
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--out", "repo", required=True, type=click.Path(file_okay=False),
              help="The Triton model repository to write the model folder into (created if missing).")
@click.option("--name", default=None, help="The model's name in the repository (default: the build's name).")
@click.option("--instances", default=1, show_default=True, type=int,
              help="Model instances Triton runs (each its own process and Pipeline, decoding in parallel).")
@click.option("--reference", is_flag=True,
              help="Point at the build by its absolute path instead of copying it into the repository.")
@click.option("--method", default="auto", show_default=True, help="The default method (a request may pass `method`).")
@click.option("--precision", default=None, help="The target's precision (default: fp32, or gguf in a lean build).")
@click.option("--draft-precision", default=None)
@click.option("--threads", default=None, type=int, help="Target intra-op threads per instance (default: all cores).")
@click.option("--force", is_flag=True, help="Replace the model folder if it exists.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
def export_triton(output_dir, repo, name, instances, reference, method, precision, draft_precision, threads, force,
                  verbose):
    """Write a Triton Inference Server model repository (Python backend, decoupled) that runs OUTPUT_DIR."""
    from specexport.serve.triton import write_repository

    folder = write_repository(output_dir, repo, name=name, instances=instances, copy=not reference, method=method,
                              precision=precision, draft_precision=draft_precision, threads=threads, force=force)
    click.echo(f"wrote {folder} ({instances} instance{'s' if instances > 1 else ''}); run: tritonserver "
               f"--model-repository {Path(repo).resolve()}")
