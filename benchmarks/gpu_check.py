"""One script for a machine with an NVIDIA GPU: the tree-attention kernel and the ORT CUDA backend.

    python benchmarks/gpu_check.py [--build engines/demo] [--out gpu_check.json] [--quick]

1. Kernel correctness at decode/verify shapes (T 1..64 tree tokens, context 128..8192, fp16, GQA shapes of
   SmolLM2-135M and Llama-3-8B, random tree masks): the Triton kernel on the GPU against the float64
   numpy reference and against torch's scaled_dot_product_attention (an independent implementation).
2. Kernel timing (CUDA events, median of repeats): achieved GB/s of K/V read against the device's peak
   memory bandwidth, and torch SDPA's time at the same shape for comparison.
3. PTX for this device's architecture (what the TensorRT plugin's AOT implementation hands TensorRT).
4. With --build (a finished `specexport build`): the ONNX Runtime CUDA backend on it, vanilla and
   speculative greedy decoding against the CPU backend's output, with tokens/s.
Writes everything to --out (JSON) and prints a summary; exits 1 if a correctness check fails. Needs
torch with CUDA and triton; part 4 needs onnxruntime-gpu. On a machine without a GPU it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}     # (Hq, Hkv, D)
TREE_TOKENS = (1, 4, 16, 64)
CONTEXTS = (128, 1024, 8192)
# HBM/LPDDR peak bandwidth, GB/s, for devices whose torch properties lack the memory clock / bus width
PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "RTX 4090": 1008, "Orin": 204.8, "Thor": 273}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, help="a finished build for the ORT CUDA check (e.g. engines/demo)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing to check here", file=sys.stderr)
        return 2
    report = {"device": _device(torch), "kernel": [], "ptx": None, "ort_cuda": None, "failures": []}
    print(f"device: {report['device']}")
    contexts = CONTEXTS[:2] if args.quick else CONTEXTS
    for name, (hq, hkv, d) in SHAPES.items():
        for s in contexts:
            for t in TREE_TOKENS:
                row = _kernel_case(torch, name, hq, hkv, d, t, s, report["device"]["peak_gbps"],
                                   repeats=20 if args.quick else 100)
                report["kernel"].append(row)
                ok = row["max_err_vs_reference"] < 2e-2 and row["max_err_vs_sdpa"] < 2e-2
                if not ok:
                    report["failures"].append(f"kernel {name} T={t} S={s}: errors {row['max_err_vs_reference']:.3g}"
                                              f" / {row['max_err_vs_sdpa']:.3g}")
                print(f"  {name:13s} T={t:3d} S={s:5d}: err {row['max_err_vs_reference']:.2e} (ref) "
                      f"{row['max_err_vs_sdpa']:.2e} (sdpa), {row['kernel_us']:8.1f} us, {row['kv_gbps']:7.1f} GB/s "
                      f"({row['of_peak']:.0%} of peak), sdpa {row['sdpa_us']:8.1f} us" + ("" if ok else "  FAIL"))
    report["ptx"] = _ptx(report["device"]["arch"])
    print(f"ptx for {report['ptx']['arch']}: {report['ptx']['chars']} chars, entry {report['ptx']['name']}")
    if args.build:
        report["ort_cuda"] = _ort_cuda(args.build, args.prompts, report["failures"])
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}; " + ("all checks passed" if not report["failures"] else
                                  f"{len(report['failures'])} FAILED: " + "; ".join(report["failures"])))
    return 1 if report["failures"] else 0


def _device(torch) -> dict:
    p = torch.cuda.get_device_properties(0)
    clock = getattr(p, "memory_clock_rate", 0)            # kHz, where torch exposes it
    width = getattr(p, "memory_bus_width", 0)             # bits
    peak = 2 * clock * 1e3 * width / 8 / 1e9 if clock and width else \
        next((v for k, v in PEAK_GBPS.items() if k in p.name), None)
    return {"name": p.name, "arch": f"sm_{p.major}{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
            "peak_gbps": peak, "torch": torch.__version__, "cuda": torch.version.cuda}


def _tree_mask(rng, t: int, s: int) -> np.ndarray:
    """[t, s]: the committed s - t positions visible to every token, a random tree's ancestor mask last."""
    from specexport.export.validate import ancestor_mask, random_tree

    mask = np.ones((t, s), bool)
    mask[:, s - t:] = ancestor_mask(random_tree(rng, t)) if t > 1 else True
    return mask


