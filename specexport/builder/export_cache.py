"""Exported graphs reused by content: opt-in, `SPECEXPORT_EXPORT_CACHE=<folder>`.

torch.onnx.export takes seconds on a tiny model and minutes on a real one, and writes the same bytes
for the same inputs: the wrapper's code, the HF config, the weights, the IO table and the tools'
versions. A build that exports one of those again (`--force`, a second model.yaml with the same
target, CI) takes the graph from the folder instead. The check against PyTorch still runs on it.
Off by default: an fp32 graph costs the model's size again on disk, which nobody should find in a
cache they did not ask for. Nothing here deletes what it did not write.

    <folder>/<kind>-<key>/model.onnx, model.onnx.data, files.json (each file's sha256)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.builder.sources import GRAPH_SOURCES, TOOLS, source_hash, tool_versions
from specexport.manifest import sha256_file

ENV = "SPECEXPORT_EXPORT_CACHE"
INDEX = "files.json"


def folder() -> Path | None:
    """The cache folder, or None when the cache is off."""
    value = os.environ.get(ENV)
    return Path(value).expanduser() if value else None


def graph_key(kind: str, mp, hf_config, *, name: str, weights=None) -> str | None:
    """The entry of model plan `mp`'s graph, or None when the cache is off. weights: the torch module
    exported, its state hashed (None for a weightless graph, whose bytes the config alone decides)."""
    if folder() is None:
        return None
    config = {k: v for k, v in hf_config.to_dict().items() if k != "_name_or_path"}     # where it lay: not content
    h = hashlib.sha256()
    for part in (kind, name, repr(mp.arch), repr(mp.io), source_hash(GRAPH_SOURCES),
                 json.dumps(tool_versions((*TOOLS, "onnxscript", "onnx_ir")), sort_keys=True),
                 json.dumps(config, sort_keys=True, default=str),
                 b"" if mp.vocab_ids is None else np.asarray(mp.vocab_ids, np.int64).tobytes()):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    if weights is not None:
        _hash_state(h, weights)
    return f"{kind}-{h.hexdigest()[:32]}"


def fetch(key: str | None, onnx_path: Path) -> list[str] | None:
    """Copy entry `key`'s files beside `onnx_path` (its name is in the key); their names, or None on a miss.
    An entry whose files do not match their recorded sha256 is a miss (and is replaced by the next store)."""
    if key is None:
        return None
    entry = folder() / key
    files = _verified(entry)
    if files is None:
        return None
    for file_name in files:
        shutil.copyfile(entry / file_name, onnx_path.parent / file_name)
    return list(files)


def store(key: str | None, where: Path, names: list[str]) -> None:
    """Keep the exported files `names` (in folder `where`) as entry `key`: written whole in a temporary
    folder, then renamed into place, so a killed build or a second writer never leaves half an entry."""
    if key is None:
        return
    root = folder()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        for file_name in names:
            shutil.copyfile(where / file_name, tmp / file_name)
        (tmp / INDEX).write_text(json.dumps({n: sha256_file(tmp / n) for n in names}, indent=1))
        entry = root / key
        if _verified(entry) is not None:
            return                                          # another build stored it first
        if entry.exists():
            _remove_entry(entry)                            # damaged: ours to replace (it holds our index name)
        with contextlib.suppress(OSError):                  # still holds files not ours: the graph is not kept
            os.rename(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)                              # the temporary folder this call made


def _verified(entry: Path) -> dict | None:
    """{file name: sha256} of a whole entry, or None (absent, or a file missing or changed)."""
    try:
        files = json.loads((entry / INDEX).read_text())
    except (OSError, ValueError):
        return None
    ok = all((entry / n).is_file() and sha256_file(entry / n) == d for n, d in files.items())
    return files if ok else None


def _remove_entry(entry: Path) -> None:
    """A damaged entry: only the files it lists and its index are removed, then the folder if empty."""
    try:
        listed = list(json.loads((entry / INDEX).read_text()))
    except (OSError, ValueError):
        listed = []
    for file_name in [*listed, INDEX]:
        (entry / file_name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):                      # not empty: someone else's files stay
        entry.rmdir()


def _hash_state(h, module) -> None:
    """Every parameter and buffer: name, dtype, shape and bytes (as raw bytes, so any dtype)."""
    torch = require("torch")
    for name, t in module.state_dict().items():
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))

