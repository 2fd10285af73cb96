"""The verify cost curve c_target(T) / c_target(1), T = 1..64, of a build's target graph, and where the
time of one T-token pass goes (ONNX Runtime's profiler, by op type).

    python benchmarks/verify_cost.py engines/demo [--context 64] [--reps 20] [--profile 1,16]

Sizes are interleaved (one pass of each T per repetition) so drift hits all alike; the figure is the
median per T. The profile runs the same graph in a separate session with profiling on.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from specexport.heads.medusa_tree import verify_costs
from specexport.io_spec import ModelIO
from specexport.manifest import read_manifest, stage_dir
from specexport.runtime.backends.ort import OrtBackend


def profile(model_dir: Path, io: ModelIO, context: int, t: int, reps: int = 20) -> dict[str, float]:
    """Mean microseconds per pass by op type for a T-token pass at `context` committed tokens."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_profiling = True
    opts.profile_file_prefix = f"/tmp/verify_profile_T{t}"
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    cache = np.random.default_rng(0).standard_normal((1, io.num_kv_heads, context + t, io.head_dim)).astype(np.float32)
    feeds = io.feeds(np.resize(np.arange(3, 3 + t), t)[None], past=[cache] * (2 * io.num_layers), past_length=context)
    for _ in range(reps):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    by_op = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"]
    return {op: us / reps for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", default="1,16")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    m = read_manifest(args.build)
    io = ModelIO.from_dict(m["models"]["target"]["io"])
    model_dir = stage_dir(Path(args.build), m, "target", "fp32")
    sizes = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64]
    with OrtBackend(model_dir, io=io, capacity=m["max_seq_len"], max_tokens=64, threads=args.threads) as b:
        c = verify_costs(b, sizes, context=args.context, reps=args.reps)
    print(f"{args.build}: target fp32, context {args.context}, median of {args.reps} interleaved passes")
    print("T      ms     c(T)/c(1)")
    for t in sizes:
        print(f"{t:<4} {c[t] * 1e3:8.3f}   {c[t] / c[1]:.2f}")
    for t in (int(x) for x in args.profile.split(",") if x):
        ops = profile(model_dir, io, args.context, t)
        total = sum(ops.values())
        top = ", ".join(f"{op} {us / total:.0%}" for op, us in list(ops.items())[:8])
        print(f"profile T={t}: {total / 1e3:.2f} ms of kernels per pass: {top}")


if __name__ == "__main__":
    main()
