"""The kernels' C interface through ctypes (sx_kernels.h): the library's functions typed, and `Kernels`, the
matmul, quantizer, attention and gather for tests, benchmarks and the tier measurement (one call, one thread)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from specexport.errors import KernelsUnavailable

VERSION = 6          # sx_version(): the C API these ctypes signatures follow (a carried library must match)
PATHS = {"ref": 0, "avx2": 1, "neon": 3, "avxvnni": 4, "avx512vnni": 5, "amx": 6, "tiers": 7, "avx512": 8, "i8mm": 9, "avx2lanes": 10}
# GGUF type name -> ggml's id (the ops' `type` attribute)
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# weight layouts (the ops' `layout` attribute) -> the bit the kernels' type ids carry (sx_layout.h): "file" the
# file's blocks verbatim, "r8" the same bytes with eight rows interleaved, written once by the build
LAYOUTS = {"file": 0, "r8": 16}
BLOCK = {t: 256 if t.endswith("_K") else 32 for t in TYPES}   # weights per (super-)block along K


def type_id(qtype: str, layout: str = "file") -> int:
    """The kernels' id of a weight of GGUF type `qtype` in `layout`."""
    return TYPES[qtype] | LAYOUTS[layout]


def _load(lib: Path):
    try:
        c = ctypes.CDLL(str(lib))
    except OSError as err:
        raise KernelsUnavailable(f"{lib} does not load: {err}") from err
    P, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    c.sx_paths.restype = ctypes.c_char_p
    c.sx_refused.restype = ctypes.c_char_p
    c.sx_refused_why.restype = ctypes.c_char_p
    c.sx_selfcheck.restype = ctypes.c_char_p
    c.sx_resolve.argtypes = [i]
    c.sx_set_tier.argtypes = [i, i, i]
    c.sx_tier.argtypes = [i, i]
    c.sx_own_kernel.argtypes = [i, i]
    c.sx_r8_kernel.argtypes = [i]
    c.sx_row_bytes.restype = ctypes.c_size_t
    c.sx_row_bytes.argtypes = [i, i64]
    c.sx_matmul.argtypes = [i, i, i, P, i64, i64, P, i64, P]
    c.sx_act_bytes.restype = ctypes.c_size_t
    c.sx_act_bytes.argtypes = [i, i64, i64]
    c.sx_quantize.argtypes = [i, i, P, i64, i64, P]
    c.sx_repack.argtypes = [i, i, P, i64, i64, P]
    c.sx_gather.restype = i64
    c.sx_gather.argtypes = [i, P, i64, i64, P, i64, P]
    c.sx_attend.argtypes = [i, P, P, P, P, i64, i64, ctypes.c_float, P, P]
    c.sx_attend_group.argtypes = [i, i64, P, P, P, P, P, i64, i64, ctypes.c_float, P]
    return c


