"""`specexport serve`: an OpenAI-compatible HTTP server on the embedded runtime (the `[serve]` extra:
FastAPI, uvicorn, jinja2 for chat templates).

    app.py       the routes, the OpenAI response and stream shapes
    protocol.py  request bodies (pydantic), what is refused, the error shape
    worker.py    one model, one decode at a time on its own thread; cancellation
    chat.py      the tokenizer's chat template
"""
from __future__ import annotations


def serve(output_dir, *, host: str = "127.0.0.1", port: int = 8000, method: str = "auto", name: str | None = None,
          log_level: str = "info", **load_options) -> None:
    """Load the build and serve it until interrupted."""
    import specexport
    from specexport._optional import require
    from specexport.serve.app import create_app

    uvicorn = require("uvicorn")
    require("fastapi")
    pipe = specexport.load(output_dir, **load_options)
    app = create_app(pipe, method=method, name=name)
    worker = app.state.worker
    print(f"specexport serve: {app.state.model_name} ({pipe.dir}, target {pipe.precision}); {worker.method_note}",
          flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
