"""The files of a build output folder while a build runs: fresh stage folders, their publication,
the tokenizer copy, and the removal of what no manifest points at (see `specexport.manifest`).

    <out>/<role>/.<precision>-<id>.partial/   being written (never pointed at)
    <out>/<role>/<precision>-<id>/            checked; pointed at once the new manifest is written
    <out>/tokenizer-<hash>/                   named by the content of the source tokenizer files
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

from specexport.config import HEAD_KINDS, MODEL_ROLES
from specexport.manifest import MANIFEST_NAME, files_intact


class StageFolders:
    """Hands out fresh stage folders and remembers the ones this build published, so that a build
    that fails can remove them again (they are not in any manifest)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.published: list[Path] = []

    def new(self, role: str, precision: str) -> tuple[Path, Path]:
        """(partial, final) for a new stage; the partial folder exists and is empty."""
        while True:
            name = f"{precision}-{secrets.token_hex(4)}"
            final = self.out / role / name
            if not final.exists():
                break
        partial = self.out / role / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial, final

    def publish(self, partial: Path, final: Path) -> None:
        """Rename a checked stage into place (beside the current build's folders; nothing is replaced)."""
        os.replace(partial, final)
        self.published.append(final)

    def discard(self) -> None:
        for path in self.published:
            shutil.rmtree(path, ignore_errors=True)
        self.published.clear()


def tokenizer_digest(files) -> str:
    """sha256 over the source tokenizer files (names and contents)."""
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        digest.update(f.name.encode() + b"\0" + Path(f).read_bytes() + b"\0")
    return digest.hexdigest()


def reusable_tokenizer(out: Path, previous: dict, digest: str) -> dict | None:
    """The previous manifest's tokenizer record when it was made from the same files and is intact."""
    tok = previous.get("tokenizer") or {}
    if tok.get("source_sha256") != digest or not isinstance(tok.get("files"), dict):
        return None
    files = {f"{tok['dir']}/{name}": meta for name, meta in tok["files"].items()}
    return tok if files_intact(out, files) else None


def referenced(manifest: dict) -> set[str]:
    """Relative paths of the folders a manifest points at (stage folders and the tokenizer)."""
    entries = [*manifest.get("models", {}).values(), *manifest.get("heads", {}).values()]
    refs = {e["dir"] for m in entries if isinstance(m, dict) for e in m.get("precisions", {}).values()
            if isinstance(e, dict) and "dir" in e}
    if isinstance(manifest.get("tokenizer"), dict) and "dir" in manifest["tokenizer"]:
        refs.add(manifest["tokenizer"]["dir"])
    return refs


def remove_unreferenced(out: Path, manifest: dict) -> list[str]:
    """Delete what specexport wrote into `out` that `manifest` does not point at: stage folders of
    replaced, failed or killed builds (the layout of schema 1 included), partial folders, tokenizer
    copies and temporary manifest files. Touches nothing else in the folder. Returns what it removed."""
    out = Path(out)
    keep, removed = referenced(manifest), []
    for role in (*MODEL_ROLES, *HEAD_KINDS):
        folder = out / role
        if not folder.is_dir():
            continue
        for child in folder.iterdir():
            if f"{role}/{child.name}" not in keep:
                _remove(child)
                removed.append(f"{role}/{child.name}")
        if not any(folder.iterdir()):
            folder.rmdir()
    for child in out.iterdir():
        name = child.name
        ours = (name == "tokenizer" or name.startswith(("tokenizer-", ".tokenizer-"))   # schema 1 and 2 copies
                or name.startswith(f".{MANIFEST_NAME}."))
        if ours and name not in keep:
            _remove(child)
            removed.append(name)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
