"""Lazy imports of heavy, optional packages.

The runtime installs with numpy + onnxruntime only; torch, transformers and onnx come with the
`export` extra, TensorRT with `trt`. Call `require()` inside the function that needs a module, so the
import happens where it is used and `import specexport.runtime` never pulls torch.
"""
from __future__ import annotations

import importlib
import sys

from specexport.errors import MissingDependency

_EXTRA = {
    "torch": "export",
    "transformers": "export",
    "onnx": "export",
    "onnxscript": "export",
    "safetensors": "export",
    "onnxruntime": "ort",
    "tensorrt": "trt",
    "modelopt": "quant",
    "tokenizers": "ort",
    "fastapi": "serve",
    "uvicorn": "serve",
    "pydantic": "serve",       # with fastapi
    "jinja2": "ort",          # in the base install too: chat templates are the runtime's
    "prometheus_client": "serve",
}


def require(name: str):
    """Import `name` now, or raise MissingDependency naming the pip extra. Never installs anything."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        extra = _EXTRA.get(name.split(".")[0], name)
        raise MissingDependency(
            f"'{name}' is needed here but could not be imported ({err}): pip install 'specexport[{extra}]'"
        ) from err


def loaded(name: str):
    """The module if something already imported it, else None (for isinstance checks without importing)."""
    return sys.modules.get(name)
