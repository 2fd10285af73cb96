"""The files of a build output folder while a build runs: fresh stage folders, their publication,
the tokenizer copy, and the removal of what no manifest points at (see `specexport.manifest`).

    <out>/<role>/.<precision>-<id>.partial/   being written (never pointed at)
    <out>/<role>/<precision>-<id>/            checked; pointed at once the new manifest is written
    <out>/tokenizer-<hash>/                   named by the content of the source tokenizer files
    <out>/kernels-<hash>/<arch>/              the CPU kernels' libraries, named by their content
    <out>/.specexport/                        the lock, temporary files and the journal of the role folders
                                              the build made (locking.work_dir)

Every folder the build creates is marked as the build's before anything goes in (`specexport.owned`);
only marked folders, and in them only the files the build recorded, are ever removed. Anything else in
the output folder, whatever its name, is left alone and reported once.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

from specexport import owned
from specexport.config import HEAD_KINDS, MODEL_ROLES
from specexport.errors import SpecexportError
from specexport.locking import WORK_DIR, work_dir
from specexport.manifest import MANIFEST_NAME, files_intact, write_json_atomic

BY = "specexport build"


class StageFolders:
    """Hands out fresh stage folders and remembers the ones this build published, so that a build
    that fails can remove them again (they are not in any manifest)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.published: list[Path] = []

    def new(self, role: str, precision: str) -> tuple[Path, Path]:
        """(partial, final) for a new stage; the partial folder exists, is marked and is otherwise empty."""
        folder = self.out / role
        if not folder.exists():             # journaled first: a role folder is removed only if we made it
            _journal(self.out, add=role)
            folder.mkdir(parents=True, exist_ok=True)
        while True:
            name = f"{precision}-{secrets.token_hex(4)}"
            final, partial = folder / name, folder / f".{name}.partial"
            if final.exists() or partial.exists():
                continue
            try:
                return owned.create(partial, by=BY), final
            except FileExistsError:
                continue

    def folder(self, dest: Path) -> Path:
        """A partial folder for `dest` (a folder directly in the output: the tokenizer copy)."""
        return owned.fresh(dest.parent, f".{dest.name}.partial-", by=BY)

    def addressed(self, prefix: str, digest: str, write) -> Path:
        """A folder in the output named by its content, `<prefix>-<digest[:8]>` (another name where a damaged
        copy holds that one), filled by write(partial) in a partial folder and published whole."""
        dest = self.out / f"{prefix}-{digest[:8]}"
        if dest.exists():
            dest = self.out / f"{prefix}-{digest[:8]}-{secrets.token_hex(2)}"
        partial = self.folder(dest)
        try:
            write(partial)
            self.publish(partial, dest)
        finally:
            owned.remove(partial)          # ours: marked when made (gone already once published)
        return dest

    def publish(self, partial: Path, final: Path) -> None:
        """Seal a checked stage (its files recorded as the build's) and rename it into place, beside the
        current build's folders; nothing is replaced."""
        if final.exists():
            raise SpecexportError(f"{final}: exists; a new stage folder must not replace anything")
        owned.seal(partial)
        os.replace(partial, final)
        self.published.append(final)

    def discard(self) -> None:
        for path in self.published:
            owned.remove(path)
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
    """Relative paths of the folders a manifest points at (stage folders, the tokenizer, the kernels)."""
    entries = [*manifest.get("models", {}).values(), *manifest.get("heads", {}).values()]
    refs = {e["dir"] for m in entries if isinstance(m, dict) for e in m.get("precisions", {}).values()
            if isinstance(e, dict) and "dir" in e}
    for key in ("tokenizer", "kernels"):
        if isinstance(manifest.get(key), dict) and "dir" in manifest[key]:
            refs.add(manifest[key]["dir"])
    return refs


