"""Where TensorRT is needed: one check that fails at once, in one line, naming what is missing.

TensorRT engines (`backends: [tensorrt]`, `load(..., backend="tensorrt")`) need TensorRT's Python
bindings with its libraries, TensorRT 11 or later (the engine graph's TRT_KVCacheUpdate / TRT_Attention
custom ops: trt/graph.py) and an NVIDIA GPU. The bindings import lazily, here only.
"""
from __future__ import annotations

from specexport.errors import SpecexportError

HOW = ("TensorRT engines need an NVIDIA GPU with its driver and TensorRT 11 (`pip install tensorrt` there); "
       "ONNX Runtime (backends: [onnxruntime]) builds and runs without it")
MIN_MAJOR = 11


def require_tensorrt(where: str):
    """The tensorrt module, or SpecexportError("<where>: ...") naming what is missing."""
    try:
        import tensorrt
    except (ImportError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpecexportError(f"{where}: TensorRT is not installed here ({reason}). {HOW}") from None
    return tensorrt


def require_engines(where: str, *, gpu: bool = True):
    """The tensorrt module where engines can be built and run, else SpecexportError("<where>: ...") in one
    line: TensorRT absent (require_tensorrt's words), older than 11, or (gpu) no NVIDIA GPU to build on.
    Cheap: an import, a version string and, for the GPU, torch.cuda or one nvidia-smi call. UNVERIFIED
    with a real TensorRT (its present-branches run here only with a fake tensorrt module)."""
    trt = require_tensorrt(where)
    version = str(getattr(trt, "__version__", "0"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_MAJOR:
        raise SpecexportError(f"{where}: TensorRT {version} is installed; engines need TensorRT {MIN_MAJOR} or later "
                              f"(its ONNX parser's TRT_KVCacheUpdate and TRT_Attention ops). {HOW}")
    if gpu:
        try:
            gpu_arch()
        except SpecexportError as err:
            raise SpecexportError(f"{where}: TensorRT {version} is installed, but {str(err).split(': ', 1)[-1]}; "
                                  "engines are built and run on the GPU they are for") from None
    return trt


def gpu_arch() -> str:
    """sm_<major><minor> of the GPU the engine is being built on (torch's CUDA, else nvidia-smi)."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except ImportError:
        pass
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        raise SpecexportError("TensorRT: no NVIDIA GPU found (neither torch.cuda nor nvidia-smi)") from None
    return "sm_" + out.replace(".", "")
