"""specexport's CPU kernels on GGUF blocks (specexport/plugins/cpu), against the gguf package's own
dequantization: every block type, the exact and the int8 mode, every kernel path equal to the reference
bit for bit, each row's bits independent of the pass (M, row order, threads), planted bugs caught."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from machine import kernels_missing
from specexport.plugins import cpu
from specexport.quant.gguf_blocks import SUPPORTED, random_blocks
from tests.close import assert_close

gguf = pytest.importorskip("gguf")

QK = cpu.BLOCK                      # weights per (super-)block along K, per type


@pytest.fixture(scope="module")
def kernels():
    try:
        return cpu.Kernels()
    except cpu.KernelsUnavailable as err:          # no compiler: the stock route is tested elsewhere
        kernels_missing(f"the CPU kernels do not build here: {err}")


def blocks(rng, qtype: str, n: int, k: int) -> np.ndarray:
    """Valid blocks, with the K types' sub-block scales over their full range (not only small ones)."""
    w = random_blocks(rng, qtype, n, k=k)
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    r = w.reshape(n, -1, size)
    if qtype == "Q6_K":
        r[..., 192:208] = rng.integers(0, 256, size=r[..., 192:208].shape, dtype=np.uint8)
    elif qtype in ("Q4_K", "Q5_K"):
        r[..., 4:16] = rng.integers(0, 256, size=r[..., 4:16].shape, dtype=np.uint8)
    return w


def dequantized(qtype: str, w: np.ndarray, k: int) -> np.ndarray:
    return gguf.quants.dequantize(w, gguf.GGMLQuantizationType[qtype]).reshape(w.shape[0], k)


def quantized_activations(x: np.ndarray, qk: int):
    """The kernels' activation quantization, in numpy: per block of qk, d = max|x| / 127 and
    q = round-half-even(x * (127 / max|x|)), float32 throughout. Returns (q as float64, d per block)."""
    xb = x.reshape(x.shape[0], -1, qk).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return q.astype(np.float64), (amax[..., 0] / np.float32(127)).astype(np.float32)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_exact_mode_is_the_gguf_dequantization_times_x(kernels, qtype):
    rng = np.random.default_rng(1)
    k = 2 * QK[qtype] if QK[qtype] == 256 else 160
    w, x = blocks(rng, qtype, 21, k), rng.standard_normal((5, k)).astype(np.float32)
    want = x.astype(np.float64) @ dequantized(qtype, w, k).astype(np.float64).T
    for path in kernels.paths():
        assert_close(kernels.matmul(qtype, x, w, path=path, exact=True), want, rel=1e-6,
                     why="weights dequantized as gguf does (float32), products summed in double, rounded once to float32")


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_int8_mode_is_exact_integer_dots_of_the_quantized_activations(kernels, qtype):
    rng = np.random.default_rng(2)
    qk = QK[qtype]
    k = 3 * qk if qk == 256 else 192
    w, x = blocks(rng, qtype, 19, k), rng.standard_normal((6, k)).astype(np.float32)
    x[1, :qk] = 0.0                                                   # an all-zero activation block
    q, d = quantized_activations(x, qk)
    wf = dequantized(qtype, w, k).astype(np.float64).reshape(19, -1, qk)
    want = np.einsum("mbi,nbi,mb->mn", q.reshape(6, -1, qk), wf, d.astype(np.float64))
    for path in kernels.paths():
        assert_close(kernels.matmul(qtype, x, w, path=path), want, rel=2e-6,
                     why="integer dot products exact; then one float32 rounding per block step (a few per row)")


def _paths_equal_the_reference(kernels, qtype: str, paths: list[str]) -> None:
    rng = np.random.default_rng(3)
    # (columns, blocks, rows): every column-tile tail (N mod 4), every row tile (1 x 4, 2 x 4, 3 x 2, 4 x 2 and
    # its tails past four rows), and columns in more than one chunk (the 32-weight types' 96 KB chunks)
    cases = [(n, 2 if QK[qtype] == 256 else 5, m) for n, m in ((1, 1), (7, 2), (8, 3), (13, 4), (6, 5), (64 + 3, 11))]
    cases += [(5, 9 if QK[qtype] == 256 else 19, int(rng.integers(1, 20))), (300, 2 if QK[qtype] == 256 else 19, 7)]
    if QK[qtype] == 32:             # even block counts: the AMX tiles take blocks in pairs (else they fall back)
        cases += [(16 + 3, 6, 16), (48, 18, 9), (32, 2, 17)]
    for n, nb, m in cases:
        k = QK[qtype] * nb
        w = blocks(rng, qtype, n, k)
        x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
        for exact in (False, True):
            ref = kernels.matmul(qtype, x, w, path="ref", exact=exact)
            for path in paths:
                got = kernels.matmul(qtype, x, w, path=path, exact=exact)
                assert np.array_equal(got, ref), f"{qtype} {path} n={n} k={k} exact={exact}"


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_every_path_equals_the_reference_bit_for_bit(kernels, qtype):
    _paths_equal_the_reference(kernels, qtype, kernels.paths())


@pytest.fixture(scope="module")
def emulated_vnni():
    try:
        k = cpu.Kernels(cpu.build(with_ort=False, emulate_vnni=True, emulate_amx=True, emulate_avx512=True))
    except cpu.KernelsUnavailable as err:
        kernels_missing(f"the CPU kernels do not build here: {err}")
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the VNNI paths are emulated with AVX2, which this CPU lacks")
    return k


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_the_vnni_avx512_and_amx_paths_equal_the_reference_emulated(emulated_vnni, qtype):
    """The VNNI, AVX-512 and AMX paths on a CPU without them: the VNNI kernels as built with the two VNNI
    instructions computed by AVX2 exactly; the 512-bit tier's columns-in-lanes kernels (transposes, sub-block
    scales, zero points, mins) with each zmm operation on two AVX2 registers; the AMX tier's layouts (the A
    tiles, the activations' packing, the scale split) with the tile instructions computed in C. On a CPU with
    them the test above runs the instructions themselves (and so does the library's own self-check, on every
    machine, before a path runs)."""
    assert {"avxvnni", "avx512vnni", "avx512", "amx"} <= set(emulated_vnni.paths()), \
        f"refused by the self-check: {emulated_vnni.refused_why()}"
    _paths_equal_the_reference(emulated_vnni, qtype, ["avxvnni", "avx512vnni", "avx512", "amx"])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
