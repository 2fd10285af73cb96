"""Issue 10's done-means on a target the tests never saw (SmolLM2-135M-Instruct from
make_smollm2.py by default):

1. Medusa heads written in a published layout (random weights, Medusa-1 `medusa_lm_head.pt` via
   torch.save, a config.json whose medusa_num_heads is wrong) build, and decode greedily equal to
   vanilla (prompts x 100 tokens, trees auto and medium);
2. heads trained with `specexport train-heads` (--trained DIR): tokens per target pass on held-out
   prompts (greedy), and greedy equality;
3. sampled Medusa output (temperature 1, top-k 4): a G-test of tokens 1-2 against the target graph's
   exact distribution;
4. prompt lookup equals vanilla and gains on a prompt that repeats itself (decode-time tok/s, 5 pairs).

    python benchmarks/check_medusa.py --target /tmp/smollm2 --work /tmp/medusa-check [--trained DIR]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import specexport  # noqa: E402
from fakes import goodness_of_fit  # noqa: E402  (the tests' G-test)
from specexport.runtime.sampling import SamplingParams, warp  # noqa: E402

PROMPTS = ["def binary_search(items, target):", "import json\n\ndef load_config(path):",
           "class LinkedList:\n    def __init__(self):", "def parse_args():\n    parser = argparse.ArgumentParser(",
           "for i in range(10):", "def merge_sort(xs):", "with open('data.csv') as f:", "async def fetch(url):"]


def build(work: Path, name: str, target: Path, heads: Path) -> Path:
    cfg = {"name": "medusa-check", "target": {"path": str(target)}, "medusa": {"path": str(heads)},
           "max_seq_len": 512, "output": str(work / name)}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "specexport", "build", str(work / f"{name}.yaml"), "--no-bench"], check=True)
    return work / name


def random_published_heads(target: Path, out: Path, heads: int = 4) -> Path:
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target)
    H, V = cfg.hidden_size, cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    state = {}
    for h in range(heads):
        state[f"{h}.0.linear.weight"] = torch.randn(H, H, generator=g) * 0.02
        state[f"{h}.0.linear.bias"] = torch.zeros(H)
        state[f"{h}.1.weight"] = torch.randn(V, H, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / "medusa_lm_head.pt")
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": heads + 1, "medusa_num_layers": 1,
                                                 "base_model_name_or_path": str(target)}))
    return out


def greedy_equal(pipe, trees, n_tokens=100) -> dict:
    passes = {}
    for tree in trees:
        tokens = rounds = 0
        for p in PROMPTS:
            ref = pipe.generate(p, max_new_tokens=n_tokens, method="vanilla").token_ids
            out = pipe.generate(p, max_new_tokens=n_tokens, method="medusa", tree=tree)
            assert out.token_ids == ref, (tree, p)
            tokens += out.stats.emitted - 1
            rounds += out.stats.target_passes
        passes[tree] = tokens / rounds
    return passes


def sampled_gtest(pipe, runs=3000) -> str:
    """Tokens 1-2 after a fixed prompt (the second from the Medusa round), against p(t1) p(t2 | t1)."""
    from specexport.runtime.loop import prefill

    params = SamplingParams(1.0, top_k=4)
    prompt = pipe.encode("def fibonacci(n):")

    def probs(ids):
        pipe.target.reset()
        return warp(prefill(pipe.target, np.asarray(ids), 64).astype(np.float64), params)

    p1 = probs(prompt)
    exact = {int(a): p1[a] * probs(prompt + [int(a)]) for a in np.flatnonzero(p1)}      # t1 -> [V] joint
    cells = [(a, int(b)) for a in exact for b in np.flatnonzero(exact[a])]
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    for seed in range(runs):
        out = pipe.generate(prompt_ids=prompt, max_new_tokens=3, method="medusa", temperature=1.0, top_k=4, seed=seed)
        pair = tuple(out.token_ids[:2])
        assert pair in index, f"emitted {pair}, outside the top-k support"
        counts[index[pair]] += 1
    return str(goodness_of_fit(counts, np.array([exact[a][b] for a, b in cells])))


def lookup_check(pipe) -> str:
    text = "def add(a, b):\n    return a + b\n\n" * 6
    ref = pipe.generate(text, max_new_tokens=100, method="vanilla")
    out = pipe.generate(text, max_new_tokens=100, method="lookup", gamma=4)
    assert out.token_ids == ref.token_ids
    v, s = [], []
    for _ in range(5):
        v.append(pipe.generate(text, max_new_tokens=100, method="vanilla").stats.tokens_per_second)
        s.append(pipe.generate(text, max_new_tokens=100, method="lookup", gamma=4).stats.tokens_per_second)
    return (f"lookup equals vanilla; on a repeating prompt {statistics.median(s):.1f} vs {statistics.median(v):.1f} "
            f"tok/s = {statistics.median(s) / statistics.median(v):.2f}x, "
            f"{out.stats.mean_accepted_tokens:.2f} tokens per pass")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="/tmp/smollm2")
    ap.add_argument("--work", default="/tmp/medusa-check")
    ap.add_argument("--trained", default=None, help="heads made by specexport train-heads")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = build(work, "published", Path(args.target), random_published_heads(Path(args.target), work / "heads-pt"))
    with specexport.load(out) as pipe:
        h = pipe.manifest["heads"]["medusa"]
        print(f"1. published layout ({h['format']}, {h['file']}; config says {h['config_num_heads']} heads, keys "
              f"{h['num_heads']}): parity {h['precisions']['fp32']['parity_max_rel_error']:.1e}; greedy equal "
              f"to vanilla on {len(PROMPTS)} prompts x 100 tokens, tokens per pass {greedy_equal(pipe, ['auto', 'medium'])}")
        print(f"4. {lookup_check(pipe)}")
    if args.trained:
        if not (work / "trained").exists():          # the target stage is reused, only the heads are built
            shutil.copytree(out, work / "trained")
        out = build(work, "trained", Path(args.target), Path(args.trained))
        with specexport.load(out) as pipe:
            auto = pipe.manifest["heads"]["medusa"]["auto_tree"]
            print(f"2. trained heads: accuracy top-1 per head {[round(a[0], 3) for a in auto['accuracy']]}, auto tree "
                  f"{auto['nodes']} nodes; greedy equal, tokens per target pass "
                  f"{greedy_equal(pipe, ['auto', 'small', 'medium'])}")
            print(f"3. sampled Medusa (T=1, top-k 4), tokens 1-2 vs the exact distribution: {sampled_gtest(pipe)}")


if __name__ == "__main__":
    main()
