"""The versioned JSON manifest written at the root of every build output.

Layout of an output folder:
    manifest.json                  written last, atomically; absent while a build is in progress
    tokenizer/                     tokenizer files copied from the target checkpoint
    <role>/<precision>/model.onnx  (+ model.onnx.data) per model (target, draft) and precision

The runtime needs nothing but this folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from specexport.errors import SpecexportError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


def sha256_file(path: Path, *, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so that readers see either the old file or the complete new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)                 # mkstemp creates 0600; the manifest is as readable as the models
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_manifest(output_dir: str | os.PathLike) -> dict:
    """Load and check the manifest of a build output folder."""
    output_dir = Path(output_dir)
    path = output_dir / MANIFEST_NAME
    if not output_dir.is_dir():
        raise SpecexportError(f"{output_dir}: no such build output folder")
    if not path.is_file():
        raise SpecexportError(f"{output_dir}: no {MANIFEST_NAME} (not a finished specexport build; run `specexport build`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SpecexportError(f"{path}: not valid JSON ({err})") from None
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SpecexportError(f"{path}: schema_version {version!r} is not supported; this specexport reads {SCHEMA_VERSION}")
    return data


def files_intact(output_dir: Path, files: dict[str, dict]) -> bool:
    """True when every listed file exists with its recorded size (the cheap check used to skip stages)."""
    return all((output_dir / rel).is_file() and (output_dir / rel).stat().st_size == meta["size"]
               for rel, meta in files.items())


def describe_files(output_dir: Path, paths: list[Path]) -> dict[str, dict]:
    return {str(p.relative_to(output_dir)): {"sha256": sha256_file(p), "size": p.stat().st_size} for p in paths}