class Kernels:
    """The C interface through ctypes (tests, benchmarks): one call, one thread."""

    def __init__(self, lib: Path | None = None):
        if lib is None:                   # the C interface alone (no ONNX Runtime headers needed)
            from specexport.plugins.cpu.toolchain import build

            lib = build(with_ort=False)
        self.lib = lib
        self.c = _load(self.lib)

    def paths(self) -> list[str]:
        return self.c.sx_paths().decode().split(",")

    def refused(self) -> list[str]:
        """Paths this CPU has whose self-check disagreed with the reference (they do not run)."""
        return [p for p in self.c.sx_refused().decode().split(",") if p]

    def refused_why(self) -> str:
        return self.c.sx_refused_why().decode()

    def selfcheck(self) -> str:
        return self.c.sx_selfcheck().decode()

    def own_kernel(self, path: str, qtype: str, layout: str = "file") -> bool:
        """Whether `path` runs a kernel of its own for `qtype` in `layout` (else another path's, the same bits)."""
        return bool(self.c.sx_own_kernel(PATHS[path], type_id(qtype, layout)))

    def r8_kernel(self, path: str) -> bool:
        """Whether `path` runs r8 weights on an r8 kernel (else through its file kernels, a copy per 64 rows)."""
        return bool(self.c.sx_r8_kernel(PATHS[path]))

    def row_bytes(self, qtype: str, K: int) -> int:
        return int(self.c.sx_row_bytes(TYPES[qtype], K))

    def repack(self, qtype: str, W: np.ndarray, K: int, *, to: str = "r8") -> np.ndarray:
        """W [N, row bytes] from the file's layout to `to` ("r8"), or back to "file" from r8: the same bytes,
        rearranged (sx_layout.h)."""
        W = np.ascontiguousarray(W, np.uint8)
        if W.ndim != 2 or W.shape[1] != self.row_bytes(qtype, K):
            raise ValueError(f"W: {list(W.shape)} is not [N, {self.row_bytes(qtype, K)}] for {qtype} and K={K}")
        out = np.empty_like(W)
        if self.c.sx_repack(TYPES[qtype], int(to == "r8"), W.ctypes.data, W.shape[0], K, out.ctypes.data):
            raise ValueError(f"sx_repack({qtype}, K={K}) refused")
        return out

    def matmul(self, qtype: str, X: np.ndarray, W: np.ndarray, *, path: str = "ref", exact: bool = False,
               layout: str = "file") -> np.ndarray:
        """Y = X W^T, one thread; W [N, row bytes] in `layout` ("file" or "r8")."""
        X = np.ascontiguousarray(X, np.float32)
        W = np.ascontiguousarray(W, np.uint8)
        (M, K), N = X.shape, W.shape[0]
        if W.shape[1] != self.row_bytes(qtype, K):
            raise ValueError(f"W: {list(W.shape)} is not [N, {self.row_bytes(qtype, K)}] for {qtype} and K={K}")
        Y = np.empty((M, N), np.float32)
        rc = self.c.sx_matmul(type_id(qtype, layout), PATHS[path], int(exact), X.ctypes.data, M, K, W.ctypes.data, N,
                              Y.ctypes.data)
        if rc:
            raise ValueError(f"sx_matmul({qtype}, path {path}) refused: code {rc}")
        return Y

    def quantize(self, qtype: str, X: np.ndarray, *, path: str = "ref") -> np.ndarray:
        """The int8 mode's quantized activations of X [M, K] (scales, sums and values), as bytes."""
        X = np.ascontiguousarray(X, np.float32)
        M, K = X.shape
        out = np.zeros(self.c.sx_act_bytes(TYPES[qtype], M, K), np.uint8)
        self.c.sx_quantize(TYPES[qtype], PATHS[path], X.ctypes.data, M, K, out.ctypes.data)
        return out

    def attend(self, q: np.ndarray, K: np.ndarray, V: np.ndarray, bias: np.ndarray | None, scale: float, *,
               path: str = "ref") -> np.ndarray:
        """One query row q [D] over keys K, V [total, D] (cache order); bias [total] or None."""
        q, K, V = (np.ascontiguousarray(a, np.float32) for a in (q, K, V))
        b = None if bias is None else np.ascontiguousarray(bias, np.float32)
        out, scratch = np.empty(q.shape[0], np.float32), np.empty(K.shape[0], np.float32)
        self.c.sx_attend(PATHS[path], q.ctypes.data, K.ctypes.data, V.ctypes.data, None if b is None else b.ctypes.data,
                         K.shape[0], q.shape[0], scale, out.ctypes.data, scratch.ctypes.data)
        return out

    def attend_group(self, q: np.ndarray, K: np.ndarray, V: np.ndarray, bias: np.ndarray | None, scale: float, *,
                     path: str = "ref") -> np.ndarray:
        """Rows q [n, D] over the same keys K, V [total, D]; bias [n, total] or None: sx_attend_group."""
        q, K, V = (np.ascontiguousarray(a, np.float32) for a in (q, K, V))
        n, total = q.shape[0], K.shape[0]
        b = None if bias is None else np.ascontiguousarray(bias, np.float32)
        out, scratch = np.empty_like(q), np.empty((n, total), np.float32)
        ptrs = (ctypes.c_void_p * n)
        qs = ptrs(*(q.ctypes.data + i * q.strides[0] for i in range(n)))
        outs = ptrs(*(out.ctypes.data + i * out.strides[0] for i in range(n)))
        biases = ptrs(*((None if b is None else b.ctypes.data + i * b.strides[0]) for i in range(n)))
        self.c.sx_attend_group(PATHS[path], n, qs, biases, outs, K.ctypes.data, V.ctypes.data, total, q.shape[1], scale,
                               scratch.ctypes.data)
        return out

    def gather(self, qtype: str, W: np.ndarray, ids: np.ndarray, K: int, *, layout: str = "file") -> np.ndarray:
        W = np.ascontiguousarray(W, np.uint8)
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty((ids.size, K), np.float32)
        bad = self.c.sx_gather(type_id(qtype, layout), W.ctypes.data, W.shape[0], K, ids.ctypes.data, ids.size, out.ctypes.data)
        if bad >= 0:
            raise IndexError(f"id {ids.flat[bad]} is outside [0, {W.shape[0]})")
        return out.reshape(*ids.shape, K)
