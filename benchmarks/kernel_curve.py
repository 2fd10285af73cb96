"""The cost of a quantized matmul as the rows of a pass grow, M = 1..16, 32, 64, 512: specexport's own CPU
kernels (specexport/plugins/cpu: GgufMatMul on the file's blocks) against ONNX Runtime's `MatMulNBits` as the
stock `gguf` route stores each GGUF block type, timed alone on shapes of Qwen2.5-Coder-1.5B, against this
machine's read bandwidth measured in the same run.

    python benchmarks/kernel_curve.py [--threads 2] [--reps 15] [--rows 1,2,...] [--shapes qwen1.5b] [--ops ours,nbits]

Per (type, shape, M): the median µs of one node (configurations interleaved per repetition; each session holds
enough copies of the node, each with its own weights, to read 64 MiB a run, so the weights come from DRAM as a
model's do, not from the last-level cache; every session on one shared thread pool), the weight bytes it must
read divided by that time (GB/s), c(M)/c(1), and bytes per weight against the GGUF file's. The read
bandwidth is numpy's integer max over a 1 GiB array (one thread) and ONNX Runtime's ReduceSum over it (--threads),
the larger taken as the machine's. llama.cpp's kernels on the same shapes: `test-backend-ops perf -o MUL_MAT`
from a llama.cpp build with tests (not built by benchmarks/build_llama_cpp.py: its figures are not in this table).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

# GGUF block types as the gguf route stores them for MatMulNBits (quant/gguf_blocks.py): (bits, block) and the
# file's bytes per weight. 5- and 6-bit codes are widened to 8 bits; Q6_K keeps its 16-weight sub-blocks.
TYPES = {
    "Q4_0": (4, 32, 18 / 32),
    "Q4_1": (4, 32, 20 / 32),          # + a block-sum correction product in the graph, not timed here
    "Q4_K": (4, 32, 144 / 256),        # + a block-sum correction product in the graph, not timed here
    "Q6_K": (8, 16, 210 / 256),
    "Q8_0": (8, 32, 34 / 32),
}
SHAPES = {   # (K, N): Qwen2.5-Coder-1.5B's attention q/o, MLP up/gate, MLP down
    "qwen1.5b": [(1536, 1536), (1536, 8960), (8960, 1536)],
    "small": [(576, 1536)],
    "smollm2": [(576, 576), (576, 1536), (1536, 576), (576, 49152)],   # q/o, up/gate, down, the tied lm_head
}


def matmul_nbits(K: int, N: int, bits: int, block: int, accuracy_level: int, threads: int):
    """A session of `copies(...)` MatMulNBits nodes on one A, random codes and scales; returns (session, weight
    bytes of one node, copies)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    blocks = K // block
    codes = rng.integers(0, 256, size=(N, blocks, block * bits // 8), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(N * blocks,)).astype(np.float32)
    n = copies(codes.nbytes + scales.nbytes)
    nodes = [helper.make_node("MatMulNBits", ["A", f"B{i}", f"scales{i}"], [f"Y{i}"], domain="com.microsoft", K=K, N=N,
                              bits=bits, block_size=block, accuracy_level=accuracy_level) for i in range(n)]
    weights = [t for i in range(n) for t in (numpy_helper.from_array(codes, f"B{i}"), numpy_helper.from_array(scales, f"scales{i}"))]
    return _session(nodes, weights, K, N, "com.microsoft", threads), codes.nbytes + scales.nbytes, n


def gguf_matmul(K: int, N: int, qtype: str, threads: int):
    """A session of `copies(...)` GgufMatMul nodes (our kernels) on one A, random valid blocks; returns (session,
    weight bytes of one node, copies)."""
    from onnx import helper, numpy_helper

    from specexport.plugins import cpu
    from specexport.quant.gguf_blocks import random_blocks

    status = cpu.status()
    if not status.available:
        raise SystemExit(status.line())
    w = random_blocks(np.random.default_rng(0), qtype, N, k=K)
    n = copies(w.nbytes)
    nodes = [helper.make_node("GgufMatMul", ["A", f"W{i}"], [f"Y{i}"], domain=cpu.DOMAIN, type=cpu.TYPES[qtype], K=K, N=N)
             for i in range(n)]
    return _session(nodes, [numpy_helper.from_array(w, f"W{i}") for i in range(n)], K, N, cpu.DOMAIN, threads), w.nbytes, n


def copies(nbytes: int) -> int:
    """Nodes per session, each with its own copy of the weights: enough to read 64 MiB a run, more than this
    machine's last-level cache (32 MiB here), so each node streams its weights from DRAM as a model's do."""
    return max(1, min(32, -(-(64 << 20) // nbytes)))


def _session(nodes, weights, K: int, N: int, domain: str, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specexport.plugins import cpu

    graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, ["M", N]) for n in nodes],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    opts = ort.SessionOptions()
    _shared_pool(opts, threads)
    if domain == cpu.DOMAIN:
        opts.register_custom_ops_library(str(cpu.status().library))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _shared_pool(opts, threads: int) -> None:
    """Every session on one process-wide pool of `threads` threads: sessions interleaved with pools of their
    own leave threads spinning after each run, which steal the cores from the next session's (the numbers
    came out 2x noisy that way)."""
    import onnxruntime.capi._pybind_state as C

    global _POOL
    if _POOL is None:
        C.set_global_thread_pool_sizes(threads, 1)     # before the first session: it creates the environment
        _POOL = threads
    if _POOL != threads:
        raise SystemExit(f"one thread count per run (the pool has {_POOL})")
    opts.use_per_session_threads = False


_POOL = None


def read_bandwidth(threads: int, reps: int = 5) -> dict:
    """GB/s reading a 1 GiB array: numpy's integer max (one thread) and ONNX Runtime's ReduceSum (`threads`)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    data = np.ones(2**28, np.float32)                     # 1 GiB
    words = data.view(np.uint64)                          # an integer max: vectorized, bound by the read alone
    numpy_s = min(_timed(lambda: words.max()) for _ in range(reps))
    node = helper.make_node("ReduceSum", ["X"], ["Y"], keepdims=0)
    graph = helper.make_graph([node], "r", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2**28])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])])
    opts = ort.SessionOptions()
    _shared_pool(opts, threads)
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
                                   .SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ort_s = min(_timed(lambda: session.run(None, {"X": data})) for _ in range(reps))
    return {"numpy_1_thread": data.nbytes / numpy_s / 1e9, f"onnxruntime_{threads}_threads": data.nbytes / ort_s / 1e9}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,32,64,512")
    ap.add_argument("--shapes", default="qwen1.5b", choices=list(SHAPES))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--accuracy-level", type=int, default=4)
    ap.add_argument("--ops", default="ours,nbits", help="ours: GgufMatMul; nbits: MatMulNBits")
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    bw = read_bandwidth(args.threads)
    machine = max(bw.values())
    print(f"read bandwidth: {', '.join(f'{k} {v:.1f} GB/s' for k, v in bw.items())}")
    configs = {}
    for op in args.ops.split(","):
        for name in args.types.split(","):
            bits, block, file_bpw = TYPES[name]
            for K, N in SHAPES[args.shapes]:
                session, nbytes, n = (gguf_matmul(K, N, name, args.threads) if op == "ours" else
                                      matmul_nbits(K, N, bits, block, args.accuracy_level, args.threads))
                inputs = {m: np.random.default_rng(m).standard_normal((m, K)).astype(np.float32) for m in rows}
                for m in rows:
                    session.run(None, {"A": inputs[m]})               # warm-up (prepacking happens here)
                configs[(op, name, K, N)] = (session, inputs, nbytes, file_bpw * K * N, n)
    times = {(key, m): [] for key in configs for m in rows}
    for _ in range(args.reps):                                        # interleaved: one call of each per rep
        for key, (session, inputs, _, _, n) in configs.items():
            for m in rows:
                times[(key, m)].append(_timed(lambda s=session, a=inputs[m]: s.run(None, {"A": a})) / n)
    print(f"\nours: GgufMatMul ({cpu_line()}); nbits: MatMulNBits (accuracy_level {args.accuracy_level}); "
          f"{args.threads} threads, median of {args.reps}; µs per node (each run reads >= 64 MiB of distinct weights, "
          f"from DRAM); GB/s = weight bytes read / time; machine read bandwidth "
          f"{machine:.1f} GB/s\n")
    print("| op | type | K x N | bytes / file bytes | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|---|---|" + "---|" * len(rows))
    for (op, name, K, N), (_, _, nbytes, file_bytes, _) in configs.items():
        key = (op, name, K, N)
        c1 = statistics.median(times[(key, rows[0])])
        cells = []
        for m in rows:
            t = statistics.median(times[(key, m)])
            cells.append(f"{t * 1e6:.0f} µs, {nbytes / t / 1e9:.1f} GB/s, c {t / c1:.2f}")
        print(f"| {op} | {name} | {K} x {N} | {nbytes / file_bytes:.2f} | " + " | ".join(cells) + " |")


def cpu_line() -> str:
    from specexport.plugins import cpu

    return cpu.status().line()


if __name__ == "__main__":
    main()
