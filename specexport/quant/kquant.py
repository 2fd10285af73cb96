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
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q5_0": 22, "Q4_0": 18, "Q4_1": 20}
BLOCK_WEIGHTS = {"Q4_K": 256, "Q6_K": 256, "Q5_0": 32, "Q4_0": 32, "Q4_1": 32}
CHUNK_WEIGHTS = 1 << 20                    # weights quantized at once: bounds the float temporaries
F32 = np.float32


def quantize(w: np.ndarray, qtype: str, importance: np.ndarray | None = None) -> np.ndarray:
    """`w` [N, K] (float32) as rows of `qtype` blocks, [N, row bytes] uint8. importance [K]: per input
    column, the mean squared activation (an imatrix): ggml's `_impl` quantizers weigh each weight's error
    by it (Q4_K, Q6_K, Q5_0, Q4_0, Q4_1; Q8_0 ignores it, as ggml's does; Q5_1, in no mix, is written
    without it)."""
    w = np.ascontiguousarray(w, dtype=F32)
    if w.ndim != 2:
        raise ValueError(f"quantize: a 2-D weight is expected, got shape {w.shape}")
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=F32)
        if importance.shape != (w.shape[1],):
            raise ValueError(f"quantize: importance must have one value per column ({w.shape[1]}), got "
                             f"shape {importance.shape}")
        if qtype in IMPORTANCE:
            return _rows(w, qtype, lambda rows: IMPORTANCE[qtype](rows, importance))
    if qtype not in ("Q4_K", "Q6_K"):
        gguf = require("gguf")
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    block = _q4_k if qtype == "Q4_K" else _q6_k
    return _rows(w, qtype, lambda rows: block(rows.reshape(-1, QK_K)))


def _rows(w: np.ndarray, qtype: str, blocks) -> np.ndarray:
    """blocks(rows [n, K]) -> [n * blocks a row, block bytes], over chunks of rows on every core (numpy
    drops the GIL in its loops)."""
    N, K = w.shape
    size = BLOCK_BYTES[qtype]
    if K % BLOCK_WEIGHTS[qtype]:
        raise ValueError(f"quantize: {qtype} needs rows of a multiple of {BLOCK_WEIGHTS[qtype]} weights, got {K}")
    out = np.empty((N, K // BLOCK_WEIGHTS[qtype] * size), np.uint8)
    step = max(1, CHUNK_WEIGHTS // K)

    def chunk(r):
        out[r:r + step] = blocks(w[r:r + step]).reshape(-1, out.shape[1])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(chunk, range(0, N, step)))
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
    return _pack_q4_k(x, L, ls, lm, _f16(max_scale / F32(63)), _f16(max_min / F32(63)))


def _pack_q4_k(x, L, ls, lm, d, dmin) -> np.ndarray:
    """A Q4_K block from its 6-bit sub-block scales ls and mins lm [B, 8] and fp16 d, dmin: the final codes
    against the stored scales (L [B, 8, 32] kept where a sub-block's scale is 0), as both quantizers end."""
    B = x.shape[0]
    packed = np.zeros((B, 12), np.uint8)
    packed[:, 0:4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
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


def _qx(x: np.ndarray, nmax: int = 32, w: np.ndarray | None = None):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, w) over columns of x [n, B] (w None: x^2): (L [n, B] in
    0..2nmax-1, scale [B])."""
    n, B = x.shape
    at = np.abs(x).argmax(axis=0)                       # the first of the largest magnitudes, as `>` keeps it
    top = x[at, np.arange(B)]
    zero = np.abs(top) < F32(1e-15)
    top = np.where(zero, F32(1), top)
    w = x * x if w is None else w

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


def _q6_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """quantize_row_q6_K_ref over blocks x [B, 256] -> [B, 210]; with qw [B, 256] (each weight's column
    importance), quantize_row_q6_K_impl."""
    B = x.shape[0]
    sub = x.reshape(B, 16, 16)
    weights = None if qw is None else np.ascontiguousarray(qw.reshape(B * 16, 16).T)
    L, scales = _qx(np.ascontiguousarray(sub.reshape(B * 16, 16).T), w=weights)
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


# -- with importance weights (an imatrix): ggml's quantize_row_<type>_impl ------------------------------


def _q4_k_imatrix(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_impl over rows [n, K] with importance [K] -> [n * K/256, 144]."""
    x = rows.reshape(-1, QK_K)
    B = x.shape[0]
    qw = np.broadcast_to(np.tile(importance.reshape(-1, QK_K), (rows.shape[0], 1)), x.shape)
    sigma2 = F32(2) * _seqsum(np.ascontiguousarray((x * x).T)) / F32(QK_K)
    sub = np.ascontiguousarray(x.reshape(B * 8, 32).T)                      # [32, sub-blocks]
    s2 = np.repeat(sigma2, 8)
    weights = np.ascontiguousarray(qw.reshape(B * 8, 32).T) * np.sqrt(s2 + sub * sub)
    sw = _seqsum(weights).reshape(B, 8)
    L, scales, mins = _qkx2(sub, weights, rmin=-0.9, rdelta=0.05, nstep=36)   # make_qkx3_quants: the same steps
    L, scales, mins = L.T.reshape(B, 8, 32), scales.reshape(B, 8), mins.reshape(B, 8)
    ls, d_block = _qp(scales, sw)
    lm, m_block = _qp(mins, sw)
    return _pack_q4_k(x, L, ls, lm, _f16(d_block), _f16(m_block))


def _qp(x: np.ndarray, w: np.ndarray, nmax: int = 63):
    """make_qp_quants(n, nmax, x, L, w) over rows of x [B, n]: (L uint8 [B, n], scale [B])."""
    B, n = x.shape
    top = np.maximum(x.max(axis=1), F32(0))
    zero = top < F32(1e-15)
    top = np.where(zero, F32(1), top)

    def mse(iscale, clip):
        q = _nearest(iscale[:, None] * x)
        q = np.minimum(q, nmax) if clip else q
        diff = x - (F32(1) / iscale)[:, None] * q.astype(F32)
        return q, _seqsum(np.ascontiguousarray(((w * diff) * diff).T))
    iscale = F32(nmax) / top
    _, best = mse(iscale, False)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial = (F32(0.1) * F32(step) + F32(nmax)) / top
        _, err = mse(trial, True)
        better = err < best
        best, iscale = np.where(better, err, best), np.where(better, trial, iscale)
    L = np.minimum(_nearest(iscale[:, None] * x), nmax)
    lf = L.astype(F32)
    sumlx = _seqsum(np.ascontiguousarray(((w * x) * lf).T))
    suml2 = _seqsum(np.ascontiguousarray(((w * lf) * lf).T))
    for _ in range(5):                  # a try that changes nothing leaves the next one nothing to change
        for i in range(n):
            wi, xi, li = w[:, i], x[:, i], L[:, i].astype(F32)
            slx, sl2 = sumlx - (wi * xi) * li, suml2 - (wi * li) * li
            ok = (slx > 0) & (sl2 > 0)
            new = np.minimum(_nearest(np.where(ok, (xi * sl2) / np.where(ok, slx, F32(1)), F32(0))), nmax)
            nf = new.astype(F32)
            slx2, sl22 = slx + (wi * xi) * nf, sl2 + (wi * nf) * nf
            take = ok & (new != L[:, i]) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[:, i] = np.where(take, new, L[:, i])
            sumlx, suml2 = np.where(take, slx2, sumlx), np.where(take, sl22, suml2)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, F32(1)), F32(0))
    return np.where(zero[:, None], 0, L).astype(np.uint8), np.where(zero, F32(0), scale).astype(F32)


