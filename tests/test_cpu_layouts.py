"""The weights' r8 layout (specexport/plugins/cpu/sx_layout.h): the file's bytes with eight rows interleaved,
written once by the build. It is a permutation of the bytes (restated here in numpy, independently of the
C++), and every kernel path on it gives the reference's bits on the file's layout: every type, every row
count, a tail of rows past the last group, ranges that cut groups, the gather, the ONNX Runtime ops; a
planted bug in the r8 kernel is refused by the self-check and the file kernels carry r8 instead."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from machine import kernels_missing
from specexport.plugins import cpu
from specexport.quant.gguf_blocks import SUPPORTED
from tests.test_cpu_kernels import _planted, blocks

gguf = pytest.importorskip("gguf")

# the fields of each type's block (offset, length) in the file's order: ggml's block structs
FIELDS = {"Q4_0": [(0, 2), (2, 16)], "Q4_1": [(0, 2), (2, 2), (4, 16)], "Q5_0": [(0, 2), (2, 4), (6, 16)],
          "Q5_1": [(0, 2), (2, 2), (4, 4), (8, 16)], "Q8_0": [(0, 2), (2, 32)],
          "Q4_K": [(0, 2), (2, 2), (4, 12), (16, 128)], "Q5_K": [(0, 2), (2, 2), (4, 12), (16, 32), (48, 128)],
          "Q6_K": [(0, 128), (128, 64), (192, 16), (208, 2)]}


@pytest.fixture(scope="module")
def kernels():
    try:
        return cpu.Kernels()
    except cpu.KernelsUnavailable as err:
        kernels_missing(f"the CPU kernels do not build here: {err}")


def r8_numpy(qtype: str, w: np.ndarray) -> np.ndarray:
    """The layout as the docs state it: per group of 8 rows and block, each 2-byte field as the 8 rows'
    halves, each 4k-byte field as k dwords of the 8 rows (dword j of row c at 32 j + 4 c); Q5's qh with the
    file's bit 4t + k stored at bit 8k + t; rows past the last group as they are."""
    size = sum(n for _, n in FIELDS[qtype])
    N = w.shape[0]
    out = w.copy()
    g = N // 8
    blk = w[:8 * g].reshape(g, 8, -1, size).copy()               # [group, row, block, bytes]
    if qtype in ("Q5_0", "Q5_1"):
        at = 2 if qtype == "Q5_0" else 4
        h = blk[..., at:at + 4].copy().view("<u4")[..., 0]
        bits = (h[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # bit 4t + k
        moved = np.zeros_like(h)
        for t in range(8):
            for k in range(4):
                moved |= bits[..., 4 * t + k] << np.uint32(8 * k + t)
        blk[..., at:at + 4] = moved[..., None].view(np.uint8)
    parts = []
    for off, n in FIELDS[qtype]:
        f = blk[..., off:off + n]                                   # [g, 8, nb, n]
        if n == 2:
            parts.append(f.transpose(0, 2, 1, 3).reshape(g, -1, 16))            # [g, nb, 8 x 2]
        else:
            parts.append(f.reshape(g, 8, -1, n // 4, 4).transpose(0, 2, 3, 1, 4).reshape(g, -1, 8 * n))
    out[:8 * g] = np.concatenate(parts, axis=-1).reshape(8 * g, -1)
    return out


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_r8_is_the_documented_permutation_of_the_files_bytes(kernels, qtype):
    rng = np.random.default_rng(1)
    K = 512
    for N in (8, 21, 64):
        w = blocks(rng, qtype, N, K)
        r8 = kernels.repack(qtype, w, K)
        assert r8.shape == w.shape
        if qtype not in ("Q5_0", "Q5_1"):                           # Q5's qh bits move inside their dword
            assert np.array_equal(np.sort(r8, axis=None), np.sort(w, axis=None))
        assert np.array_equal(r8, r8_numpy(qtype, w)), f"{qtype} N={N}"
        assert np.array_equal(kernels.repack(qtype, r8, K, to="file"), w)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_every_path_on_r8_gives_the_references_bits_on_the_files_layout(kernels, qtype):
    rng = np.random.default_rng(2)
    K = 768 if qtype.endswith("_K") else 96
    w = blocks(rng, qtype, 43, K)                                   # five groups and a tail of three
    r8 = kernels.repack(qtype, w, K)
    x = rng.standard_normal((17, K)).astype(np.float32)
    want = kernels.matmul(qtype, x, w, path="ref")
    for path in [*kernels.paths(), "tiers"]:
        for M in (1, 2, 3, 5, 8, 9, 16, 17):
            got = kernels.matmul(qtype, x[:M], r8, path=path, layout="r8")
            assert np.array_equal(got, want[:M]), f"{qtype}, {path}, M={M}"
        exact = kernels.matmul(qtype, x[:2], r8, path=path, exact=True, layout="r8")
        assert np.array_equal(exact, kernels.matmul(qtype, x[:2], w, path="ref", exact=True)), f"{qtype}, {path} exact"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q8_0"])
def test_the_emulated_tiers_run_r8_with_the_references_bits(qtype):
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the emulated tiers need AVX2, which this CPU lacks")
    emulated = _planted(None, emulate_vnni=True, emulate_amx=True, emulate_avx512=True)
    rng = np.random.default_rng(3)
    K = 512 if qtype.endswith("_K") else 64
    w = blocks(rng, qtype, 37, K)
    r8 = emulated.repack(qtype, w, K)
    x = rng.standard_normal((6, K)).astype(np.float32)
    want = emulated.matmul(qtype, x, w, path="ref")
    assert {"avxvnni", "avx512vnni", "avx512", "amx"} <= set(emulated.paths()), emulated.paths()
    for path in emulated.paths():
        assert np.array_equal(emulated.matmul(qtype, x, r8, path=path, layout="r8"), want), path


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_gather_reads_r8_rows_as_the_files(kernels, qtype):
    rng = np.random.default_rng(4)
    K = 256 if qtype.endswith("_K") else 64
    w = blocks(rng, qtype, 27, K)
    ids = np.array([[0, 7, 8, 23], [24, 26, 5, 15]])
    assert np.array_equal(kernels.gather(qtype, kernels.repack(qtype, w, K), ids, K, layout="r8"),
                          kernels.gather(qtype, w, ids, K))


def _op(w: np.ndarray, qtype: str, K: int, layout: str | None, *, op: str = "GgufMatMul"):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    st = cpu.status()
    if not st.available:
        kernels_missing(st.line())
    extra = {} if layout is None else {"layout": layout}
    if op == "GgufMatMul":
        node = helper.make_node(op, ["X", "W"], ["Y"], domain=cpu.DOMAIN, type=cpu.TYPES[qtype], K=K, N=w.shape[0],
                                **extra)
    else:
        node = helper.make_node(op, ["X", "W"], ["Y"], domain=cpu.DOMAIN, types=[cpu.TYPES[qtype]], Ns=[w.shape[0]],
                                K=K, **extra)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", w.shape[0]])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(cpu.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(st.library))
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("op", ["GgufMatMul", "GgufMatMulN"])
def test_the_ops_read_the_layout_attribute_and_refuse_one_they_do_not_know(kernels, op):
    rng = np.random.default_rng(5)
    K = 512
    w = blocks(rng, "Q4_K", 203, K)                                # many tasks of columns, a tail of three rows
    x = rng.standard_normal((5, K)).astype(np.float32)
    want = _op(w, "Q4_K", K, None, op=op).run(None, {"X": x})[0]
    got = _op(kernels.repack("Q4_K", w, K), "Q4_K", K, "r8", op=op).run(None, {"X": x})[0]
    assert np.array_equal(got, want)
    with pytest.raises(Exception, match="weight layout 'r16' is not one these kernels know"):
        _op(w, "Q4_K", K, "r16", op=op).run(None, {"X": x})


def test_a_planted_r8_bug_is_refused_and_the_file_kernels_carry_r8(kernels):
    """A bug in the r8 kernel alone (Q4_K's dmin read from d's place): the self-check refuses every x86
    path's r8 kernel ("avx2.r8"), the paths stay, r8 runs through their file kernels with the reference's
    bits; with the check off the r8 kernel's bits differ."""
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the r8 kernel is AVX2's, which this CPU lacks")
    lib = _planted("r8").lib
    code = ("import sys, numpy as np; from specexport.plugins import cpu; "
            "from specexport.quant.gguf_blocks import random_blocks; k = cpu.Kernels(cpu.Path(sys.argv[1])); "
            "print(','.join(k.paths()), ','.join(k.refused()), sep='|'); print(k.refused_why()); "
            "r = np.random.default_rng(0); w = random_blocks(r, 'Q4_K', 32, k=512); x = r.standard_normal((3, 512)).astype(np.float32); "
            "print(int(np.array_equal(k.matmul('Q4_K', x, k.repack('Q4_K', w, 512), path='avx2', layout='r8'), "
            "k.matmul('Q4_K', x, w, path='ref'))))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEXPORT_KERNEL")}
    out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    paths, refused = out[0].split("|")
    assert {"ref", "avx2", "avx2lanes"} <= set(paths.split(",")), out
    assert {"avx2.r8", "avx2lanes.r8"} <= set(refused.split(",")), out
    assert "avx2.r8: Q4_K K=256 M=1: int8 matmul, r8 layout" in out[1], out
    assert out[-1] == "1", "r8 through the file kernels must give the reference's bits"
    env["SPECEXPORT_KERNEL_SELFCHECK"] = "off"
    out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    assert out[-1] == "0", "the planted r8 bug must change the bits when nothing refuses it"


def test_auto_takes_r8_where_the_one_row_path_is_avx2_and_the_file_elsewhere(kernels):
    st = cpu.status()
    if not st.available:
        kernels_missing(st.line())
    from specexport.plugins.cpu import layout as layouts

    layout, why = layouts.choose("auto", st)
    expected = cpu.expected_paths() or set()
    best = [p for p in ("neon", "amx", "avx512vnni", "avxvnni", "avx512", "avx2", "ref") if p in expected][0]
    assert layout == ("r8" if best == "avx2" else "file"), (layout, why, sorted(expected))
    assert layouts.choose("file", st) == ("file", "layout: file")
    assert layouts.choose("auto", cpu.Status(None, reason="x"))[0] == "file"