def test_every_paths_activation_quantizer_writes_the_references_bytes(kernels, qtype):
    rng = np.random.default_rng(8)
    k = 4 * QK[qtype]
    x = (rng.standard_normal((9, k)) * rng.choice([1e-30, 1e-3, 1.0, 3e4], size=(9, 1))).astype(np.float32)
    x[1, :QK[qtype]] = 0.0                                   # an all-zero block
    x[2, 5], x[3, 7], x[4, -1] = np.nan, np.inf, -np.inf     # non-finite blocks: d NaN, values 0
    x[5, :QK[qtype]] = np.arange(QK[qtype]) - QK[qtype] / 2  # ties: x * 127 / max|x| at .5
    x[6, ::3] = -0.0
    x[7] = np.float32(1e-42) * rng.integers(-9, 9, k)        # subnormals
    want = kernels.quantize(qtype, x, path="ref")
    q, d = quantized_activations(np.nan_to_num(x[[0, 5, 8]]), QK[qtype])       # the reference is what it says
    rows = want.reshape(9, -1)
    assert np.array_equal(rows[[0, 5, 8], -k:].view(np.int8), q.reshape(3, k).astype(np.int8))
    assert np.array_equal(rows[[0, 5, 8], :4 * (k // QK[qtype])].view(np.float32), d)
    for path in kernels.paths():
        assert np.array_equal(kernels.quantize(qtype, x, path=path), want), path


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_gather_is_the_gguf_dequantization_bit_for_bit(kernels, qtype):
    rng = np.random.default_rng(4)
    k = QK[qtype] * 2
    w = blocks(rng, qtype, 10, k)
    ids = np.array([[3, 0, 9], [3, 3, 1]])
    assert np.array_equal(kernels.gather(qtype, w, ids, k), dequantized(qtype, w, k)[ids])
    with pytest.raises(IndexError, match="id 10 is outside"):
        kernels.gather(qtype, w, np.array([10]), k)


def test_a_k_not_a_multiple_of_the_block_is_refused(kernels):
    w = blocks(np.random.default_rng(5), "Q4_K", 4, 256)
    assert kernels.row_bytes("Q4_K", 300) == 0
    with pytest.raises(ValueError, match="not \\[N, 0\\] for Q4_K and K=300"):
        kernels.matmul("Q4_K", np.zeros((1, 300), np.float32), w)


def test_the_graph_builder_refuses_a_shape_the_kernels_do_not_take_naming_the_tensor():
    from specexport.quant.gguf_raw import RawBlocks, kernel_node

    raw = RawBlocks("Q4_K", np.zeros((4, 144), np.uint8), 200)
    with pytest.raises(ValueError, match=r"^blk.0.ffn_up.weight: Q4_K \[4, 200\] is not one the CPU kernels take"):
        kernel_node(None, 0, None, kind="matmul", raw=raw, prefix="blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match="IQ2_XS"):
        kernel_node(None, 0, None, kind="matmul", raw=RawBlocks("IQ2_XS", np.zeros((4, 66), np.uint8), 256),
                    prefix="output.weight")


def test_attention_of_many_rows_over_one_kv_head_gives_each_row_its_own_bits(kernels):
    """sx_attend_group (one KV head's query heads and rows, keys read in shared blocks): every row equals
    sx_attend's on it, on every path, for n 1..9 rows, key counts across the block size, hidden keys, a row
    whose keys are all hidden."""
    rng = np.random.default_rng(15)
    for n, total, d in ((1, 5, 64), (3, 37, 128), (9, 16, 64), (6, 50, 8), (4, 33, 80)):
        q, K, V = rng.standard_normal((n, d)), rng.standard_normal((total, d)), rng.standard_normal((total, d))
        bias = rng.standard_normal((n, total)).astype(np.float32)
        bias[rng.random((n, total)) < 0.3] = np.finfo(np.float32).min
        if n > 2:
            bias[1] = np.finfo(np.float32).min                        # a row that sees no key: NaN, as alone
        for path in kernels.paths():
            got = kernels.attend_group(q, K, V, bias, 0.09, path=path)
            want = np.stack([kernels.attend(q[i], K, V, bias[i], 0.09, path=path) for i in range(n)])
            assert np.array_equal(got, want, equal_nan=True), (path, n, total, d)
            assert np.array_equal(got, np.stack([kernels.attend(q[i], K, V, bias[i], 0.09) for i in range(n)]),
                                  equal_nan=True), (path, n, total, d)


def test_attention_is_softmax_attention_and_a_hidden_key_is_as_if_absent(kernels):
    rng = np.random.default_rng(10)
    for d in (8, 64, 80):
        q, K, V = rng.standard_normal(d), rng.standard_normal((37, d)), rng.standard_normal((37, d))
        bias = np.zeros(37, np.float32)
        hidden = rng.random(37) < 0.3
        bias[hidden] = np.finfo(np.float32).min                      # the graph's mask value
        bias[~hidden] += rng.standard_normal((~hidden).sum()).astype(np.float32)
        s = (K[~hidden] @ q) * 0.125 + bias[~hidden]
        p = np.exp(s - s.max())
        want = (p / p.sum()) @ V[~hidden]
        ref = kernels.attend(q, K, V, bias, 0.125)
        assert_close(ref, want, rel=1e-5, why="float32 dot products and softmax against float64")
        for path in kernels.paths():
            assert np.array_equal(kernels.attend(q, K, V, bias, 0.125, path=path), ref), (path, d)
            assert np.array_equal(kernels.attend(q, K[~hidden], V[~hidden], bias[~hidden], 0.125, path=path), ref)


# -- the ONNX Runtime op: each row's bits independent of the pass ----------------------------------------

def _session(qtype: str, w: np.ndarray, k: int, threads: int, exact: int = 0):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    status = cpu.status()
    if not status.available:
        kernels_missing(status.line())
    node = helper.make_node("GgufMatMul", ["X", "W"], ["Y"], domain=cpu.DOMAIN, type=cpu.TYPES[qtype], K=k,
                            N=w.shape[0], exact=exact)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", "T", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "T", w.shape[0]])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(cpu.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(status.library))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_a_rows_bits_do_not_depend_on_m_order_or_threads(qtype):
    rng = np.random.default_rng(6)
    k = 512
    w = blocks(rng, qtype, 200, k)                                    # > one task of columns per thread
    sessions = {t: _session(qtype, w, k, t) for t in (1, 2, 4)}
    rows = rng.standard_normal((40, k)).astype(np.float32)
    alone = np.concatenate([sessions[1].run(None, {"X": rows[None, i:i + 1]})[0][0] for i in range(40)])
    for trial in range(6):
        m = int(rng.integers(1, 41))
        pick = rng.permutation(40)[:m]
        threads = (1, 2, 4)[trial % 3]
        got = sessions[threads].run(None, {"X": rows[None, pick]})[0][0]
        assert np.array_equal(got, alone[pick]), f"M={m}, {threads} threads"


def test_the_op_in_a_graph_computes_what_the_c_interface_does(kernels):
    rng = np.random.default_rng(7)
    w, x = blocks(rng, "Q4_K", 30, 512), rng.standard_normal((2, 3, 512)).astype(np.float32)
    for exact in (0, 1):
        got = _session("Q4_K", w, 512, 2, exact).run(None, {"X": x})[0]
        want = kernels.matmul("Q4_K", x.reshape(6, 512), w, path=cpu.status().path, exact=bool(exact))
        assert np.array_equal(got.reshape(6, 30), want)


def test_one_node_of_several_weights_gives_each_output_its_own_matmuls_bits(kernels):
    """GgufMatMulN (q, k, v or gate, up in one node): weights of different types and block sizes, each
    output bit-equal to its own GgufMatMul, whatever the rows and threads."""
    from onnx import TensorProto, helper, numpy_helper

    ort = pytest.importorskip("onnxruntime")
    status = cpu.status()
    if not status.available:
        kernels_missing(status.line())
    rng = np.random.default_rng(10)
    k = 512
    ws = {"Q4_K": blocks(rng, "Q4_K", 70, k), "Q6_K": blocks(rng, "Q6_K", 9, k), "Q4_1": blocks(rng, "Q4_1", 130, k)}
    for exact in (0, 1):
        node = helper.make_node("GgufMatMulN", ["X", *ws], [f"Y{i}" for i in range(3)], domain=cpu.DOMAIN,
                                types=[cpu.TYPES[t] for t in ws], Ns=[w.shape[0] for w in ws.values()], K=k, exact=exact)
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", "T", k])],
            [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["B", "T", w.shape[0]]) for i, w in enumerate(ws.values())],
            [numpy_helper.from_array(w, t) for t, w in ws.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(cpu.DOMAIN, 1)])
        for threads in (1, 2, 4):
            so = ort.SessionOptions()
            so.register_custom_ops_library(str(status.library))
            so.intra_op_num_threads = threads
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            for m in (1, 5):
                x = rng.standard_normal((1, m, k)).astype(np.float32)
                for (qtype, w), got in zip(ws.items(), sess.run(None, {"X": x})):
                    alone = _session(qtype, w, k, 1, exact).run(None, {"X": x})[0]
                    assert np.array_equal(got, alone), f"{qtype}, exact={exact}, {threads} threads, M={m}"


def test_adds_after_the_matmuls_fold_into_them_with_the_same_bits(kernels):
    """kernel_addends: a bias (a constant [N]) or a residual (ready before the matmul) added to a GgufMatMul(N)
    output becomes the node's addend C; the outputs' bits equal the graph with its Add nodes. An Add whose
    other input is computed after the matmul stays; an addend of another shape is refused by name."""
    from onnx import TensorProto, helper, numpy_helper

    from specexport.quant.gguf_raw import kernel_addends

    ort = pytest.importorskip("onnxruntime")
    status = cpu.status()
    rng = np.random.default_rng(11)
    k = 256
    ws = {"Wq": blocks(rng, "Q4_K", 40, k), "Wk": blocks(rng, "Q5_0", 24, k), "Wo": blocks(rng, "Q6_K", k, k)}
    bias = {"bq": rng.standard_normal(40).astype(np.float32), "bk": rng.standard_normal(24).astype(np.float32)}
    T = TensorProto.FLOAT
    nodes = [
        helper.make_node("GgufMatMulN", ["X", "Wq", "Wk"], ["q0", "k0"], domain=cpu.DOMAIN,
                         types=[cpu.TYPES["Q4_K"], cpu.TYPES["Q5_0"]], Ns=[40, 24], K=k),
        helper.make_node("Add", ["q0", "bq"], ["q"]),
        helper.make_node("Add", ["bk", "k0"], ["k"]),
        helper.make_node("GgufMatMul", ["X", "Wo"], ["o0"], domain=cpu.DOMAIN, type=cpu.TYPES["Q6_K"], K=k, N=k),
        helper.make_node("Add", ["R", "o0"], ["o"]),                       # the residual: a graph input
        helper.make_node("GgufMatMul", ["o", "Wo"], ["p0"], domain=cpu.DOMAIN, type=cpu.TYPES["Q6_K"], K=k, N=k),
        helper.make_node("Neg", ["X"], ["late"]),                          # computed after p0's matmul
        helper.make_node("Add", ["p0", "late"], ["p"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("X", T, ["B", "T", k]), helper.make_tensor_value_info("R", T, None)],
        [helper.make_tensor_value_info(n, T, None) for n in ("q", "k", "o", "p")],
        [numpy_helper.from_array(w, n) for n, w in {**ws, **bias}.items()])
    consts = {t.name: list(t.dims) for t in graph.initializer}
    folded = kernel_addends(list(graph.node), consts, {"q", "k", "o", "p"})
    assert [n.op_type for n in folded] == ["GgufMatMulN", "GgufMatMul", "GgufMatMul", "Neg", "Add"]
    assert list(folded[0].input) == ["X", "Wq", "Wk", "bq", "bk"] and list(folded[1].input) == ["X", "Wo", "R"]

    def session(nodes):
        g = helper.make_graph(nodes, "g", graph.input, graph.output, graph.initializer,   # the variadic outputs' type
                              value_info=[helper.make_tensor_value_info(n, T, None) for n in ("q0", "k0", "q", "k")])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(cpu.DOMAIN, 1)])
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(status.library))
        so.intra_op_num_threads = 2
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    plain, fused = session(nodes), session(folded)
    for m in (1, 5):
        feed = {"X": rng.standard_normal((1, m, k)).astype(np.float32), "R": rng.standard_normal((1, m, k)).astype(np.float32)}
        for name, a, b in zip(("q", "k", "o", "p"), plain.run(None, feed), fused.run(None, feed)):
            assert np.array_equal(a, b), f"{name}, M={m}"
    out = fused.run(None, {**feed, "R": feed["R"][0]})[2]                  # the residual without its leading 1
    assert np.array_equal(out, plain.run(None, feed)[2])
    feed["R"] = feed["R"][:, :1]                                           # a broadcast the kernel does not take
    with pytest.raises(Exception, match=r"GgufMatMul: the addend C is \[1, 1, 256\], neither Y's shape"):
        fused.run(None, feed)