def _kernel_case(torch, name, hq, hkv, d, t, s, peak, repeats: int) -> dict:
    from specexport.plugins.tree_attention import launch, reference

    rng = np.random.default_rng(t * 100003 + s)
    q = rng.standard_normal((t, hq, d)).astype(np.float16)
    k = rng.standard_normal((s, hkv, d)).astype(np.float16)
    v = rng.standard_normal((s, hkv, d)).astype(np.float16)
    mask = _tree_mask(rng, t, s)
    dq, dk, dv = (torch.from_numpy(a).cuda() for a in (q, k, v))
    dm = torch.from_numpy(mask.astype(np.int8)).cuda()
    out = launch(dq, dk, dv, dm)
    got = out.float().cpu().numpy()
    ref = reference(q, k, v, mask).astype(np.float32)
    # torch's attention as the independent implementation: [1, H, T, D] with K/V heads repeated
    g = hq // hkv
    tq = dq.permute(1, 0, 2)[None]
    tk = dk.permute(1, 0, 2).repeat_interleave(g, 0)[None]
    tv = dv.permute(1, 0, 2).repeat_interleave(g, 0)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expect = sdpa(tq, tk, tv, attn_mask=dm.bool()[None, None])[0].permute(1, 0, 2).float().cpu().numpy()
    kernel_s = _time(torch, lambda: launch(dq, dk, dv, dm, out=out), repeats)
    sdpa_s = _time(torch, lambda: sdpa(tq, tk, tv, attn_mask=dm.bool()[None, None]), repeats)
    kv_bytes = 2 * s * hkv * d * 2
    gbps = kv_bytes / kernel_s / 1e9
    return {"shape": name, "T": t, "S": s, "Hq": hq, "Hkv": hkv, "D": d, "dtype": "fp16",
            "max_err_vs_reference": float(np.abs(got - ref).max()), "max_err_vs_sdpa": float(np.abs(got - expect).max()),
            "kernel_us": kernel_s * 1e6, "sdpa_us": sdpa_s * 1e6, "kv_bytes": kv_bytes, "kv_gbps": gbps,
            "of_peak": gbps / peak if peak else math.nan}


def _time(torch, fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _ptx(arch: str) -> dict:
    from specexport.plugins.tree_attention import compile_kernel

    k = compile_kernel(arch)
    return {"arch": arch, "chars": len(k["ptx"]), "name": k["name"], "num_warps": k["num_warps"]}


def _ort_cuda(build: Path, n_prompts: int, failures: list) -> dict:
    import specexport
    from specexport.report.bench import DEFAULT_PROMPTS

    prompts = list(DEFAULT_PROMPTS)[:n_prompts]
    result = {"build": str(build), "rows": []}
    try:
        cuda = specexport.load(build, device="cuda")
    except Exception as err:                       # report, do not hide, why the backend did not open
        failures.append(f"ORT CUDA backend: {err}")
        result["error"] = str(err)
        return result
    with cuda, specexport.load(build) as cpu:
        for method in ("vanilla", "draft"):
            for prompt in prompts:
                want = cpu.generate(prompt, max_new_tokens=64, method=method).token_ids
                start = time.perf_counter()
                out = cuda.generate(prompt, max_new_tokens=64, method=method)
                seconds = time.perf_counter() - start
                same = out.token_ids == want
                result["rows"].append({"method": method, "prompt": prompt, "tokens": len(out.token_ids),
                                       "tokens_per_s": out.stats.tokens_per_second, "wall_s": seconds,
                                       "equal_to_cpu": same, "acceptance": out.stats.acceptance_rate})
                print(f"  ort cuda {method:7s} {out.stats.tokens_per_second:8.1f} tok/s, equal to cpu: {same}")
                if not same:
                    # fp32 on two devices can differ in the last bits and flip a near-tie; say so, do not fail
                    result.setdefault("notes", []).append(f"{method} on {prompt!r} differs from the CPU output")
        for prompt in prompts:
            if cuda.generate(prompt, max_new_tokens=64, method="draft").token_ids != \
                    cuda.generate(prompt, max_new_tokens=64, method="vanilla").token_ids:
                failures.append(f"ORT CUDA: speculative greedy differs from vanilla greedy on {prompt!r}")
    return result


if __name__ == "__main__":
    sys.exit(main())
