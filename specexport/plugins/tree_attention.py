"""Tree attention for the verify step: one Triton kernel, its numpy reference, and its PTX.

The T tree tokens' queries attend to S = P + T key/value rows (the committed prefix, then the tree's
own rows) under a [T, S] boolean mask (the ancestor mask: a token sees the prefix, its ancestors and
itself). Shapes, all contiguous:

    q    [T, Hq, D]     fp16 or fp32
    k, v [S, Hkv, D]    same dtype; Hq = G * Hkv (GQA: query head h reads kv head h // G)
    mask [T, S]         bool (True = attend)
    out  [T, Hq, D]     q's dtype

Written for decode/verify shapes (small T, long context): one program per (kv head, block of the
T * G query rows that share it), so each K/V row is read from memory once per kv head, not once per
query head; it walks S in blocks of BLOCK_N with an online softmax in fp32. A row whose mask is
all False gives zeros (never happens for a tree: every token sees itself).

`run` launches the kernel (numpy in, numpy out; on a CPU-only machine in Triton's interpreter, which
needs TRITON_INTERPRET=1 before triton is imported: `run` sets it when triton is not imported yet); `reference` is the same computation in numpy; `compile_ptx(arch)`
compiles it ahead of time for a GPU architecture on any machine (what the TensorRT plugin's AOT
implementation embeds; plugins/trt_plugin.py).
"""
from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError

