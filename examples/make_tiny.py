"""Make a tiny random Llama target and a 1-layer draft cut from it, for the quick start.

    python examples/make_tiny.py [--out examples/models]

Random weights: the point is the pipeline, not the text. The demo pair trained on the Python
standard library replaces this once it exists.
"""
import argparse
from pathlib import Path

from specexport.export.tiny import make_tiny_checkpoint, truncate_checkpoint

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default=str(Path(__file__).parent / "models"))
args = parser.parse_args()
out = Path(args.out)
make_tiny_checkpoint(out / "tiny-target", "llama", seed=0, num_layers=4, hidden_size=128)
truncate_checkpoint(out / "tiny-target", out / "tiny-draft", num_layers=1)
print(f"wrote {out / 'tiny-target'} and {out / 'tiny-draft'}")