def test_a_kernels_graph_where_the_library_is_hidden_says_why_and_what_to_do(tmp_path, monkeypatch):
    from onnx import TensorProto, helper, numpy_helper, save

    from specexport.runtime.backends.ort import open_session

    w = blocks(np.random.default_rng(13), "Q8_0", 4, 32)
    node = helper.make_node("GgufMatMul", ["X", "W"], ["Y"], domain=cpu.DOMAIN, type=cpu.TYPES["Q8_0"], K=32, N=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])],
                              [numpy_helper.from_array(w, "W")])
    path = tmp_path / "model.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(cpu.DOMAIN, 1)]), path)
    monkeypatch.setenv("SPECEXPORT_KERNELS", "off")
    cpu.status.cache_clear()
    try:
        with pytest.raises(cpu.KernelsUnavailable, match=r"runs specexport's CPU kernels, which do not load here "
                                                          r"\(SPECEXPORT_KERNELS=off\); build it again with"):
            open_session(path, threads=1, spin=False)
    finally:
        monkeypatch.undo()
        cpu.status.cache_clear()


def test_model_yaml_chooses_the_kernels(monkeypatch):
    """quantization: {gguf: {kernels: auto | ours | stock}}: stock writes ONNX Runtime's ops and says why; ours
    fails, naming the field and the reason, where the kernels do not run; anything else is named."""
    from specexport.builder.stages.gguf_shared import choose_kernels
    from specexport.errors import SpecexportError
    from specexport.schemes import quantization_settings

    assert quantization_settings(None, "quantization", None)["gguf"]["kernels"] == "auto"
    with pytest.raises(SpecexportError, match=r"quantization\.gguf\.kernels: expected one of auto, ours, stock, got 'fast'"):
        quantization_settings({"gguf": {"kernels": "fast"}}, "quantization", None)
    stock = choose_kernels("stock", 64, "target")
    assert not stock.available and "quantization.gguf.kernels: stock" in stock.line()
    if cpu.status().available:
        assert choose_kernels("ours", 64, "target").available and choose_kernels("auto", 64, "target").available
        assert "head_dim 60" in choose_kernels("auto", 60, "target").reason
    monkeypatch.setenv("SPECEXPORT_KERNELS", "off")
    cpu.status.cache_clear()
    try:
        assert choose_kernels("auto", 64, "target").reason == "SPECEXPORT_KERNELS=off"
        with pytest.raises(SpecexportError, match=r"target gguf: quantization\.gguf\.kernels is 'ours', but .*"
                                                  r"SPECEXPORT_KERNELS=off \(kernels: auto takes"):
            choose_kernels("ours", 64, "target")
    finally:
        monkeypatch.undo()
        cpu.status.cache_clear()


