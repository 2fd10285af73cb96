"""The versioned JSON manifest written at the root of every build output, and the checks of the
files it lists.

Layout of an output folder (schema 2):
    manifest.json                      the build: written last, atomically, only when every stage passed
    tokenizer-<hash>/                  tokenizer files copied from the target checkpoint
    kernels-<hash>/<arch>/             the CPU kernels' library the graphs call (key `kernels`), when they do
    <role>/<precision>-<id>/model.onnx (+ model.onnx.data) per model (target, draft) and precision
    medusa/fp32-<id>/model.onnx        the Medusa heads' graph, when the build has heads (key `heads`)
    eagle/fp32-<id>/model.onnx         the EAGLE head's graph (key `heads.eagle`)
    bench/                             the latest `specexport bench` report

Stage folders carry a fresh id each time they are built, so a rebuild writes beside the files the
current manifest points at and replaces the manifest only at the end: whatever happens to a rebuild
(a failed gate, Ctrl-C, kill -9), the previous build stays loadable. Folders no manifest points at
are removed after the manifest is written (and before the next build starts), if the build made
them (their marker: `specexport.owned`). The runtime needs
nothing but this folder; `models.<role>.precisions.<p>.dir` says where each graph is.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from specexport.errors import SpecexportError

SCHEMA_VERSION = 4          # 2: stage folders named in the manifest, tokenizer files hashed, γ keyed by (target, draft)
                            # 3: gguf graphs may call specexport's CPU kernels (quantization.kernels says)
                            # 4: the engine folder may carry the kernels' library (key `kernels`)
READABLE = (2, 3, 4)        # an older build is a version-4 one without what came later: read as it is
MANIFEST_NAME = "manifest.json"


def sha256_file(path: Path, *, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: Path, data: dict, *, tmp_dir: Path | None = None) -> None:
    """Write JSON so that readers see either the old file or the complete new one, never a part."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False), tmp_dir=tmp_dir)


