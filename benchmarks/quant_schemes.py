"""Issue 14 item 1: which ONNX Runtime CPU quantization scheme keeps a verify pass cheap?

    python benchmarks/quant_schemes.py engines/demo [--schemes all] [--reps 15] [--context 64]

Makes each scheme's graph from the build's fp32 target graph (in a temporary folder), then for each:
  - row independence: a token's logits computed inside a 12-token pass vs as a 1-token step after
    the other 11 (relative difference; a scheme whose rows depend on each other makes speculative
    output differ from its own vanilla output, so it cannot be a lossless target);
  - quality against fp32 (top-1 agreement, mean KL) on 4 x 64 tokens sampled from the fp32 graph;
  - the cost curve c(T)/c(1), T = 1..16, at `--context` committed tokens: every scheme and size
    interleaved per repetition, medians; and c(1) in ms beside fp32's.

Schemes: MatMulNBits (8 and 4 bits, block 32 or 128, accuracy_level 4 = int8 compute or 1 = fp32
compute), dynamic U8S8 (`quantize_dynamic`: DynamicQuantizeLinear + MatMulInteger), static QDQ U8S8
(`quantize_static`, MinMax on 4 sampled sequences, per-tensor activations, per-channel weights).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from specexport.export.quality import measure_quality, row_dependence, runtime_session, sampled_sequences
from specexport.io_spec import ModelIO
from specexport.manifest import read_manifest, stage_dir
from specexport.runtime.backends.ort import OrtBackend

SIZES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
SCHEMES = {
    "nbits8-b32-a4": ("nbits", {"bits": 8, "block_size": 32, "accuracy_level": 4}),
    "nbits8-b32-a1": ("nbits", {"bits": 8, "block_size": 32, "accuracy_level": 1}),
    "nbits8-b128-a4": ("nbits", {"bits": 8, "block_size": 128, "accuracy_level": 4}),
    "nbits4-b32-a4": ("nbits", {"bits": 4, "block_size": 32, "accuracy_level": 4}),
    "nbits4-b128-a4": ("nbits", {"bits": 4, "block_size": 128, "accuracy_level": 4}),
    "nbits4-b32-a1": ("nbits", {"bits": 4, "block_size": 32, "accuracy_level": 1}),
    "nbits8-b128-a1": ("nbits", {"bits": 8, "block_size": 128, "accuracy_level": 1}),
    "dynamic-u8s8": ("dynamic", {}),
    "static-qdq-u8s8": ("static", {}),
}


@contextlib.contextmanager
def quiet():
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def make(kind: str, options: dict, source: Path, dest: Path, io: ModelIO, calibration: list[np.ndarray]) -> None:
    import onnx
    from onnxruntime import quantization as q

    with quiet():
        if kind == "nbits":
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), is_symmetric=False, **options)
            quantizer.process()
            quantizer.model.save_model_to_file(str(dest), use_external_data_format=True)
        elif kind == "dynamic":
            q.quantize_dynamic(str(source), str(dest), op_types_to_quantize=["MatMul"], weight_type=q.QuantType.QInt8,
                               per_channel=False, use_external_data_format=True)
        else:
            class Reader(q.CalibrationDataReader):
                def __init__(self):
                    self.feeds = iter([io.feeds(s[None]) for s in calibration])

                def get_next(self):
                    return next(self.feeds, None)

            q.quantize_static(str(source), str(dest), Reader(), quant_format=q.QuantFormat.QDQ,
                              op_types_to_quantize=["MatMul"], activation_type=q.QuantType.QUInt8,
                              weight_type=q.QuantType.QInt8, per_channel=True, use_external_data_format=True,
                              calibrate_method=q.CalibrationMethod.MinMax)


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
    probe = sequences[0][:12]
    rows, backends = {"fp32": {"row": row_dependence(reference, io, probe)}}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            kind, options = SCHEMES[name]
            dest = Path(tmp) / name / "model.onnx"
            dest.parent.mkdir()
            start = time.perf_counter()
            try:
                make(kind, options, source, dest, io, sequences)
            except Exception as err:                    # report and go on: a scheme may not apply
                rows[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                continue
            session = runtime_session(dest)
            quality = measure_quality(reference, session, io, sequences)
            size = sum(f.stat().st_size for f in dest.parent.iterdir()) / 2 ** 20
            rows[name] = {"row": row_dependence(session, io, probe), "top1": quality.top1_agreement,
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
