"""specexport: export Hugging Face checkpoints for speculative decoding, and a light runtime that drives them.

Importing the package imports nothing heavy; `specexport.load` opens a built output folder.
"""
__version__ = "0.1.0"


def load(output_dir, *, precision: str | None = None, backend: str = "onnxruntime", **options):
    """Open a built output folder for generation. See `specexport.runtime.pipeline.Pipeline`."""
    from specexport.runtime.pipeline import load as _load

    return _load(output_dir, precision=precision, backend=backend, **options)


__all__ = ["__version__", "load"]