# -- planted bugs: the checks above must fail on them ------------------------------------------------

def _planted(name: str, emulate_vnni: bool = False, emulate_amx: bool = False, emulate_avx512: bool = False):
    try:
        return cpu.Kernels(cpu.build(with_ort=False, plant=name, emulate_vnni=emulate_vnni, emulate_amx=emulate_amx,
                                     emulate_avx512=emulate_avx512))
    except cpu.KernelsUnavailable as err:
        kernels_missing(f"the CPU kernels do not build here: {err}")


def test_a_block_scale_read_off_by_one_is_caught():
    bad = _planted("scale_off_by_one")
    rng = np.random.default_rng(8)
    w, x = blocks(rng, "Q4_K", 9, 256), rng.standard_normal((3, 256)).astype(np.float32)
    want = x.astype(np.float64) @ dequantized("Q4_K", w, 256).astype(np.float64).T
    with pytest.raises(AssertionError):
        assert_close(bad.matmul("Q4_K", x, w, exact=True), want, rel=1e-6, why="the planted bug")


def test_a_tile_that_drops_its_last_row_is_caught(monkeypatch):
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the bug is planted in the AVX2 path, which this CPU cannot run")
    monkeypatch.setenv("SPECEXPORT_KERNEL_SELFCHECK", "off")    # read once, at the library's first call
    bad = _planted("drop_last_row")
    rng = np.random.default_rng(9)
    w, x = blocks(rng, "Q6_K", 9, 256), rng.standard_normal((3, 256)).astype(np.float32)
    assert not np.array_equal(bad.matmul("Q6_K", x, w, path="avx2"), bad.matmul("Q6_K", x, w, path="ref"))