def _q6_k_imatrix(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    return _q6_k(rows.reshape(-1, QK_K), np.tile(importance.reshape(-1, QK_K), (rows.shape[0], 1)))


def _row_weights(rows: np.ndarray, importance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 32-weight types' _impl weights: each weight's column importance x sqrt(its row's mean x^2 + x^2),
    as (blocks x [B, 32], weights [B, 32])."""
    n, K = rows.shape
    sigma2 = _seqsum(np.ascontiguousarray((rows * rows).T)) / F32(K)             # per row
    x = rows.reshape(-1, 32)
    qw = np.tile(importance.reshape(-1, 32), (n, 1))
    return x, qw * np.sqrt(np.repeat(sigma2, K // 32)[:, None] + x * x)


def _nibbles(L: np.ndarray) -> np.ndarray:
    """[B, 32] codes' low four bits as 16 bytes: weight j low, j + 16 high."""
    return ((L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)).astype(np.uint8)


def _q5_0_imatrix(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """quantize_row_q5_0_impl over rows [n, K] with importance [K] -> [n * K/32, 22]."""
    x, weights = _row_weights(rows, importance)
    L, d = _qx(np.ascontiguousarray(x.T), nmax=16, w=np.ascontiguousarray(weights.T))
    L = L.T.astype(np.uint32)                                                    # [B, 32] in 0..31
    out = np.empty((x.shape[0], 22), np.uint8)
    out[:, 0:2] = _f16(d).view(np.uint8).reshape(-1, 2)
    qh = ((L[:, :16] & 0x10) >> 4) << np.arange(16, dtype=np.uint32) | \
         ((L[:, 16:] & 0x10) >> 4) << np.arange(16, 32, dtype=np.uint32)
    out[:, 2:6] = np.bitwise_or.reduce(qh, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)
    out[:, 6:22] = _nibbles(L)
    return out


def _q4_0_imatrix(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """quantize_row_q4_0_impl over rows [n, K] with importance [K] -> [n * K/32, 18]."""
    x, weights = _row_weights(rows, importance)
    L, d = _qx(np.ascontiguousarray(x.T), nmax=8, w=np.ascontiguousarray(weights.T))
    out = np.empty((x.shape[0], 18), np.uint8)
    out[:, 0:2] = _f16(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:18] = _nibbles(L.T)                                                 # codes in 0..15
    return out


def _q4_1_imatrix(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """quantize_row_q4_1_impl over rows [n, K] with importance [K] -> [n * K/32, 20]: make_qkx3_quants (the
    Q4_K _impl's search) per block, its codes kept as found."""
    x, weights = _row_weights(rows, importance)
    L, scale, the_min = _qkx2(np.ascontiguousarray(x.T), np.ascontiguousarray(weights.T), rmin=-0.9, rdelta=0.05,
                              nstep=36)
    out = np.empty((x.shape[0], 20), np.uint8)
    out[:, 0:2] = _f16(scale).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = _f16(-the_min).view(np.uint8).reshape(-1, 2)
    out[:, 4:20] = _nibbles(L.T.astype(np.uint32))
    return out


IMPORTANCE = {"Q4_K": _q4_k_imatrix, "Q6_K": _q6_k_imatrix, "Q5_0": _q5_0_imatrix, "Q4_0": _q4_0_imatrix,
              "Q4_1": _q4_1_imatrix}
