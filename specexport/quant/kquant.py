"""fp32 weights into GGUF blocks: what `llama-quantize` writes for a tensor, here in numpy.

The 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are the gguf package's quantizers, which follow
ggml's reference ones. The gguf package has no K-quant quantizer, so Q4_K and Q6_K are written here:
ggml's `quantize_row_q4_K_ref` (make_qkx2_quants: a min and a scale searched over 21 steps per 32
weights, weighted by |x| + rms) and `quantize_row_q6_K_ref` (make_qx_quants: 19 scales tried per 16
weights, weighted by x^2), step for step in float32 and in the reference's order of additions (sums run
along the block one element at a time, vectorized across blocks), so their bytes equal llama.cpp's: a
test holds them to blocks ggml's own C wrote (tests/data/kquant_reference.npz,
benchmarks/kquant_reference.py makes it from the llama.cpp source). ggml-base is built without FMA
contraction (generic x86-64), which is why separate multiplies and adds reproduce it.

    quantize(w [N, K] float32, "Q4_K") -> uint8 [N, K // 256 * 144]    rows of blocks, as a GGUF stores them
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from specexport._optional import require

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
CHUNK_WEIGHTS = 1 << 20                    # weights quantized at once: bounds the float temporaries
F32 = np.float32


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """`w` [N, K] (float32) as rows of `qtype` blocks, [N, row bytes] uint8."""
    w = np.ascontiguousarray(w, dtype=F32)
    if w.ndim != 2:
        raise ValueError(f"quantize: a 2-D weight is expected, got shape {w.shape}")
    if qtype not in BLOCK_BYTES:
        gguf = require("gguf")
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    N, K = w.shape
    if K % QK_K:
        raise ValueError(f"quantize: {qtype} needs rows of a multiple of {QK_K} weights, got {K}")
    out = np.empty((N, K // QK_K * BLOCK_BYTES[qtype]), np.uint8)
    step = max(1, CHUNK_WEIGHTS // K)
    block = _q4_k if qtype == "Q4_K" else _q6_k

    def rows(r):                   # numpy drops the GIL in its loops: chunks run on every core
        out[r:r + step] = block(w[r:r + step].reshape(-1, QK_K)).reshape(-1, out.shape[1])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(rows, range(0, N, step)))
    return out


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (its float trick) for |v| < 2^22."""
    return np.rint(v).astype(np.int32)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(F32).astype(np.float16)


def _seqsum(terms) -> np.ndarray:
    """Sum over the first axis (a block's elements; blocks along the second) one element after another, as
    the reference's loops add: numpy adds rows of an outer axis in order (it sums pairwise only along the
    innermost one)."""
    return np.add.reduce(terms, axis=0, dtype=F32)


