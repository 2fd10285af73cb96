"""specexport serve OUTPUT_DIR: an OpenAI-compatible HTTP server on a build (the [serve] extra)."""
from __future__ import annotations

import click

from specexport.cli import cli


@cli.command()
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
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
def serve(output_dir, host, port, method, precision, draft_precision, threads, name, log_level, verbose):
    """Serve the build in OUTPUT_DIR: /v1/models, /v1/completions, /v1/chat/completions, /health."""
    from specexport.serve import serve as run

    run(output_dir, host=host, port=port, method=method, name=name, log_level=log_level, precision=precision,
        draft_precision=draft_precision, threads=threads)
