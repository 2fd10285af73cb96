"""One writer per build output folder at a time.

`specexport build` holds the lock for the whole build; `specexport bench` takes it only to store its
γ choice into the manifest. The lock is an OS file lock (filelock: fcntl on Linux and macOS, msvcrt
on Windows), so a process that dies, even by kill -9, releases it with its file descriptors; the
holder's pid and command sit beside it in a small JSON file, only to say who holds it.
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

LOCK_NAME = ".specexport.lock"
HOLDER_NAME = ".specexport.lock.json"


@contextmanager
def output_lock(output_dir: Path, *, purpose: str, wait_s: float = 0.0):
    """Hold the folder's lock, or raise SpecexportError at once (after `wait_s`) naming the holder."""
    from filelock import FileLock, Timeout

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(output_dir / LOCK_NAME), timeout=wait_s)
    try:
        lock.acquire()
    except Timeout:
        raise SpecexportError(f"output: {output_dir} is in use by another specexport process ({_holder(output_dir)}); "
                              f"wait for it to finish, or build into another output folder") from None
    holder = output_dir / HOLDER_NAME
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
        h = json.loads((output_dir / HOLDER_NAME).read_text())
        return f"{h['purpose']}, pid {h['pid']} on {h['host']} since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