ARCHS = ("sm_87", "sm_89", "sm_90", "sm_110")      # Orin, Ada, Hopper, Thor
BLOCK_M = 16                                       # query rows (T * G) per program; tl.dot needs >= 16
BLOCK_N = 32                                       # key rows per step
NUM_WARPS = 4
DTYPES = {np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32"}


def reference(q, k, v, mask, *, scale=None) -> np.ndarray:
    """softmax(q k^T * scale + log mask) v per query head, in float64; returns q's dtype."""
    q, k, v, mask = _checked(q, k, v, mask)
    t, hq, d = q.shape
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk = np.repeat(k.astype(np.float64), g, axis=1)                    # [S, Hq, D]
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), kk) * scale       # [Hq, T, S]
    scores = np.where(mask[None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    return np.einsum("hts,shd->thd", weights, vv).astype(q.dtype)


def run(q, k, v, mask, *, scale=None) -> np.ndarray:
    """The Triton kernel on these arrays: on the GPU when torch has one, else in Triton's interpreter
    on CPU tensors (100-1000x slower than a GPU: for checking, not for speed)."""
    torch = require("torch")
    q, k, v, mask = _checked(q, k, v, mask)
    if not torch.cuda.is_available():
        _interpreter_mode()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (q, k, v))
    tm = torch.from_numpy(np.ascontiguousarray(mask, dtype=np.int8)).to(device)
    return launch(tq, tk, tv, tm, scale=scale).cpu().numpy()


def launch(q, k, v, mask, *, scale=None, out=None):
    """The kernel on torch tensors already where it runs (q [T, Hq, D], k/v [S, Hkv, D] contiguous,
    mask [T, S] int8): no copies, for timing on a GPU (benchmarks/gpu_check.py). Returns `out`."""
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    out = q.new_empty(q.shape) if out is None else out
    kernel = _kernel(interpret=q.device.type == "cpu")
    kernel[grid(t, hq, hkv)](q, k, v, mask, t, s, out, **_constexprs(hq, hkv, d, scale))
    return out


def compile_ptx(arch: str, *, dtype: str = "fp16", num_q_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
                scale: float | None = None) -> str:
    """PTX for `arch` (e.g. "sm_87"), for one (dtype, heads, head_dim): those and the softmax scale are
    compile-time constants (TensorRT's AOT plugins take int scalars only, so the float scale is folded
    in); T and S stay run-time arguments. Runs on a machine without a GPU."""
    return compile_kernel(arch, dtype=dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, scale=scale)["ptx"]


def compile_kernel(arch: str, *, dtype: str = "fp16", num_q_heads: int = 9, num_kv_heads: int = 3,
                   head_dim: int = 64, scale: float | None = None) -> dict:
    """{ptx, name, num_warps, shared, block_m}: what a launcher (the TensorRT plugin) needs."""
    if arch not in ARCHS and not (arch.startswith("sm_") and arch[3:].isdigit()):
        raise SpecexportError(f"arch: expected sm_<NN> (one of {', '.join(ARCHS)}), got {arch!r}")
    if dtype not in ("fp16", "fp32"):
        raise SpecexportError(f"dtype: expected fp16 or fp32, got {dtype!r}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _compile_in_child(arch, dtype=dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, scale=scale)
    triton = require("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = f"*{dtype}"
    # TensorRT's AOT plugins launch kernels as (input pointers, extra int scalars, output pointers)
    signature = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "mask_ptr": "*i8", "T": "i32", "S": "i32", "out_ptr": ptr,
                 **dict.fromkeys(_constexprs(num_q_heads, num_kv_heads, head_dim, scale), "constexpr")}
    source = ASTSource(fn=_kernel(interpret=False), signature=signature,
                       constexprs=_constexprs(num_q_heads, num_kv_heads, head_dim, scale))
    compiled = triton.compile(source, target=GPUTarget("cuda", int(arch[3:]), 32),
                              options={"num_warps": NUM_WARPS, "enable_fp_fusion": True})
    return {"ptx": compiled.asm["ptx"], "name": compiled.metadata.name, "num_warps": compiled.metadata.num_warps,
            "shared": compiled.metadata.shared, "block_m": BLOCK_M}


def _compile_in_child(arch: str, **kw) -> dict:
    """In interpreter mode triton.language is patched for the interpreter once a kernel has run there,
    and compiling for a GPU fails: compile in a child process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from specexport.plugins.tree_attention import compile_kernel; "
            "print(json.dumps(compile_kernel(sys.argv[1], **json.loads(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", code, arch, json.dumps(kw)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"compiling the tree-attention kernel for {arch} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _interpreter_mode() -> None:
    """Triton's interpreter must be chosen before triton is imported."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise SpecexportError("tree attention on CPU runs in Triton's interpreter: set TRITON_INTERPRET=1 before "
                              "triton is imported (it already is, without it)")
    os.environ["TRITON_INTERPRET"] = "1"


def grid(t: int, num_q_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """The launch grid for T tokens: (kv heads, blocks of query rows, 1)."""
    return num_kv_heads, _cdiv(t * (num_q_heads // num_kv_heads), BLOCK_M), 1


# -- internals -----------------------------------------------------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _constexprs(hq: int, hkv: int, d: int, scale) -> dict:
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return {"HQ": hq, "HKV": hkv, "D": d, "BLOCK_D": 1 << max(4, (d - 1).bit_length()), "SCALE": scale,
            "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}


def _checked(q, k, v, mask):
    q, k, v, mask = (np.asarray(a) for a in (q, k, v, mask))
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise SpecexportError(f"tree attention: expected q [T, Hq, D] and k, v [S, Hkv, D], got q {q.shape}, "
                              f"k {k.shape}, v {v.shape}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise SpecexportError(f"tree attention: q {q.shape} and k {k.shape}: head_dim must match and Hq be a "
                              f"multiple of Hkv")
    if mask.shape != (q.shape[0], k.shape[0]):
        raise SpecexportError(f"tree attention: mask: expected [T, S] = {[q.shape[0], k.shape[0]]}, got "
                              f"{list(mask.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise SpecexportError(f"tree attention: expected fp16 or fp32 q, k, v of one dtype, got {q.dtype}, "
                              f"{k.dtype}, {v.dtype}")
    return q, k, v, mask.astype(bool)


@functools.cache
def _kernel(*, interpret: bool):
    """The Triton kernel, defined on first use so that importing this module needs no triton; wrapped
    for the interpreter or for compilation explicitly (triton.jit picks by TRITON_INTERPRET at
    decoration time, and both are needed in one process: run on CPU, compile_ptx for a GPU)."""
    require("triton")
    tl = require("triton.language")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def tree_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, T, S, out_ptr, HQ: tl.constexpr, HKV: tl.constexpr,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
        G: tl.constexpr = HQ // HKV
        kvh = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)      # query rows of this kv head: t * G + j
        t = rows // G
        h = kvh * G + rows % G
        row_ok = rows < T * G
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < D
        q = tl.load(q_ptr + (t[:, None] * HQ + h[:, None]) * D + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        for start in range(0, S, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < S
            kv_off = (cols[:, None] * HKV + kvh) * D + dims[None, :]
            kv_ok = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)           # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
            allowed = tl.load(mask_ptr + t[:, None] * S + cols[None, :],
                              mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            scores = tl.dot(q, tl.trans(k)) * SCALE                                        # [BLOCK_M, BLOCK_N]
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # a row with nothing allowed yet
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (t[:, None] * HQ + h[:, None]) * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])

    return (InterpretedFunction if interpret else JITFunction)(tree_attention_kernel)
