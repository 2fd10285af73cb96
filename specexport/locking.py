"""One writer per build output folder at a time.

`specexport build` holds the lock for the whole build; `specexport bench` takes it only to store its
γ choice into the manifest. The lock is an OS file lock (filelock: fcntl on Linux and macOS, msvcrt
on Windows), so a process that dies, even by kill -9, releases it with its file descriptors; the
holder's pid and command sit beside it in a small JSON file, only to say who holds it. Both live in
the output's work folder `.specexport/` (marked as specexport's: `specexport.owned`), with the temporary
files of its atomic writes, so nothing of the user's in the output folder is ever opened for writing.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from specexport.errors import SpecexportError

WORK_DIR = ".specexport"
LOCK_NAME = "lock"
HOLDER_NAME = "lock.json"


def work_dir(output_dir: Path) -> Path:
    """The output folder's own work folder (created, marked, on first use)."""
    from specexport import owned

    return owned.claim(Path(output_dir) / WORK_DIR, by="specexport")


@contextmanager
def output_lock(output_dir: Path, *, purpose: str, wait_s: float = 0.0):
    """Hold the folder's lock, or raise SpecexportError at once (after `wait_s`) naming the holder."""
    from filelock import FileLock, Timeout

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    work = work_dir(output_dir)
    lock = FileLock(str(work / LOCK_NAME), timeout=wait_s)
    try:
        lock.acquire()
    except Timeout:
        raise SpecexportError(f"output: {output_dir} is in use by another specexport process ({_holder(output_dir)}); "
                              f"wait for it to finish, or build into another output folder") from None
    holder = work / HOLDER_NAME
    try:
        holder.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "purpose": purpose,
                                      "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                      "command": " ".join(sys.argv)}))
        yield
    finally:
        holder.unlink(missing_ok=True)
        lock.release()


def _holder(output_dir: Path) -> str:
    try:
        h = json.loads((output_dir / WORK_DIR / HOLDER_NAME).read_text())
        return f"{h['purpose']}, pid {h['pid']} on {h['host']} since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
