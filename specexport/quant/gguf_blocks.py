"""A GGUF tensor's quantized blocks, read exactly, in the form ONNX Runtime's block-quantized kernels take.

Every block type maps to codes the kernels read with their default zero point, a per-block fp32
scale and, for the affine types, a per-block fp32 constant c:

    w[n, k] = scale[n, b] * (code[n, k] - Z) + c[n, b]          b = k // block, Z = 8 (4 bits) or 128 (8 bits)

    type  ggml's definition (per block)           bits block  code          scale         c
    Q4_0  d * (q - 8),        q in 0..15             4   32    q             d
    Q4_1  d * q + m                                  4   32    q             d             8d + m
    Q4_K  d*sc_j * q - dmin*m_j  (8 sub-blocks/256)  4   32    q             d*sc_j        8 d*sc_j - dmin*m_j
    Q5_0  d * (q - 16),       q in 0..31             8   32    q + 112       d
    Q5_1  d * q + m                                  8   32    q + 128       d             m
    Q5_K  d*sc_j * q - dmin*m_j                      8   32    q + 128       d*sc_j        -dmin*m_j
    Q6_K  d*sc_j * (q - 32)   (16 sub-blocks/256)    8   16    q + 96        d*sc_j
    Q8_0  d * q,              q in -128..127         8   32    q + 128       d

MatMulNBits (bits 4 or 8, `block` along K, no zero-point input) computes the scale*(code - Z) part;
the c part of a matmul is sum over blocks of (the block's sum of activations) * c: a small
[rows, K/block] x [K/block, N] product (quant/gguf_graph.py). The fp32 products d*sc_j are exact
(an fp16 times an integer of 6-8 bits), so scale*(code - Z) + c equals what ggml's dequantization
(and the gguf package's, `gguf.quants.dequantize`, the reference the tests compare with) computes, up
to the rounding of c's one addition. Scales and c are kept as their compact parts (fp16 d, dmin; uint8
or int8 sc, m), and the 5/6-bit codes as 4 + 1 or 2 bits (split_codes): the graph multiplies and
unpacks them when ONNX Runtime loads it (constant folding), so the file stays near the GGUF's size.

Why our own decoding and not the gguf package's: it dequantizes to floats and exposes no codes or
scales. Its dequantization is the reference every decoder here is tested against, block type by
block type, and every tensor of a real file is checked at build time (quant/gguf_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport._optional import require

QK_K = 256
SUPPORTED = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
INFO_BITS = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}     # the types whose codes are 8-bit in the kernels


@dataclass
class BlockCodes:
    """One [N, K] weight as kernel codes and the parts of its scales (see the module docstring)."""
    bits: int                      # 4 or 8
    block: int                     # elements per scale along K (32 or 16)
    codes: np.ndarray              # [N, K] uint8 in 0..2**bits - 1
    d: np.ndarray                  # [N, S] float16: the super-scale (S = K // block for the simple types)
    sc: np.ndarray | None = None   # [N, K // block] uint8 / int8 sub-block scale (K-quants), else None
    c_d: np.ndarray | None = None  # [N, S] float16: what multiplies c_m (dmin, or for Q4_1/Q5_1 the m itself)
    c_m: np.ndarray | None = None  # [N, K // block] uint8: m_j (K-quants); None for Q4_1/Q5_1 (c_d is m)
    c_shift: float = 0.0           # c = c_shift * scale + sign * c_d * c_m (Q4_1/Q4_K: 8)
    c_sign: float = 1.0            # -1 for the K-quants' "- dmin*m"
    info_bits: int = 0             # bits each code carries (5 or 6 for the 5/6-bit types stored as 8); 0: `bits`
    offset: int = 0                # code = q + offset, q in 0..2**info_bits - 1 (8-bit codes of 5/6-bit types)

    @property
    def zero_point(self) -> int:
        return 8 if self.bits == 4 else 128

    @property
    def affine(self) -> bool:
        return self.c_d is not None

    def scale(self) -> np.ndarray:
        """[N, K // block] float32, exactly as ggml computes it."""
        d = self.d.astype(np.float32)
        if self.sc is None:
            return d
        per = self.sc.shape[1] // d.shape[1]
        return np.repeat(d, per, axis=1) * self.sc.astype(np.float32)

    def c(self) -> np.ndarray | None:
        """[N, K // block] float32 per-block constant, or None."""
        if not self.affine:
            return None
        m = self.c_d.astype(np.float32)
        if self.c_m is not None:
            m = np.repeat(m, self.c_m.shape[1] // m.shape[1], axis=1) * self.c_m.astype(np.float32)
        return np.float32(self.c_shift) * self.scale() + np.float32(self.c_sign) * m

    def dequantize(self) -> np.ndarray:
        """[N, K] float32: scale * (code - Z) + c (the weights the kernels compute with)."""
        N, K = self.codes.shape
        q = self.codes.reshape(N, K // self.block, self.block).astype(np.float32) - self.zero_point
        w = q * self.scale()[..., None]
        c = self.c()
        if c is not None:
            w = w + c[..., None]
        return w.reshape(N, K)

    def split_codes(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The 5/6-bit codes as the file keeps them, minus the offset: (low nibbles [N, K/2] packed in
        pairs, high bits [N, K * h / 8] packed h bits each little-endian, h = info_bits - 4); the graph
        puts code = (low | high << 4) + offset together when it loads (quant/gguf_graph.py)."""
        q = (self.codes - np.uint8(self.offset)).astype(np.uint8)
        N, K = q.shape
        low = q & np.uint8(0x0F)
        low = (low[:, 0::2] | (low[:, 1::2] << np.uint8(4))).astype(np.uint8)
        h = self.info_bits - 4
        high = (q >> np.uint8(4)).reshape(N, K * h // 8, 8 // h)
        high = np.bitwise_or.reduce(high << (np.arange(8 // h, dtype=np.uint8) * np.uint8(h)), axis=-1)
        return low, high.astype(np.uint8), h

    def packed_codes(self) -> np.ndarray:
        """[N, K // block, block * bits // 8] uint8: MatMulNBits' B (4-bit: low nibble first)."""
        N, K = self.codes.shape
        codes = self.codes.reshape(N, K // self.block, self.block)
        if self.bits == 8:
            return codes
        return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def decode(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockCodes:
    """raw: the tensor's bytes [N, row bytes] uint8 (GGUFReader's `data`); shape (N, K)."""
    if qtype not in _DECODERS:
        raise ValueError(f"GGUF block type {qtype} has no exact mapping (supported: {', '.join(SUPPORTED)})")
    N, K = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, -1)
    return _DECODERS[qtype](blocks, N, K)


def _split(blocks, N, nb, sizes):
    """Each row's blocks [N, nb, bytes] cut into fields of the given byte sizes."""
    b = blocks.reshape(N, nb, -1)
    out, at = [], 0
    for s in sizes:
        out.append(b[..., at:at + s])
        at += s
    return out


def _f16(x) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _q4_0(blocks, N, K):
    d, qs = _split(blocks, N, K // 32, (2, 16))
    return BlockCodes(4, 32, _nibbles(qs).reshape(N, K), _f16(d))


def _q4_1(blocks, N, K):
    d, m, qs = _split(blocks, N, K // 32, (2, 2, 16))
    return BlockCodes(4, 32, _nibbles(qs).reshape(N, K), _f16(d), c_d=_f16(m), c_shift=8.0)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q5_0(blocks, N, K):
    d, qh, qs = _split(blocks, N, K // 32, (2, 4, 16))
    q = _nibbles(qs) | (_high_bits(qh) << np.uint8(4))
    return BlockCodes(8, 32, (q + np.uint8(112)).reshape(N, K), _f16(d), info_bits=5, offset=112)


def _q5_1(blocks, N, K):
    d, m, qh, qs = _split(blocks, N, K // 32, (2, 2, 4, 16))
    q = _nibbles(qs) | (_high_bits(qh) << np.uint8(4))
    return BlockCodes(8, 32, (q + np.uint8(128)).reshape(N, K), _f16(d), c_d=_f16(m), info_bits=5, offset=128)


def _q8_0(blocks, N, K):
    d, qs = _split(blocks, N, K // 32, (2, 32))
    codes = (np.ascontiguousarray(qs).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return BlockCodes(8, 32, codes.reshape(N, K), _f16(d))


def _k_scales(scales: np.ndarray):
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (sc [..., 8], m [..., 8]) uint8."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc.astype(np.uint8), m.astype(np.uint8)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """[..., 128] bytes -> [..., 8, 32] 4-bit codes: 64-element chunks, low nibbles first."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & np.uint8(0x0F)).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(blocks, N, K):
    d, dmin, scales, qs = _split(blocks, N, K // QK_K, (2, 2, 12, 128))
    sc, m = _k_scales(scales)
    codes = _k_low(qs).reshape(N, K)
    return BlockCodes(4, 32, codes, _f16(d), sc=sc.reshape(N, -1), c_d=_f16(dmin), c_m=m.reshape(N, -1),
                      c_shift=8.0, c_sign=-1.0)


def _q5_k(blocks, N, K):
    d, dmin, scales, qh, qs = _split(blocks, N, K // QK_K, (2, 2, 12, 32, 128))
    sc, m = _k_scales(scales)
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & np.uint8(1)   # [N, nb, 8, 32]
    q = _k_low(qs) | (high << np.uint8(4))
    return BlockCodes(8, 32, (q + np.uint8(128)).reshape(N, K), _f16(d), sc=sc.reshape(N, -1), c_d=_f16(dmin),
                      c_m=m.reshape(N, -1), c_sign=-1.0, info_bits=5, offset=128)


def _q6_k(blocks, N, K):
    ql, qh, scales, d = _split(blocks, N, K // QK_K, (128, 64, 16, 2))
    low = ql.reshape(N, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)      # [N, nb, 2 halves, 2, 64]
    low = (low & np.uint8(0x0F)).reshape(N, -1, 2, 4, 32)
    high = qh.reshape(N, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = (high & np.uint8(0x03)).reshape(N, -1, 2, 4, 32)
    q = low | (high << np.uint8(4))                                                       # 0..63
    sc = np.ascontiguousarray(scales).view(np.int8).reshape(N, -1)
    return BlockCodes(8, 16, (q + np.uint8(96)).reshape(N, K), _f16(d), sc=sc, info_bits=6, offset=96)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q5_K": _q5_k,
             "Q6_K": _q6_k, "Q8_0": _q8_0}


def random_blocks(rng, qtype: str, n: int, *, k: int, scale: float = 0.02) -> np.ndarray:
    """[n, row bytes] valid blocks of `qtype`: random codes and sub-scales, finite fp16 super-scales
    (d and dmin in [scale/10, 1.1 scale)). Seeded files for tests and the 3B-shaped build benchmark
    (benchmarks/seeded_gguf.py): writing random bytes in the block layout is what makes a K-quant file
    of any size in seconds, where quantizing random floats has no encoder in the gguf package."""
    gguf = require("gguf")
    qt = gguf.GGMLQuantizationType[qtype]
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
    fields = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [ts - 2]}[qtype]
    for at in fields:                     # d (and m / dmin): small, positive, finite
        raw[..., at:at + 2] = (rng.random((n, k // bs)) * scale + scale / 10).astype(np.float16)[..., None].view(np.uint8)
    if qtype == "Q4_K" or qtype == "Q5_K":       # 6-bit sub-scales and mins kept small: weights of sane size
        raw[..., 4:16] &= np.uint8(0x1F)
    if qtype == "Q6_K":
        raw[..., 192:208] = rng.integers(-8, 8, size=(n, k // bs, 16)).astype(np.int8).view(np.uint8)
    return raw.reshape(n, -1)
