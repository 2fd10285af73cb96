"""Backends behind one small interface (base.Backend). Open them with `open_backend`, which imports
the backend's heavy module lazily."""
from __future__ import annotations


def open_backend(kind: str, model_dir, *, io, capacity: int, max_tokens: int, device: str = "cpu", **options):
    """A Backend for one model of a build. kind: 'onnxruntime' or 'tensorrt' (its engine; UNVERIFIED:
    runtime/backends/trt.py); device: 'cpu' or 'cuda' / 'cuda:N' (ONNX Runtime's CUDA execution provider,
    onnxruntime-gpu; engines always run on a GPU)."""
    from specexport.errors import SpecexportError

    if kind == "onnxruntime" and device != "cpu":
        if not (device == "cuda" or device.startswith("cuda:") and device[5:].isdigit()):
            raise SpecexportError(f"device: expected cpu, cuda or cuda:N, got {device!r}")
        from specexport.runtime.backends.ort_cuda import OrtCudaBackend

        return OrtCudaBackend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens,
                              device_id=int(device[5:] or 0) if device != "cuda" else 0, **options)
    if kind == "onnxruntime":
        from specexport.runtime.backends.ort import OrtBackend

        return OrtBackend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens, **options)
    if kind == "tensorrt":
        from specexport.runtime.backends.trt import open_trt_backend

        return open_trt_backend(model_dir, io=io, capacity=capacity, max_tokens=max_tokens,
                                device=device if device.startswith("cuda") else "cuda", **options)
    raise SpecexportError(f"backend: {kind!r} is not available in this version; available: onnxruntime, tensorrt")
