"""What specexport wrote, and only that, may be removed or replaced.

Every folder a specexport command creates gets a marker file first, before anything else goes in:

    <folder>/.specexport-owner.json    {"by": "specexport build", "created": ..., "files": null | {...}}

`files` is null while the folder is *open*: it was created empty by the command, so everything in it
is the command's (a stage being written, a scratch folder). Once the folder is complete it is
*sealed*: `files` lists, by relative path, the files the command wrote, and from then on only those
are the command's; a file someone adds later is left alone. Folders inside a sealed folder may carry
markers of their own (the bench's report folder holds the build's quick report folder).

Nothing is deleted or replaced without this record: `remove()` leaves whatever lacks it in place and
returns it, so the caller can say "left alone: ..." once. A folder written by an older specexport
(no marker) is adopted only from a record of ours that lists its files (the build's manifest:
`adopt()`), never by its name.

Why our own few lines and not a library: the rule is "a record written by us before anything else",
which no packaging or temp-file library expresses (tempfile's folders are ours only for the life of
one process; a build must recognise its folders after a kill -9).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path

from specexport.errors import SpecexportError

MARKER = ".specexport-owner.json"


def create(path: Path, *, by: str, sealed: bool = False) -> Path:
    """Make the folder `path` (its parents as needed) and write its marker before anything else.

    Raises FileExistsError when `path` exists: an existing folder is never taken over by name.
    sealed=True: a folder that holds no files of the command's yet (they are recorded as written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    _write_marker(path, {"by": by, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid(),
                         "files": {} if sealed else None})
    return path


def fresh(parent: Path, prefix: str, *, by: str, suffix: str = "") -> Path:
    """A new open folder `parent/<prefix><8 hex><suffix>` that did not exist before."""
    while True:
        try:
            return create(Path(parent) / f"{prefix}{secrets.token_hex(4)}{suffix}", by=by)
        except FileExistsError:
            continue


def owner(path: Path) -> dict | None:
    """The marker's record, or None when `path` is not a folder specexport marked (or the marker is
    unreadable: then it is not provably ours)."""
    try:
        record = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("by"), str):
        return None
    files = record.get("files")
    if files is not None and not (isinstance(files, dict) and all(isinstance(k, str) for k in files)):
        return None
    return record


def is_owned(path: Path, by: str | None = None) -> bool:
    """True when `path` carries a readable marker (written by the command `by`, when given)."""
    record = owner(path)
    return record is not None and (by is None or record["by"] == by)


def seal(path: Path) -> None:
    """Record every file now in the folder (but those of marked subfolders) as the command's."""
    path = Path(path)
    record = owner(path)
    if record is None:
        raise SpecexportError(f"{path}: not a folder specexport marked; cannot seal it")
    record["files"] = {rel: size for rel, size in _files(path)}
    _write_marker(path, record)


def own_files(path: Path, files: dict[str, int]) -> None:
    """Replace a sealed folder's list of the command's files (after files were moved into it)."""
    record = owner(path)
    if record is None:
        raise SpecexportError(f"{path}: not a folder specexport marked")
    record["files"] = dict(files)
    _write_marker(Path(path), record)