def check_output(out: Path) -> None:
    """Refuse, before anything is written, an output folder whose manifest.json is not a specexport
    manifest (the build would replace it) or whose work folder is someone else's."""
    manifest = Path(out) / MANIFEST_NAME
    if manifest.exists():
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError):
            data = None
        if not (isinstance(data, dict) and "schema_version" in data and "models" in data):
            raise SpecexportError(f"output: {manifest} exists and is not a specexport manifest; the build would "
                                  f"replace it: build into another folder")
    work = Path(out) / ".specexport"
    if work.exists() and not owned.is_owned(work):
        raise SpecexportError(f"output: {work} exists and was not made by specexport; move it away")


def adopt_previous(out: Path, manifest: dict) -> list[str]:
    """Mark the folders an earlier build's manifest points at but that carry no marker (written by a
    specexport from before markers), sealed with exactly the files the manifest lists: the manifest is
    our record of having written them. Returns the folders adopted."""
    adopted = []
    listed = {}
    for part in (manifest.get("tokenizer"), manifest.get("kernels")):
        if isinstance(part, dict) and isinstance(part.get("files"), dict) and isinstance(part.get("dir"), str):
            listed[part["dir"]] = list(part["files"])
    for m in [*manifest.get("models", {}).values(), *manifest.get("heads", {}).values()]:
        for e in (m.get("precisions", {}) if isinstance(m, dict) else {}).values():
            if isinstance(e, dict) and isinstance(e.get("dir"), str) and isinstance(e.get("files"), dict):
                prefix = e["dir"].rstrip("/") + "/"
                listed[e["dir"]] = [k[len(prefix):] for k in e["files"] if k.startswith(prefix)]
    for rel, files in listed.items():
        folder = Path(out) / rel
        if owned.inside(Path(out), folder) and owned.adopt(folder, by=BY, files=files):
            adopted.append(rel)
    return adopted


def remove_unreferenced(out: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """Delete what this build command wrote into `out` that `manifest` does not point at: stage folders
    of replaced, failed or killed builds, partial folders, tokenizer and kernels copies, temporary files in the work
    folder. Only marked folders (and in them the files recorded as the build's) go. Returns (removed,
    left alone): the second names what sits where the build keeps its folders but was not written by it."""
    out = Path(out)
    keep, removed, left = referenced(manifest), [], []
    candidates = []                  # where the build keeps its folders: role folders' children, tokenizers
    for role in (*MODEL_ROLES, *HEAD_KINDS):
        folder = out / role
        if folder.is_dir() and not folder.is_symlink():
            candidates += [c for c in sorted(folder.iterdir()) if c.name != owned.MARKER]
    candidates += [c for c in sorted(out.iterdir()) if c.name == "tokenizer"
                   or c.name.startswith(("tokenizer-", ".tokenizer-", "kernels-", ".kernels-", f".{MANIFEST_NAME}."))]
    for child in candidates:
        rel = child.relative_to(out).as_posix()
        if rel in keep:
            continue
        if owned.is_owned(child, BY):
            left += owned.remove(child)
            removed.append(rel)
        else:
            left.append(child)
    for role in _journal(out):       # role folders the build made, once empty
        if (out / role).is_dir() and not any((out / role).iterdir()):
            (out / role).rmdir()
    work = out / ".specexport"
    if owned.is_owned(work):
        for tmp in work.glob(f".{MANIFEST_NAME}.*"):          # a killed write's temporary file
            tmp.unlink(missing_ok=True)
    return removed, [str(p.relative_to(out)) for p in left]


JOURNAL = "made.json"


def _journal(out: Path, *, add: str | None = None) -> list[str]:
    """The role folders this build command made in `out` (kept in the work folder: a role folder may
    also be the user's, and it is removed, when empty, only if it is listed here)."""
    path = Path(out) / WORK_DIR / JOURNAL
    try:
        made = json.loads(path.read_text())["folders"] if owned.is_owned(path.parent) else []
    except (OSError, ValueError, KeyError, TypeError):
        made = []
    if add is not None and add not in made:
        made = [*made, add]
        write_json_atomic(work_dir(out) / JOURNAL, {"folders": made})
    return list(made)