def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1, nstep: int = 20):
    """make_qkx2_quants over columns of x [n, B] with weights w: (L uint8 [n, B], scale [B], the_min [B])."""
    lo = np.minimum(x.min(axis=0), F32(0))
    hi = x.max(axis=0)
    sum_w, sum_x = _seqsum(w), _seqsum(w * x)
    flat = hi == lo
    iscale = F32(nmax) / np.where(flat, F32(1), hi - lo)
    scale = F32(1) / iscale
    L = np.clip(_nearest(iscale * (x - lo)), 0, nmax)
    diff = (scale * L.astype(F32) + lo) - x
    best = _seqsum(w * (diff * diff))
    mins = lo.copy()                 # the reference updates its min as it goes: later steps start from it
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / np.where(flat, F32(1), hi - mins)
        La = np.clip(_nearest(iscale * (x - mins)), 0, nmax)
        lf = La.astype(F32)
        wl = w * lf
        sum_l, sum_l2, sum_xl = _seqsum(wl), _seqsum(wl * lf), _seqsum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0
        this_min = np.where(pos, F32(0), this_min)
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 == 0, F32(1), sum_l2), this_scale)
        diff = (this_scale * lf + this_min) - x
        err = _seqsum(w * (diff * diff))
        better = ok & (err < best) & ~flat
        L = np.where(better, La, L)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mins = np.where(better, this_min, mins)
    L = np.where(flat, 0, L)
    scale = np.where(flat, F32(0), scale)
    return L.astype(np.uint8), scale.astype(F32), (-mins).astype(F32)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref over blocks x [B, 256] -> [B, 144]."""
    B = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(B * 8, 32).T)          # [32, sub-blocks]: sums along axis 0
    av = np.sqrt(_seqsum(sub * sub) / F32(32))
    L, scales, mins = _qkx2(sub, av + np.abs(sub))
    L, scales, mins = L.T.reshape(B, 8, 32), scales.reshape(B, 8), mins.reshape(B, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, F32(1)), F32(0))
    inv_min = np.where(max_min > 0, F32(63) / np.where(max_min > 0, max_min, F32(1)), F32(0))
    ls = np.minimum(_nearest(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)    # uint8_t, then MIN
    lm = np.minimum(_nearest(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.zeros((B, 12), np.uint8)
    packed[:, 0:4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    d, dmin = _f16(max_scale / F32(63)), _f16(max_min / F32(63))
    dj = d.astype(F32)[:, None] * ls.astype(F32)        # what get_scale_min_k4 unpacks: ls, lm themselves
    dm = dmin.astype(F32)[:, None] * lm.astype(F32)
    nz = dj != 0
    q = np.clip(_nearest((x.reshape(B, 8, 32) + dm[..., None]) / np.where(nz, dj, F32(1))[..., None]), 0, 15)
    L = np.where(nz[..., None], q, L).astype(np.uint8).reshape(B, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(B, 128)
    out = np.empty((B, 144), np.uint8)
    out[:, 0:2], out[:, 2:4] = d.view(np.uint8).reshape(B, 2), dmin.view(np.uint8).reshape(B, 2)
    out[:, 4:16], out[:, 16:] = packed, qs
    return out


def _qx(x: np.ndarray, nmax: int = 32):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) over columns of x [n, B]: (L [n, B] in 0..2nmax-1,
    scale [B])."""
    n, B = x.shape
    at = np.abs(x).argmax(axis=0)                       # the first of the largest magnitudes, as `>` keeps it
    top = x[at, np.arange(B)]
    zero = np.abs(top) < F32(1e-15)
    top = np.where(zero, F32(1), top)
    w = x * x

    def trial(iscale):
        q = np.clip(_nearest(iscale * x), -nmax, nmax - 1)
        lf = q.astype(F32)
        return q, _seqsum((w * x) * lf), _seqsum((w * lf) * lf)
    L, sumlx, suml2 = trial(F32(-nmax) / top)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1)), F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        q, sumlx, suml2 = trial(-(F32(nmax) + F32(0.1) * F32(step)) / top)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        s = sumlx / np.where(better, suml2, F32(1))
        L = np.where(better, q, L)
        scale = np.where(better, s, scale)
        best = np.where(better, s * sumlx, best)
    L = np.where(zero, -nmax, L)                         # all-zero input: L 0 (stored l + nmax)
    return (L + nmax).astype(np.int32), np.where(zero, F32(0), scale).astype(F32)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref over blocks x [B, 256] -> [B, 210]."""
    B = x.shape[0]
    sub = x.reshape(B, 16, 16)
    L, scales = _qx(np.ascontiguousarray(sub.reshape(B * 16, 16).T))
    L, scales = L.T.reshape(B, 16, 16), scales.reshape(B, 16)
    at = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(B), at]
    empty = np.abs(max_scale) < F32(1e-15)
    iscale = F32(-128) / np.where(empty, F32(1), max_scale)
    d = _f16(np.where(empty, F32(0), F32(1) / iscale))
    sc = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
    dj = d.astype(F32)[:, None] * sc.astype(F32)
    nz = dj != 0
    q = np.clip(_nearest(sub / np.where(nz, dj, F32(1))[..., None]), -32, 31) + 32
    L = np.where(nz[..., None], q, L).astype(np.uint8).reshape(B, 2, 4, 32)    # 128-weight halves, 4 quarters
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2)     # [B, 2, 64]
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out = np.zeros((B, 210), np.uint8)
    keep = ~empty
    out[keep, 0:128] = ql.reshape(B, 128)[keep]
    out[keep, 128:192] = qh.reshape(B, 64)[keep]
    out[keep, 192:208] = sc.view(np.uint8)[keep]
    out[:, 208:210] = d.view(np.uint8).reshape(B, 2)
    return out