def write_text_atomic(path: Path, text: str, *, tmp_dir: Path | None = None) -> None:
    """Write a text file through a temporary file, fsync'd, then renamed. The temporary file is made in
    `tmp_dir` (a folder of specexport's own on the same file system: `locking.work_dir`), else beside
    `path` (in a folder specexport owns)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=tmp_dir or path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)                 # mkstemp creates 0600; reports are as readable as the models
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- reading and validating ------------------------------------------------------------------------
class _Each:
    """Schema node: a mapping with any keys, each value matching `schema`."""

    def __init__(self, schema):
        self.schema = schema


_FILES = _Each({"sha256": str, "size": int})
_IO = {"num_layers": int, "num_kv_heads": int, "head_dim": int, "hidden_size": int, "vocab_size": int,
       "aux_hidden_layers": list, "inputs": list, "outputs": list}
_STAGE = {"dir": str, "backend": str, "files": _FILES, "size_bytes": int, "parity_max_rel_error": (int, float),
          "build_seconds": (int, float)}
_MODEL = {"source": str, "model_type": str, "fingerprint": str, "vocab_size": int, "io": _IO,
          "special_tokens": {"eos_token_ids": (list, type(None))}, "precisions": _Each(_STAGE)}
_HEADS = {"source": str, "format": str, "num_heads": int, "num_layers": int, "top_k": int, "fingerprint": str,
          "io": dict, "precisions": _Each(_STAGE)}
_EAGLE = {"source": str, "version": int, "aux_layers": list, "target_ids": (list, type(None)), "top_k": int,
          "fingerprint": str, "io": dict, "scratch_rows": int, "precisions": _Each(_STAGE)}
_KERNELS = {"dir": str, "files": _FILES, "libraries": _Each({"file": str, "sha256": str, "arch": str,
                                                              "kernel_version": int, "paths": list})}
# What the runtime, the bench and inspect read. Other keys may be present (figures, config echo).
SCHEMA = {"schema_version": int, "name": str, "created": str, "build_id": str, "max_seq_len": int,
          "max_verify_tokens": int, "tokenizer": {"dir": str, "files": _FILES},
          "special_tokens": {"eos_token_ids": (list, type(None))}, "models": _Each(_MODEL), "versions": dict}


def read_manifest(output_dir: str | os.PathLike) -> dict:
    """Load the manifest of a build output folder and check its structure (errors name the key)."""
    output_dir = Path(output_dir)
    path = output_dir / MANIFEST_NAME
    if not output_dir.is_dir():
        raise SpecexportError(f"{output_dir}: no such build output folder")
    if not path.is_file():
        raise SpecexportError(f"{output_dir}: no {MANIFEST_NAME} (not a finished specexport build; run `specexport build`)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpecexportError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise SpecexportError(f"{path}: expected a JSON object at the top level")
    version = data.get("schema_version")
    if version not in READABLE:
        raise SpecexportError(f"{path}: schema_version {version!r} is not supported; this specexport reads "
                              f"{', '.join(map(str, READABLE))} (rebuild with `specexport build`)")
    validate_manifest(data, where=str(path))
    if "heads" in data:                     # optional: builds with Medusa heads or an EAGLE head
        _check(data["heads"], dict, str(path), "heads")
        for kind, entry in data["heads"].items():
            _check(entry, _EAGLE if kind == "eagle" else _HEADS, str(path), f"heads.{kind}")
    if "kernels" in data:                   # optional: builds whose graphs call our CPU kernels
        _check(data["kernels"], _KERNELS, str(path), "kernels")
    if "target" not in data["models"]:
        raise SpecexportError(f"{path}: models.target: missing key")
    return data


def validate_manifest(data: dict, *, where: str = MANIFEST_NAME) -> None:
    """Raise SpecexportError naming the first key that is missing or of the wrong type."""
    _check(data, SCHEMA, where, "")


def _check(value, schema, where: str, key: str) -> None:
    shown = key or "(top level)"
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise SpecexportError(f"{where}: {shown}: expected an object, got {type(value).__name__}")
        for k, sub in schema.items():
            if k not in value:
                raise SpecexportError(f"{where}: {key + '.' if key else ''}{k}: missing key")
            _check(value[k], sub, where, f"{key + '.' if key else ''}{k}")
    elif isinstance(schema, _Each):
        if not isinstance(value, dict):
            raise SpecexportError(f"{where}: {shown}: expected an object, got {type(value).__name__}")
        for k, v in value.items():
            _check(v, schema.schema, where, f"{key}.{k}")
    else:
        types = schema if isinstance(schema, tuple) else (schema,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise SpecexportError(f"{where}: {shown}: expected {expected}, got {type(value).__name__}")


# -- the files a manifest lists --------------------------------------------------------------------
def stage_dir(output_dir: Path, manifest: dict, role: str, precision: str) -> Path:
    """The folder of one model's graph at one precision."""
    return Path(output_dir) / manifest["models"][role]["precisions"][precision]["dir"]


def listed_files(manifest: dict) -> dict[str, dict]:
    """Every file the manifest lists (graphs of every model and precision, tokenizer, kernels), by relative path."""
    files = {}
    for m in (*manifest["models"].values(), *manifest.get("heads", {}).values()):
        for entry in m["precisions"].values():
            files.update(entry["files"])
    for part in (manifest["tokenizer"], manifest.get("kernels")):
        if part:
            files.update({f"{part['dir']}/{name}": meta for name, meta in part["files"].items()})
    return files


def file_problems(output_dir: Path, files: dict[str, dict], *, hashes: bool) -> list[str]:
    """One line per listed file that is missing, of another size or (hashes=True) of other content."""
    problems = []
    for rel, meta in files.items():
        path = Path(output_dir) / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != meta["size"]:
            what = "truncated" if size < meta["size"] else "larger than built"
            problems.append(f"{path}: {what} ({size} bytes, the manifest says {meta['size']})")
        elif hashes and sha256_file(path) != meta["sha256"]:
            problems.append(f"{path}: content differs from the build (sha256 mismatch)")
    return problems


def check_files(output_dir: Path, files: dict[str, dict]) -> None:
    """The cheap check made on load: every file present with its recorded size; else one line naming it."""
    problems = file_problems(output_dir, files, hashes=False)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SpecexportError(f"{problems[0]}{more}: the build is damaged; rebuild it with `specexport build "
                              f"--force` (`specexport inspect {output_dir} --verify` checks every file)")


def files_intact(output_dir: Path, files: dict[str, dict]) -> bool:
    """True when every listed file exists with its recorded size (the cheap check used to skip stages)."""
    return not file_problems(output_dir, files, hashes=False)


def describe_files(output_dir: Path, paths: list[Path]) -> dict[str, dict]:
    return {str(p.relative_to(output_dir)): {"sha256": sha256_file(p), "size": p.stat().st_size} for p in paths}
