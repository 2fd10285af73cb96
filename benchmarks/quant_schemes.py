"""Issue 14 item 1: which ONNX Runtime CPU quantization scheme keeps a verify pass cheap?

    python benchmarks/quant_schemes.py engines/demo [--schemes all] [--reps 15] [--context 64]

Makes each scheme's graph from the build's fp32 target graph (in a temporary folder), then for each:
  - row independence: a token's logits computed inside a 12-token pass vs as a 1-token step after
    the other 11 (quality.row_dependence; the build also checks 2-token passes and pads one-token
    calls of a target whose 1-token figure fails, `min_tokens`) (relative difference; a scheme whose rows depend on each other makes speculative
    output differ from its own vanilla output, so it cannot be a lossless target);
  - quality against fp32 (top-1 agreement, mean KL) on 4 x 64 tokens sampled from the fp32 graph;
  - the cost curve c(T)/c(1), T = 1..16, at `--context` committed tokens: every scheme and size
    interleaved per repetition, medians; and c(1) in ms beside fp32's.

Schemes: MatMulNBits (8 and 4 bits, block 32 or 128, accuracy_level 4 = int8 compute or 1 = fp32
compute), dynamic U8S8 (`quantize_dynamic`: DynamicQuantizeLinear + MatMulInteger), static QDQ U8S8
(`quantize_static`, MinMax on 4 sampled sequences other than the quality check's, per-tensor
activations, per-channel weights): the build's own schemes (quant/quantize.py), with their options.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from specexport.quant.quality import (
    measure_quality,
    row_dependence,
    runtime_session,
    sampled_sequences,
)
from specexport.quant.quantize import quantize_graph
from specexport.io_spec import ModelIO
from specexport.manifest import read_manifest, stage_dir
from specexport.runtime.backends.ort import OrtBackend

SIZES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
SCHEMES = {   # name -> (precision, the model.yaml quantization settings: quant/quantize.py)
    "nbits8-b32-a4": ("int8", {"scheme": "matmulnbits", "block_size": 32, "accuracy_level": 4}),
    "nbits8-b32-a1": ("int8", {"scheme": "matmulnbits", "block_size": 32, "accuracy_level": 1}),
    "nbits8-b128-a4": ("int8", {"scheme": "matmulnbits", "block_size": 128, "accuracy_level": 4}),
    "nbits8-b128-a1": ("int8", {"scheme": "matmulnbits", "block_size": 128, "accuracy_level": 1}),
    "nbits4-b32-a4": ("int4", {"scheme": "matmulnbits", "block_size": 32, "accuracy_level": 4}),
    "nbits4-b128-a4": ("int4", {"scheme": "matmulnbits", "block_size": 128, "accuracy_level": 4}),
    "nbits4-b32-a1": ("int4", {"scheme": "matmulnbits", "block_size": 32, "accuracy_level": 1}),
    "dynamic-u8s8": ("int8", {"scheme": "dynamic"}),
    "static-qdq-u8s8": ("int8", {"scheme": "static_qdq"}),
    "static-qdq-fp32head": ("int8", {"scheme": "static_qdq", "lm_head": "fp32"}),
    "static-qdq-pct": ("int8", {"scheme": "static_qdq", "calibrate": "percentile"}),
    "static-qdq-sq5": ("int8", {"scheme": "static_qdq", "smooth_alpha": 0.5}),
    "static-qdq-sq5-fp32head": ("int8", {"scheme": "static_qdq", "smooth_alpha": 0.5, "lm_head": "fp32"}),
    "static-qdq-sq8-fp32head": ("int8", {"scheme": "static_qdq", "smooth_alpha": 0.8, "lm_head": "fp32"}),
    "static-qdq-sq5-pct-fp32head": ("int8", {"scheme": "static_qdq", "smooth_alpha": 0.5, "calibrate": "percentile",
                                             "lm_head": "fp32"}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--schemes", default="all")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=64)
    args = ap.parse_args()
    m = read_manifest(args.build)
    io = ModelIO.from_dict(m["models"]["target"]["io"])
    source = stage_dir(Path(args.build), m, "target", "fp32") / "model.onnx"
    names = list(SCHEMES) if args.schemes == "all" else args.schemes.split(",")
    reference = runtime_session(source)
    bos = m["special_tokens"]["bos_token_id"]
    sequences = sampled_sequences(reference, io, start=bos, length=64, count=4)
    calibration = sampled_sequences(reference, io, start=bos, length=64, count=4, seed=1)   # not the gate's
    probe = sequences[0][:12]
    rows, backends = {"fp32": {"row": row_dependence(reference, io, probe, last=1)}}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            precision, scheme = SCHEMES[name]
            dest = Path(tmp) / name / "model.onnx"
            dest.parent.mkdir()
            start = time.perf_counter()
            try:
                quantize_graph(source, dest, precision, scheme=scheme, io=io, calibration=calibration)
            except Exception as err:                    # report and go on: a scheme may not apply
                rows[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                continue
            session = runtime_session(dest)
            quality = measure_quality(reference, session, io, sequences=sequences)
            size = sum(f.stat().st_size for f in dest.parent.iterdir()) / 2 ** 20
            rows[name] = {"row": row_dependence(session, io, probe, last=1), "top1": quality.top1_agreement,
                          "kl": quality.mean_kl, "mib": size, "seconds": time.perf_counter() - start}
            del session
            backends[name] = OrtBackend(dest.parent, io=io, capacity=args.context + 32, max_tokens=max(SIZES), spin=False)
        backends["fp32"] = OrtBackend(source.parent, io=io, capacity=args.context + 32, max_tokens=max(SIZES), spin=False)
        ctx = np.resize(sequences[0], args.context)
        for b in backends.values():
            b.forward(ctx[:16], phase="prefill")
            b.commit(16)
            for i in range(16, args.context, 16):
                b.forward(ctx[i:i + 16], phase="prefill")
                b.commit(16)
        times = {(n, t): [] for n in backends for t in SIZES}
        for _ in range(args.reps):
            for n, b in backends.items():
                b.forward(ctx[:1])          # untimed: wakes this session's thread pool after the others ran
                for t in SIZES:
                    start = time.perf_counter()
                    b.forward(ctx[:t])
                    times[n, t].append(time.perf_counter() - start)
        for n, b in backends.items():
            rows[n]["c"] = {t: statistics.median(times[n, t]) for t in SIZES}
            b.close()
    fp32_c1 = rows["fp32"]["c"][1]
    print(f"{args.build}: target, context {args.context}, median of {args.reps} interleaved passes")
    head = "scheme             MiB   row-dep  top-1   KL      c(1) ms  vs fp32  " + "  ".join(f"T={t:<2}" for t in SIZES[1:])
    print(head)
    for n, r in rows.items():
        if "error" in r:
            print(f"{n:<18} failed: {r['error']}")
            continue
        c = r["c"]
        curve = "  ".join(f"{c[t] / c[1]:4.2f}" for t in SIZES[1:])
        quality = f"{r['top1']:.3f}  {r['kl']:.4f}" if "top1" in r else "  -      -    "
        print(f"{n:<18} {r.get('mib', float('nan')):6.1f} {r['row']:8.1e}  {quality}  {c[1] * 1e3:7.2f}  "
              f"{c[1] / fp32_c1:6.2f}   {curve}")


if __name__ == "__main__":
    main()
