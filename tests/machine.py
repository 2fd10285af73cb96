"""What this machine has, for the markers that let the suite hold on any machine (conftest.py):

    @pytest.mark.gpu          needs a CUDA GPU                     (skipped without one)
    @pytest.mark.trt          needs TensorRT's Python bindings     (skipped without them)
    @pytest.mark.no_gpu       checks what happens without a GPU    (skipped where there is one)
    @pytest.mark.no_trt       checks what happens without TensorRT (skipped where it imports)
    @pytest.mark.no_ort_cuda  checks the CPU-only onnxruntime's refusal of CUDA (skipped with onnxruntime-gpu)

Each probe runs once per session and imports nothing heavy unless the suite already did."""
from __future__ import annotations

import functools
import shutil
import subprocess


@functools.cache
def has_gpu() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@functools.cache
def has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@functools.cache
def has_ort_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


MARKERS = {  # marker -> (skip when, why)
    "gpu": (lambda: not has_gpu(), "needs a CUDA GPU"),
    "trt": (lambda: not has_tensorrt(), "needs TensorRT"),
    "no_gpu": (has_gpu, "checks behaviour without a GPU, and this machine has one"),
    "no_trt": (has_tensorrt, "checks behaviour without TensorRT, and TensorRT imports here"),
    "no_ort_cuda": (has_ort_cuda, "checks the CPU-only onnxruntime, and onnxruntime-gpu is installed here"),
}


REQUIRE_KERNELS = "SPECEXPORT_REQUIRE_KERNELS"


def kernels_missing(why: str):
    """Where specexport's CPU kernels (or a tool their tests need) are missing: skip, or, when
    SPECEXPORT_REQUIRE_KERNELS=1 (CI sets it), fail: CI must not go green with the kernels untested."""
    import os

    import pytest

    if os.environ.get(REQUIRE_KERNELS, "") not in ("", "0"):
        pytest.fail(f"{REQUIRE_KERNELS} is set and {why}", pytrace=False)
    pytest.skip(why)
