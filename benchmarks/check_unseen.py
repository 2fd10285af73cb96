"""Done-means checks on a checkpoint the tests never saw (the 110M Llama of make_llama110m.py, GQA +
tied embeddings, and its 2-layer draft), built with `specexport build cap2048.yaml`:

1. greedy speculative output (γ = 1..6) equals Hugging Face greedy `generate`, token for token;
2. with the target as its own draft every proposal is accepted;
3. speculative sampling vs vanilla sampling: a two-sample chi-square test on the first 3 tokens.

    python benchmarks/check_unseen.py --root /tmp/llama110m
"""
import argparse
import json

import numpy as np
import torch
import transformers
from scipy import stats as sps

import specexport
from specexport.io_spec import ModelIO
from specexport.manifest import stage_dir
from specexport.runtime.backends.ort import OrtBackend
from specexport.runtime.loop import DecodeStats, decode
from specexport.runtime.proposers import DraftChain
from specexport.runtime.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/tmp/llama110m")
args = ap.parse_args()
build = f"{args.root}/build-cap2048"
pipe = specexport.load(build)
hf = transformers.AutoModelForCausalLM.from_pretrained(f"{args.root}/target").eval()
rng = np.random.default_rng(1)

print("1. greedy vs HF greedy (5 prompts x 100 tokens, gamma 1..6)")
for p in range(5):
    prompt = [1, *rng.integers(3, 32000, 8).tolist()]
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt)[None], max_new_tokens=100, do_sample=False)[0, len(prompt):].tolist()
    results = [pipe.generate(prompt_ids=prompt, max_new_tokens=100, method="vanilla").token_ids == ref]
    for g in range(1, 7):
        out = pipe.generate(prompt_ids=prompt, max_new_tokens=100, gamma=g)
        results.append(out.token_ids == ref)
    print(f"   prompt {p}: vanilla + gamma 1..6 equal to HF: {results}")

print("2. draft = target")
m = json.load(open(f"{build}/manifest.json"))
io = ModelIO.from_dict(m["models"]["target"]["io"])
t, d = (OrtBackend(stage_dir(build, m, "target", "fp32"), io=io, capacity=2048, max_tokens=64) for _ in range(2))
for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):
    st = DecodeStats()
    list(decode(t, DraftChain(d, 5), np.array([1, 5, 6, 7]), max_new_tokens=60, params=params,
                rng=np.random.default_rng(0), stats=st))
    print(f"   {params}: accepted {st.accepted} of {st.proposed} proposals")


def counts(method, n, seed0):
    c = {}
    for s in range(n):
        key = tuple(pipe.generate(prompt_ids=[1, 300, 301], max_new_tokens=3, method=method, gamma=2,
                                  temperature=1.0, top_k=4, seed=seed0 + s).token_ids)
        c[key] = c.get(key, 0) + 1
    return c


print("3. two-sample test, speculative vs vanilla sampling (temperature 1, top_k 4, 400 runs each)")
a, b = counts("draft", 400, 0), counts("vanilla", 400, 10_000)
keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]])
small = table.sum(0) < 10
table = np.column_stack([table[:, ~small], table[:, small].sum(1)]) if small.any() else table
print(f"   {len(keys)} distinct continuations, chi-square p = {sps.chi2_contingency(table)[1]:.3f}")
