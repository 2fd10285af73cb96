"""Where TensorRT is needed: one check that fails at once, in one line, naming what is missing.

TensorRT engines (`backends: [tensorrt]`, `load(..., backend="tensorrt")`) need TensorRT's Python
bindings with its libraries and an NVIDIA GPU. The bindings import lazily, here only.
"""
from __future__ import annotations

from specexport.errors import SpecexportError

HOW = ("TensorRT engines need an NVIDIA GPU with its driver and TensorRT 11 (`pip install tensorrt` there); "
       "ONNX Runtime (backends: [onnxruntime]) builds and runs without it")


def require_tensorrt(where: str):
    """The tensorrt module, or SpecexportError("<where>: ...") naming what is missing."""
    try:
        import tensorrt
    except (ImportError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpecexportError(f"{where}: TensorRT is not installed here ({reason}). {HOW}") from None
    return tensorrt


def engines_unavailable(where: str):
    """TensorRT present: engine building and the engine backend are not in this version yet."""
    trt = require_tensorrt(where)
    raise SpecexportError(f"{where}: TensorRT {trt.__version__} is installed, but building and "
                          "running TensorRT engines is not implemented in this version of specexport (the "
                          "tree-attention plugin is: specexport.plugins.trt_plugin); use backends: [onnxruntime]")
