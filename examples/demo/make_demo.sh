#!/usr/bin/env bash
# Reproduce the demo pair from scratch, seeded, on CPU (about 105 minutes on 2 cores; the measured
# time is written to examples/demo/models/RUNTIME.txt). Run from the repository root.
# Target: 8 layers trained from scratch (~33 min), then deepened to 11 layers with identity blocks and
# trained on (~23 min): a deeper, costlier step within the 25 MB of shipped weights. Draft: 2 layers
# x 192 distilled from it (two layers so it can learn to copy from context, which code does a lot).
# Medusa heads: 4 heads trained on the target's own continuations (train-heads); an EAGLE-3 head likewise.
set -euo pipefail
start=$(date +%s)
out=examples/demo/models
python examples/demo/train_demo.py --out "$out"
python examples/demo/train_demo.py --out "$out" --init "$out/target" --layers 11 --steps 400 --lr 4e-4 --warmup 20 \
  --seed 1
# train_demo.py writes its training-file list (held-out files excluded); the draft learns from those.
specexport distill-draft "$out/target" --out "$out/draft" --corpus "$out/train_files.txt" \
  --layers 2 --hidden-size 192 --num-prompts 2048 --prompt-tokens 32 --new-tokens 96 \
  --steps 3000 --batch-size 16 --lr 2e-3 --seed 0 --device cpu
python - "$out/draft" <<'PY'
import sys, torch, transformers
path = sys.argv[1]
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
model.to(torch.float16).save_pretrained(path)          # ship fp16, like the target
PY
# Medusa heads for the target, self-distilled on the same training files, written fp16 in the Medusa-1 layout.
specexport train-heads "$out/target" --kind medusa --heads 4 --out "$out/medusa" --corpus "$out/train_files.txt" \
  --num-prompts 1024 --prompt-tokens 32 --new-tokens 96 --steps 600 --batch-size 16 --lr 2e-3 --seed 0 \
  --dtype float16 --device cpu
# An EAGLE-3 head for the target (the whole 2048-token vocabulary), the same training files, written fp16.
specexport train-heads "$out/target" --kind eagle3 --out "$out/eagle3" --corpus "$out/train_files.txt" \
  --num-prompts 2048 --prompt-tokens 32 --new-tokens 96 --steps 1500 --batch-size 16 --lr 1e-3 --seed 0 \
  --dtype float16 --device cpu
rm -rf "$out/.draft.distill" "$out/.medusa.heads" "$out/.eagle3.heads" "$out/train_files.txt"
echo "make_demo.sh: $(( $(date +%s) - start )) s on $(nproc) cores, $(date -u +%F)" > "$out/RUNTIME.txt"