def adopt(path: Path, *, by: str, files: list[str]) -> bool:
    """Mark an unmarked folder as the command's, sealed with exactly `files` (relative paths), when a
    record of ours says we wrote them (an older build's manifest). Files not listed stay foreign.
    Returns False (and writes nothing) when the folder is marked already or is not a folder."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink() or (path / MARKER).exists():
        return False
    listed = {rel: (path / rel).stat().st_size for rel in files if (path / rel).is_file()}
    _write_marker(path, {"by": by, "created": None, "adopted": True, "files": listed})
    return True


def remove(path: Path) -> list[Path]:
    """Delete what the marker proves the command wrote; return what was left alone (foreign).

    Not marked: nothing is touched, [path] is returned. Open: the whole folder goes. Sealed: its
    listed files, marked subfolders (recursively), folders that became empty, and the marker; then
    the folder itself if nothing else is left (else what is left is no longer marked)."""
    path = Path(path)
    record = None if path.is_symlink() else owner(path)
    if record is None:
        return [path] if path.exists() or path.is_symlink() else []
    if record["files"] is None:
        shutil.rmtree(path, ignore_errors=True)
        return []
    emptied = set()
    for rel in record["files"]:
        f = path / rel
        if inside(path, f) and (f.is_file() or f.is_symlink()):
            f.unlink(missing_ok=True)
            emptied.update(p for p in (path / rel).parents if p != path and inside(path, p))
    inner = []
    for child in sorted(path.iterdir()):
        if child.is_dir() and not child.is_symlink() and owner(child) is not None:
            inner += remove(child)
    for folder in sorted(emptied, key=lambda p: -len(p.parts)):    # folders our files left empty
        try:
            folder.rmdir()
        except OSError:
            pass
    rest = [c for c in sorted(path.iterdir()) if c.name != MARKER]
    (path / MARKER).unlink(missing_ok=True)          # nothing of ours is left: what remains is theirs
    if not rest:
        path.rmdir()
        return []
    return inner + [c for c in rest if not (c.is_dir() and not c.is_symlink() and owner(c) is not None)]


def place(partial: Path, dest: Path, *, by: str) -> None:
    """Put the sealed folder `partial` (written whole by the command `by`) at `dest`.

    dest absent: one rename. dest an earlier output of `by` holding nothing else: swapped in (for the
    moment between the two renames there is no dest at all, never a part of one). Otherwise (dest
    holds files of someone else's, which the caller was allowed to write beside with --force, or dest
    is an empty folder): the command's files are moved in one by one, replacing files of the same
    name; files of the earlier output that the new one does not have are deleted; nothing else is
    touched. The caller checks `check_destination` first."""
    partial, dest = Path(partial), Path(dest)
    new = owner(partial)
    if new is None or new["files"] is None:
        raise SpecexportError(f"{partial}: not a sealed specexport folder")
    if not dest.exists():
        os.replace(partial, dest)
        return
    old = owner(dest)
    foreign = [rel for rel in _entries(dest) if old is None or rel not in old["files"]]
    if old is not None and old["by"] == by and not foreign:
        stale = dest.parent / f".{dest.name}.old-{secrets.token_hex(3)}"
        os.replace(dest, stale)
        os.replace(partial, dest)
        remove(stale)
        return
    for rel in new["files"]:           # checked before anything moves: never through a link out of dest
        if not (inside(partial, partial / rel) and _confined(dest, dest / rel)):
            raise SpecexportError(f"{dest}: {rel} would be written outside it (through a symbolic link); "
                                  f"move the link away or write elsewhere")
    for rel in new["files"]:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial / rel, target)
    if old is not None:
        for rel in set(old["files"]) - set(new["files"]):
            if _confined(dest, dest / rel) and not (dest / rel).is_dir():
                (dest / rel).unlink(missing_ok=True)
    record = dict(new)
    _write_marker(dest, record)
    (partial / MARKER).unlink(missing_ok=True)
    shutil.rmtree(partial, ignore_errors=True)       # empty folders left by the moves


def check_destination(dest: Path, *, by: str, force: bool, option: str = "--out") -> None:
    """Refuse, in one line, to write the command's output into a non-empty folder that is not an
    earlier output of the same command, unless `force` (then only the command's files are replaced)."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise SpecexportError(f"{option}: {dest} exists and is not a folder")
    if not dest.is_dir() or not any(dest.iterdir()):
        return
    record = owner(dest)
    if record is not None and record["by"] == by:
        return
    if force:
        return
    who = f"was written by {record['by']}" if record is not None else "was not written by " + by
    raise SpecexportError(f"{option}: {dest} is not empty and {who}; choose an empty or new folder, or pass "
                          f"--force to write {by.split()[-1]}'s files into it (only those are replaced)")


def refuse_overlap(dest: Path, inputs, *, option: str, hint: str) -> None:
    """Refuse an output folder that is, contains or lies inside one of `inputs` [(key, path)]: what the
    command writes or removes there could be an input (a checkpoint, a prompt file)."""
    out = Path(dest).resolve()
    for key, path in inputs:
        where = Path(path).resolve()
        if out == where or out in where.parents:
            raise SpecexportError(f"{option}: {dest} contains {key} ({path}); {hint}")
        if where in out.parents:
            raise SpecexportError(f"{option}: {dest} lies inside {key} ({path}); {hint}")


def claim(path: Path, *, by: str) -> Path:
    """A folder for the command to keep its own files in (a state or work folder): created marked, or
    an existing one of the same command's. Anything else under that name is refused in one line."""
    path = Path(path)
    if not path.exists():
        try:
            return create(path, by=by)
        except FileExistsError:                          # made by a concurrent run meanwhile
            pass
    record = owner(path)
    if record is None or record["by"] != by:
        raise SpecexportError(f"{path}: exists and was not made by {by}; specexport keeps its own files "
                              f"there: move it away")
    return path


# -- helpers -------------------------------------------------------------------------------------

def _write_marker(path: Path, record: dict) -> None:
    tmp = path / f"{MARKER}.{secrets.token_hex(3)}"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path / MARKER)


def _files(root: Path, *, include_marked: bool = False):
    """(relative path, size) of every file under root, but the marker and, unless include_marked,
    what lies in marked subfolders (they answer for themselves)."""
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if not include_marked:
            dirnames[:] = [d for d in dirnames if not (here / d / MARKER).is_file()]
        for name in filenames:
            if here == root and name == MARKER:
                continue
            f = here / name
            yield f.relative_to(root).as_posix(), f.lstat().st_size


def _entries(root: Path):
    """What lies in root, the marker aside, as relative paths: every file, every symbolic link (to a file or a
    folder: never followed) and every empty folder. Whatever of these an earlier output did not list is
    foreign: place() never moves it aside."""
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            if not (here == root and name == MARKER):
                yield (here / name).relative_to(root).as_posix()
        if not dirnames and not filenames and here != root:
            yield here.relative_to(root).as_posix()


def _confined(root: Path, path: Path) -> bool:
    """path lies under root, its parent's links resolved, and is not itself a link to a folder."""
    return inside(root, path.parent) and not (path.is_symlink() and path.is_dir())


def inside(root: Path, path: Path) -> bool:
    """True when `path` (links resolved) is `root` or lies under it."""
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