def test_a_path_that_differs_from_the_reference_is_refused_at_load_and_said(kernels):
    """The library's self-check (every SIMD path against the reference before it runs) on the planted
    tile bug, in a fresh process (the check runs once per process and library)."""
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the bug is planted in the AVX2 path, which this CPU cannot run")
    lib = _planted("drop_last_row").lib
    code = ("import sys; from specexport.plugins import cpu; k = cpu.Kernels(cpu.Path(sys.argv[1])); "
            "print(','.join(k.paths()), ','.join(k.refused()), k.c.sx_resolve(-1))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEXPORT_KERNEL")}
    out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, env=env, check=True)
    paths, refused, resolved = out.stdout.strip().split(" ")
    assert (paths, resolved) == ("ref", "0") and "avx2" in refused.split(","), out.stdout + out.stderr
    line = cpu.Status(lib, "ref", "ref", refused="avx2: Q4_0 K=32 M=2: int8 matmul").line()
    assert "refused: its bits differed from the reference's in the self-check: avx2: Q4_0 K=32 M=2" in line


# -- the safety net: what the CPU promises runs, checked; what cannot build is said -----------------------

def test_this_cpu_runs_every_path_its_flags_promise_with_nothing_refused(kernels):
    """The paths /proc/cpuinfo's flags promise are the library's, none refused by the self-check: a SIMD
    path whose bits broke is refused at load, and this is where that fails the suite (the loops above then
    compare the reference with itself)."""
    expected = cpu.expected_paths()
    if expected is None:
        pytest.skip("this OS has no /proc/cpuinfo to hold the library to")
    assert kernels.refused() == [], f"refused by the self-check: {kernels.refused_why()}"
    assert expected <= set(kernels.paths()), f"{sorted(expected - set(kernels.paths()))} missing; " \
                                             f"left out: {cpu.left_out(kernels.lib)}"
    assert kernels.selfcheck().startswith(",".join(p for p in kernels.paths() if p != "ref") or "nothing")
    status = cpu.status()
    if status.available:                          # the ONNX Runtime library: the same, and its best path runs
        assert not status.refused and not status.left_out, status.line()
        best = [p for p in ("neon", "avx512vnni", "avxvnni", "avx2", "ref") if p in expected][0]
        runs = "tiers" if len(expected - {"ref"}) > 1 else best        # more than one SIMD path: by measured M
        assert status.path == runs or os.environ.get("SPECEXPORT_KERNEL_PATH"), status.line()


def _planted_in_a_fresh_process(lib, qtype: str, path: str, *, check: bool) -> tuple[str, str, str, bool]:
    """A planted library loaded in a fresh process (its self-check runs once per process): (paths, refused,
    refused_why, whether `path`'s bits equal ref's on a small `qtype` matmul)."""
    code = ("import sys, numpy as np; from specexport.plugins import cpu; "
            "from specexport.quant.gguf_blocks import random_blocks; k = cpu.Kernels(cpu.Path(sys.argv[1])); "
            "print(','.join(k.paths()), ','.join(k.refused()), sep='|'); print(k.refused_why()); "
            "r = np.random.default_rng(0); q = sys.argv[2]; K = 512 if q.endswith('_K') else 64; "
            "w = random_blocks(r, q, 32, k=K); x = r.standard_normal((3, K)).astype(np.float32); "
            "print(int(np.array_equal(k.matmul(q, x, w, path=sys.argv[3]), k.matmul(q, x, w, path='ref'))))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEXPORT_KERNEL")}
    if not check:
        env["SPECEXPORT_KERNEL_SELFCHECK"] = "off"
    out = subprocess.run([sys.executable, "-c", code, str(lib), qtype, path], capture_output=True, text=True,
                         env=env, check=True).stdout.splitlines()
    paths, refused = out[0].split("|")
    return paths, refused, out[1], out[-1] == "1"


def test_a_planted_vnni_bug_is_refused_by_the_self_check_and_caught_by_the_tests():
    """A bug in the VNNI-only code (the activations' signs lost in vpdpbusd's step), in the emulated library:
    the self-check refuses both VNNI paths, naming the first case; with the check off it computes wrong bits."""
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the VNNI paths are emulated with AVX2, which this CPU lacks")
    lib = _planted("vnni_quads", emulate_vnni=True).lib
    paths, refused, why, _ = _planted_in_a_fresh_process(lib, "Q8_0", "avx2", check=True)
    # the AMX tier (where the CPU has it) runs the VNNI kernels for what it has no tiles for: refused too; the
    # 512-bit tier's own kernels (every type but Q5_K, whose VNNI kernel has no 4-byte step) and the AVX2 lanes
    # tier (no VNNI instruction) may stay
    assert {"ref", "avx2"} <= set(paths.split(",")) <= {"ref", "avx2", "avx512", "avx2lanes"}, (paths, refused)
    assert {"avxvnni", "avx512vnni"} <= set(refused.split(",")), (paths, refused)
    assert "avxvnni: Q4_0 K=32 M=1: int8 matmul" in why, why
    paths, refused, _, equal = _planted_in_a_fresh_process(lib, "Q8_0", "avxvnni", check=False)
    assert paths.startswith("ref,avx2,avxvnni,avx512vnni") and not refused and not equal


