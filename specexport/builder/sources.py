"""What a build's fingerprints hash: the source files of each kind of stage, and the tools' versions. A leaf
module (the plan, the stages and the export cache read it; it reads none of them)."""
from __future__ import annotations

import hashlib
from pathlib import Path

# The code that decides what an exported graph contains: a change to any of these files changes every
# fingerprint, so a graph made by older exporter code is never reused (hashing the sources, rather than a
# constant bumped by hand, cannot be forgotten; the price is that a comment edit also rebuilds).
GRAPH_SOURCES = ("io_spec.py", "export/arch.py", "export/wrapper.py", "export/gqa.py", "export/to_onnx.py",
                 "export/registry.py", "export/adapters/*.py", "export/lean.py", "export/gguf_weights.py",
                 "export/gguf_reference.py", "export/validate.py", "builder/stages/export.py")
ENGINE_SOURCES = ("trt/*.py", "plugins/*.py", "builder/stages/engines.py", "quant/fp16.py", "quant/quality.py")
QUANTIZER_SOURCES = ("quant/*.py", "builder/stages/[bgq]*.py", "plugins/cpu/*.py", "plugins/cpu/sx_layout.h")  # blocks, gguf, quantize
HEADS_SOURCES = ("io_spec.py", "heads/medusa*.py", "builder/stages/medusa.py", "export/to_onnx.py", "builder/stages/head_blocks.py",
                 "quant/graph_blocks.py", "quant/kquant.py", "quant/quality.py")
EAGLE_SOURCES = (*HEADS_SOURCES, "heads/eagle*.py", "builder/stages/eagle.py", "export/gqa.py", "plugins/cpu/graph.py")
# tests/test_stages.py fails when a stage's module, or a module of the makers it imports, is in none of its lists


def source_hash(patterns, root: Path | None = None) -> str:
    """sha256 of the contents of the named source files (globs relative to the package, or `root`). Names
    are left out, so moving or renaming a module (the package `build/` became `builder/`) keeps every
    fingerprint; a changed byte in any of them changes it."""
    root = root or Path(__file__).resolve().parent.parent
    files = {p for pat in patterns for p in root.glob(pat)}
    digests = sorted(hashlib.sha256(p.read_bytes()).digest() for p in files)
    return hashlib.sha256(b"".join(digests)).hexdigest()[:16]


TOOLS = ("torch", "transformers", "onnx", "onnxruntime")          # what a build's fingerprints record


def tool_versions(packages=TOOLS) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out
