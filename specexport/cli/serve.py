"""specexport serve OUTPUT_DIR: an OpenAI-compatible HTTP server on a build (the [serve] extra)."""
from __future__ import annotations

from pathlib import Path

import click



@click.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--method", default="auto", show_default=True,
              help="The default speculative method: auto (what `specexport bench` measured fastest; vanilla "
                   "when the build has no measurement) | vanilla | draft | lookup | medusa. A request may pick "
                   "another with the extension field `method`.")
@click.option("--precision", default="fp32", show_default=True)
@click.option("--draft-precision", default=None, help="The draft's precision (default: --precision).")
@click.option("--threads", default=None, type=int, help="Target's ONNX Runtime intra-op threads (default: all cores).")
@click.option("--name", default=None, help="The model name clients use (default: the build's name).")
@click.option("--spin/--no-spin", default=True, show_default=True,
              help="Let ONNX Runtime's idle threads spin between forwards (benchmarks/serve_bench.py on the demo, "
                   "2 cores: the server's overhead per request was 28 ms with spinning, 97 ms without).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
def serve(output_dir, host, port, method, precision, draft_precision, threads, name, spin, log_level, verbose):
    """Serve the build in OUTPUT_DIR: /v1/models, /v1/completions, /v1/chat/completions, /health."""
    from specexport.serve import serve as run

    run(output_dir, host=host, port=port, method=method, name=name, log_level=log_level, precision=precision,
        draft_precision=draft_precision, threads=threads, spin=spin)


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
@click.option("--precision", default="fp32", show_default=True)
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