def test_a_planted_amx_layout_bug_is_refused_and_caught_in_the_emulated_tiles():
    """The activations packed for the wrong chunk of a tile (in code the real and the emulated AMX tier share):
    the self-check refuses the tier, naming the case; with the check off its Q4_K bits differ."""
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the AMX tier is emulated with AVX2's steps around it, which this CPU lacks")
    lib = _planted("amx_pack", emulate_amx=True).lib
    _, refused, why, _ = _planted_in_a_fresh_process(lib, "Q4_K", "avx2", check=True)
    assert refused == "amx" and "amx: Q4_K K=256 M=1: int8 matmul" in why, (refused, why)
    paths, _, _, equal = _planted_in_a_fresh_process(lib, "Q4_K", "amx", check=False)
    assert "amx" in paths.split(",") and not equal


def test_a_planted_avx512_scale_bug_is_refused_and_caught_in_the_emulated_lanes():
    """Q4_K's upper sub-block scales given their top bits from the wrong place, in the 512-bit tier's own code
    (emulated, so every CI machine runs it): the self-check refuses the tier naming the case; with the check
    off its Q4_K bits differ from the reference's."""
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the 512-bit tier is emulated with AVX2, which this CPU lacks")
    lib = _planted("avx512_lanes", emulate_vnni=True, emulate_avx512=True).lib
    _, refused, why, _ = _planted_in_a_fresh_process(lib, "Q4_K", "avx2", check=True)
    assert refused == "avx512" and "avx512: Q4_K K=256 M=1: int8 matmul" in why, (refused, why)
    paths, _, _, equal = _planted_in_a_fresh_process(lib, "Q4_K", "avx512", check=False)
    assert "avx512" in paths.split(",") and not equal


def test_a_planted_avx2_lanes_scale_bug_is_refused_and_caught():
    """The same scale bug in the AVX2 lanes tier's Q4_K (the real instructions: every x86 CI machine has AVX2):
    the self-check refuses the tier naming the case, the avx2 path stays; with the check off its bits differ."""
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the AVX2 lanes tier needs AVX2, which this CPU lacks")
    lib = _planted("avx2_lanes").lib
    paths, refused, why, _ = _planted_in_a_fresh_process(lib, "Q4_K", "avx2", check=True)
    assert refused == "avx2lanes" and "avx2" in paths.split(","), (paths, refused)
    assert "avx2lanes: Q4_K K=256 M=1: int8 matmul" in why, why
    paths, _, _, equal = _planted_in_a_fresh_process(lib, "Q4_K", "avx2lanes", check=False)
    assert "avx2lanes" in paths.split(",") and not equal


def test_the_self_check_is_reported_and_so_is_turning_it_off(kernels):
    env = {**os.environ, "SPECEXPORT_KERNEL_SELFCHECK": "off"}
    code = "from specexport.plugins import cpu; s = cpu.status(); print(s.selfcheck); print(s.line())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    if "stock" in out:
        kernels_missing(out)
    assert out.startswith("off (SPECEXPORT_KERNEL_SELFCHECK=off)") and "self-check off" in out, out
    if len(kernels.paths()) > 1:
        assert "int8 matmul (8 types, 2 K, rows 1-9/12/13/16/17" in kernels.selfcheck()


def test_an_edit_to_any_source_or_header_builds_the_library_anew(tmp_path, monkeypatch):
    """The cache key covers every .cc and .h beside the package (sx_attn.h too), the flags and the ORT headers."""
    here = tmp_path / "cpu"
    shutil.copytree(cpu.HERE, here, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cpu.toolchain, "HERE", here)
    cxx = cpu.compiler()
    key = cpu.cache_key(cxx, cpu.sources(), None, defines=[])
    for name in sorted(p.name for p in here.iterdir() if p.suffix in (".h", ".cc")):
        original = (here / name).read_bytes()
        (here / name).write_bytes(original + b"\n// edited\n")
        assert cpu.cache_key(cxx, cpu.sources(), None, defines=[]) != key, name
        (here / name).write_bytes(original)
    assert cpu.cache_key(cxx, cpu.sources(), None, defines=[]) == key
    assert cpu.cache_key(cxx, cpu.sources(), None, defines=["-DSX_EMULATE_VNNI"]) != key
    assert cpu.cache_key([*cxx, "-g"], cpu.sources(), None, defines=[]) != key


def test_cxx_with_arguments_is_a_compiler_and_a_missing_one_is_said(monkeypatch):
    monkeypatch.setenv("CXX", "env g++")
    assert cpu.compiler() == ["env", "g++"]
    monkeypatch.setenv("CXX", "/nonexistent/g++ -O2")
    with pytest.raises(cpu.KernelsUnavailable, match=r"CXX=/nonexistent/g\+\+ -O2: /nonexistent/g\+\+ is not a command"):
        cpu.compiler()


def test_an_optional_unit_that_does_not_compile_is_left_out_and_said(tmp_path, monkeypatch):
    """A toolchain that cannot assemble the VNNI, AVX-512 and AMX units (binutils < 2.36): the library builds
    without those paths (the AVX2 ones kept), and says which were left out and the compiler's line."""
    if "avx2" not in (cpu.expected_paths() or set()):
        pytest.skip("the VNNI unit is x86's")
    fake = tmp_path / "old-as"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in *sx_vnni.cc|*sx_avx512.cc|*sx_amx.cc) '
                    'echo "Error: no such instruction: {evex} vpdpbusd" >&2; exit 1;; esac; done\n'
                    'exec g++ "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("SPECEXPORT_KERNELS_CACHE", str(tmp_path / "kernels"))
    k = cpu.Kernels(cpu.build(with_ort=False))
    assert k.paths() == ["ref", "avx2", "avx2lanes"] and k.refused() == []
    why = "Error: no such instruction: {evex} vpdpbusd"
    assert cpu.left_out(k.lib) == {"sx_vnni.cc": {"paths": ["avxvnni", "avx512vnni"], "why": why},
                                   "sx_avx512.cc": {"paths": ["avx512"], "why": why},
                                   "sx_amx.cc": {"paths": ["amx"], "why": why}}


def test_status_never_raises_it_says_why_the_stock_route_runs(tmp_path, monkeypatch):
    """An unwritable cache (a file where its folder should be) and an ONNX Runtime older than the C API the ops
    need: each a reason, never an exception."""
    import onnxruntime

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    if cpu.status().available:                       # the headers from where they are: no fetch in this test
        monkeypatch.setenv("SPECEXPORT_ORT_INCLUDE", str(cpu.ort_include(fetch=False)))
    monkeypatch.setenv("SPECEXPORT_KERNELS_CACHE", str(blocker / "kernels"))
    cpu.status.cache_clear()
    try:
        st = cpu.status()
        assert not st.available and "not-a-folder" in st.reason, st
        monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
        cpu.status.cache_clear()
        st = cpu.status()
        assert not st.available and "onnxruntime 1.20.1 is older than 1.21" in st.reason, st
    finally:
        monkeypatch.undo()
        cpu.status.cache_clear()


def test_the_ort_headers_are_taken_only_with_their_pinned_digests(tmp_path, monkeypatch):
    """headers.py: the package's headers are kept only when each has 1.21.0's sha256; the Debian mirror is the
    machine's own (one-line or deb822 sources), never a host of ours."""
    import io
    import tarfile

    from specexport.plugins.cpu import headers

    def deb(files: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(f"./usr/include/onnxruntime/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return b"!<arch>\n" + ar_member("debian-binary", b"2.0\n") + ar_member("data.tar.xz", buf.getvalue())

    def ar_member(name: str, data: bytes) -> bytes:
        head = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        return head + data + b"\n" * (len(data) & 1)

    fake = {n: b"// not ONNX Runtime's\n" for n in headers.NAMES}
    assert headers._headers_of(deb(fake)) == fake
    package = tmp_path / "libonnxruntime-dev_1.21.0_amd64.deb"
    package.write_bytes(deb(fake))
    apt_download = headers._apt_download
    monkeypatch.setattr(headers, "_apt_download", lambda tmp: package)
    with pytest.raises(cpu.KernelsUnavailable, match=r"does not hold 1\.21\.0's onnxruntime_c_api\.h, .* \(sha256 "
                                                     r"pinned\): install Debian's or Ubuntu's libonnxruntime-dev"):
        headers._fetch(tmp_path / "ort")
    assert not (tmp_path / "ort").exists()
    monkeypatch.setenv("PATH", str(tmp_path))           # no apt (macOS, a container): the release archive named
    with pytest.raises(cpu.KernelsUnavailable, match=r"no apt-get to fetch them: .* unpack ONNX Runtime 1\.21\.0's release "
                                                     r"archive .* SPECEXPORT_ORT_INCLUDE .* carries its kernels"):
        apt_download(tmp_path)
    one = tmp_path / "sources.list"
    # local mirrors (file: URIs): what the parser takes is the machine's own configuration, whatever it names
    one.write_text("# deb file:///srv/commented/debian bookworm main\n"
                   "deb [arch=amd64] file:///srv/mirror/debian bookworm main\n")
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: file:///srv/security/debian-security\nSuites: bookworm-security\n\n"
                      "Types: deb\nURIs: file:///srv/other/debian\nSuites: bookworm\n")
    assert headers._debian_mirror([one]) == "file:///srv/mirror/debian"
    assert headers._debian_mirror([tmp_path / "absent", deb822]) == "file:///srv/other/debian"
    assert headers._debian_mirror([tmp_path / "absent"]) is None


# -- tiers: each pass on the path measured fastest for its type and rows ------------------------------------

def test_the_tiers_path_runs_each_row_count_on_its_tier_with_the_references_bits(kernels):
    """A tier table that changes path with every M (every SIMD path this CPU runs, in turn): each pass equals
    the reference bit for bit, and a path the CPU lacks, or ref, cannot be set."""
    simd = [p for p in kernels.paths() if p != "ref"]
    if not simd:
        pytest.skip("no SIMD path here: the tiers path is the reference")
    for key in cpu.tiers.keys():                  # each type in each layout: its own entries
        for m in range(1, cpu.tiers.MAX_ROWS + 1):
            path = cpu.PATHS[simd[(m + len(key)) % len(simd)]]
            assert kernels.c.sx_set_tier(cpu.capi.type_id(*cpu.tiers.split(key)), m, path) == 0
    assert kernels.c.sx_set_tier(cpu.TYPES["Q4_K"], 1, cpu.PATHS["ref"]) == 1
    assert kernels.c.sx_set_tier(cpu.TYPES["Q4_K"], 18, cpu.PATHS[simd[0]]) == 1
    rng = np.random.default_rng(21)
    for qtype in SUPPORTED:
        k = 2 * QK[qtype] if QK[qtype] == 256 else 192
        w = blocks(rng, qtype, 37, k)
        x = rng.standard_normal((19, k)).astype(np.float32)
        ref = kernels.matmul(qtype, x, w, path="ref")
        r8 = kernels.repack(qtype, w, k)
        for m in (1, 2, 3, 5, 8, 13, 16, 17, 19):
            assert np.array_equal(kernels.matmul(qtype, x[:m], w, path="tiers"), ref[:m]), (qtype, m)
            assert np.array_equal(kernels.matmul(qtype, x[:m], r8, path="tiers", layout="r8"), ref[:m]), (qtype, m)


def test_the_tier_table_is_measured_once_cached_and_said(kernels, tmp_path, monkeypatch):
    lib, cache = kernels.lib, tmp_path          # the table goes to the cache, named by the library's bytes
    calls = []

    def measured(k):                      # a table the test knows (the real measurement is tested below)
        calls.append(1)
        return {t: ["avx2"] * 8 + ["ref"] * 9 for t in cpu.tiers.keys()}

    if "avx2" not in kernels.paths():
        pytest.skip("an AVX2 table needs an AVX2 CPU")
    monkeypatch.setattr(cpu.tiers, "measure", measured)
    table = cpu.tiers.load_or_measure(kernels, lib, cache)
    assert cpu.tiers.load_or_measure(kernels, lib, cache) == table and cpu.tiers.table_file(lib, cache).is_file()
    assert len(calls) == 1
    assert cpu.tiers.describe(table) == ("Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/Q4_0.r8/Q4_1.r8/Q5_0.r8/Q5_1.r8/"
                                         "Q8_0.r8/Q4_K.r8/Q5_K.r8/Q6_K.r8: M 1-8 avx2, M 9+ ref")
    assert cpu.tiers.describe({"Q4_K": ["avx512vnni"] * 7 + ["amx"] * 10, "Q6_K": ["avx2"] * 17}) == \
        "Q4_K: M 1-7 avx512vnni, M 8+ amx; Q6_K: M 1+ avx2"
    cpu.tiers.table_file(lib, cache).write_text('{"Q4_K": ["no-such-path"]}')           # a damaged cache: measured again
    assert cpu.tiers.load_or_measure(kernels, lib, cache) == table and len(calls) == 2
    cpu.tiers.write_json_atomic(cpu.tiers.table_file(lib, cache), {t: table[t] for t in cpu.TYPES})   # no r8 entries: again
    assert cpu.tiers.load_or_measure(kernels, lib, cache) == table and len(calls) == 3


def test_the_tier_rule_keeps_a_crossover_and_drops_one_disturbed_row_count():
    """choose(): a ratio that falls with M switches path where it crosses the margin, as measured; one M whose
    timing a busy moment spoiled does not flip that M (the median of its neighbours'); one row on the first
    path (the one-row kernels) whatever its cache-resident timing says."""
    rows = cpu.tiers.ROWS
    falling = dict(zip(rows, (1.2, 1.1, 1.0, 0.9, 0.84, 0.8, 0.75, 0.7, 0.7, 0.7)))
    fastest = {(m, "avx2"): 1e-3 * m for m in rows} | {(m, "avx2lanes"): 1e-3 * m * falling[m] for m in rows}
    best = cpu.tiers.choose(fastest, ["avx2", "avx2lanes"])
    assert [best[m] for m in rows] == ["avx2"] * 4 + ["avx2lanes"] * 6
    flat = fastest | {(m, "avx2lanes"): 1e-3 * m * 0.7 for m in rows}             # lanes 0.7x at every M
    best = cpu.tiers.choose(flat | {(5, "avx2lanes"): 1e-3 * 5 * 1.3}, ["avx2", "avx2lanes"])   # M 5 disturbed
    assert all(best[m] == "avx2lanes" for m in rows[1:]), best
    assert cpu.tiers.choose(fastest | {(1, "avx2lanes"): 0.5e-3}, ["avx2", "avx2lanes"])[1] == "avx2"   # one row
    three = fastest | {(m, "amx"): 1e-3 * m * 0.66 for m in rows}                 # a matrix tier's own margin
    best = cpu.tiers.choose(three, ["avx2", "avx2lanes", "amx"])
    assert [best[m] for m in rows] == ["avx2"] + ["amx"] * 6 + ["avx2lanes"] * 3, best


def test_the_bench_measures_a_tier_table_of_its_own_and_leaves_the_cached_one(kernels, monkeypatch):
    """remeasure_tiers(): the process runs on the table it measured (the loaded library's table and the
    kernels' line say it); the table cached beside the library is not rewritten."""
    st = cpu.status()
    if not st.available or st.path != "tiers":
        pytest.skip(f"the tiers path does not run here ({st.line()})")
    cached = cpu.tiers.table_file(st.library, cpu.kernels_dir())
    before = cached.read_text() if cached.is_file() else None
    mine = {t: [kernels.paths()[-1]] * 3 + [kernels.paths()[1]] * 14 for t in cpu.TYPES}   # unlike any measured
    monkeypatch.setattr(cpu, "_measured_here", None)
    monkeypatch.setattr(cpu.tiers, "measure", lambda k: mine)
    try:
        assert cpu.remeasure_tiers() == cpu.tiers.describe(mine) == cpu.status().tiers
        c = cpu.Kernels(st.library).c
        assert all(c.sx_tier(cpu.TYPES[t], m) == cpu.PATHS[p] for t, v in mine.items() for m, p in enumerate(v, 1))
        assert (cached.read_text() if cached.is_file() else None) == before
    finally:
        monkeypatch.undo()
        cpu.status.cache_clear()              # the next status() sets the cached table again
    assert cpu.status().tiers == st.tiers


def test_the_measurement_gives_every_type_a_path_for_every_row_count(kernels):
    table = cpu.tiers.measure(kernels)
    assert set(table) == set(cpu.tiers.keys()) and all(len(v) == cpu.tiers.MAX_ROWS for v in table.values())
    assert {"Q4_K", "Q4_K.r8"} <= set(table) and cpu.tiers.split("Q4_K.r8") == ("Q4_K", "r8")
    assert all(set(v) <= set(kernels.paths()) - ({"ref"} if len(kernels.paths()) > 1 else set())
               for v in table.values()), table
    # a path that lends another's kernel for a type is never its tier (two timings of one kernel: noise)
    assert all(kernels.own_kernel(p, *cpu.tiers.split(t)) for t, v in table.items() for p in v), table
    built = {"avx512", "amx"} - {p for unit in cpu.left_out(kernels.lib).values() for p in unit["paths"]}
    if "avx512" in built:
        assert not kernels.own_kernel("avx512", "Q5_K") and kernels.own_kernel("avx512", "Q8_0")
    if "amx" in built:
        assert not kernels.own_kernel("amx", "Q5_K") and kernels.own_kernel("amx", "Q4_1")
    assert kernels.own_kernel("avx2", "Q5_K")
