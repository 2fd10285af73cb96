"""The `gguf` precision: the fp32 graph with every weight the GGUF file quantized replaced by the file's own
blocks, nothing dequantized and quantized again. Two routes:

kernels (specexport's CPU kernels, specexport/plugins/cpu; `kernels=True`): the file's bytes verbatim

    MatMul(A, W)        ->  specexport.cpu.GgufMatMul(A, blocks)       blocks: [N, row bytes] uint8, the file's
    Gather(E, ids)      ->  specexport.cpu.GgufGather(blocks, ids)     rows in the graph's order
    MatMuls of one A    ->  specexport.cpu.GgufMatMulN(A, blocks...)   q, k, v; gate, up (the same bits)
    Add(that, bias | residual) -> the matmul's addend C                 (the same bits, one node fewer)

stock (ONNX Runtime's own ops; quant/gguf_blocks.py maps each type onto them):

    MatMul(A, W)        ->  MatMulNBits(A, codes, scale)                                   symmetric types
                            MatMulNBits(A, codes, scale) + BlockSums(A) @ C^T               affine types
    Gather(E, ids)      ->  GatherBlockQuantized(codes, ids, scale) [+ C[ids] per block]    the embedding

    BlockSums(A) = ReduceSum(Reshape(A, [B, T, K / block, block]), last axis)      [B, T, K / block]
    scale, C     = the blocks' fp32 scales and constants, multiplied out from their compact parts
                   (fp16 d, dmin; int8/uint8 sub-block scales and mins) when ONNX Runtime loads the
                   graph: the file keeps the compact parts, the kernels get constants

Which graph weight is which GGUF tensor is found by content: the fp32 graph was exported from the
checkpoint the GGUF file was converted to (export/gguf.py: transformers dequantizes with the gguf
package), so each MatMul weight (transposed) and the embedding equal one file tensor, dequantized (and,
for llama, its q/k rows unpermuted as transformers does), bit for bit. A weight without an equal file
tensor stays fp32 and is named in the report; a file tensor of a type without an exact mapping is named
too (its weights stay the fp32 graph's, the file's own values dequantized).

quant/gguf_fill.py is the lean route's (no fp32 graph): a weightless graph (export/lean.py) whose weight
inputs are matched by name through transformers' GGUF name map (export/gguf_weights.py). Both routes write each
block constant to the data file as it is made (_Builder._const), so the graph's weights are never all
in memory.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.quant.gguf_blocks import SUPPORTED, BlockCodes, decode
from specexport.quant.gguf_raw import (RawBlocks, kernel_addends, kernel_attention, kernel_groups, kernel_node,
                                      tensor_raw)


@dataclass
class GgufReport:
    replaced: dict = field(default_factory=dict)      # graph initializer -> (GGUF tensor, block type)
    kept_fp32: list = field(default_factory=list)     # graph weights no GGUF tensor matched
    unsupported: dict = field(default_factory=dict)   # GGUF tensor -> type without an exact mapping
    tails: dict = field(default_factory=dict)         # r8: tensor -> its rows past the last group of 8 (the file's)

    def types(self) -> dict:
        """Block type -> how many graph weights it replaced."""
        out: dict = {}
        for _, t in self.replaced.values():
            out[t] = out.get(t, 0) + 1
        return out


def gguf_tensors(gguf_path: Path, hf_config: dict, *, raw: bool = False):
    """Yield (name, type, BlockCodes, RawBlocks or None) per quantized 2-D tensor of the file, rows in the HF
    checkpoint's order (llama's q/k rows unpermuted with transformers' own processor; the file's bytes too
    when `raw`), and (name, type, None, None) for a quantized type without an exact mapping."""
    gguf = require("gguf")
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    processor = _row_processor(arch, hf_config)
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype in ("F32", "F16", "BF16") or len(t.shape) != 2:
            continue
        if qtype not in SUPPORTED:
            yield t.name, qtype, None, None
            continue
        rows = processor(t.name, int(t.shape[1]))
        yield t.name, qtype, tensor_codes(t, rows), tensor_raw(t, rows) if raw else None


def rewrite(fp32_graph: Path, gguf_path: Path, dest: Path, *, hf_config: dict, accuracy_level: int = 4,
            vocab_ids=None, kernels: bool = False, layout: str = "file") -> GgufReport:
    """Write `dest` (+ dest.data): the fp32 graph with the file's blocks in place of its weights.
    vocab_ids: a reduced-vocabulary draft's output rows (its lm_head holds only those rows of the file's
    output tensor, or of the embedding when tied): those rows' blocks are matched too. kernels: our ops on
    the file's bytes (module docstring), else ONNX Runtime's."""
    onnx = require("onnx")
    from onnx.external_data_helper import (
        load_external_data_for_tensor,
        uses_external_data,
    )

    model = onnx.load(str(fp32_graph), load_external_data=False)     # weights read one at a time below
    inits = {i.name: i for i in model.graph.initializer}
    by_hash: dict = {}                                  # content digest -> [(initializer, node, kind)]
    for init, node, kind in weight_users(model, inits):
        arr = read_initializer(inits[init], fp32_graph.parent)
        by_hash.setdefault(_digest(arr.T if kind == "matmul" else arr), []).append((init, node, kind))
        del arr
    reader_tensors = require("gguf").GGUFReader(str(gguf_path)).tensors
    report = GgufReport()
    builder = Builder(model, accuracy_level, wide_tensors(reader_tensors), data_file(dest), kernels=kernels, layout=layout)
    for tname, qtype, codes, raw in gguf_tensors(gguf_path, hf_config, raw=kernels):
        if codes is None:
            report.unsupported[tname] = qtype
            continue
        variants = [(tname, codes, raw)]
        if vocab_ids is not None and tname in ("output.weight", "token_embd.weight"):
            ids = np.asarray(vocab_ids, np.int64)
            variants.append((f"{tname}.vocab", take_block_rows(codes, ids), raw.take_rows(ids) if kernels else None))
        for name, c, r in variants:
            for init, node, kind in by_hash.pop(_digest(c.dequantize()), []):
                builder.replace(node, "gather" if kind == "gather" else "matmul", c, prefix=name, raw=r)
                report.replaced[init] = (name, qtype)
    report.kept_fp32, report.tails = sorted({init for users in by_hash.values() for init, _, _ in users}), builder.tails
    builder.finish(report.replaced)
    ours = {t.name for t in builder.inits}              # already in dest's data file
    for t in model.graph.initializer:                   # what stays of the fp32 graph: norms, biases, ...
        if t.name not in ours and uses_external_data(t):
            load_external_data_for_tensor(t, str(fp32_graph.parent))
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    save(model, dest)
    return report


# -- matching ----------------------------------------------------------------------------------------

def weight_users(model, inits) -> list:
    """(initializer, node, kind) for each 2-D float initializer used as a MatMul's B [K, N] ("matmul"),
    through a Transpose as B (a tied lm_head: "matmul_t", the initializer is [N, K]), or as an embedding
    Gather's data [V, H] ("gather")."""
    transposed = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Transpose"
                  and n.input[0] in inits and len(inits[n.input[0]].dims) == 2}
    out = []
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
            out.append((node.input[1], node, "matmul"))
        elif node.op_type == "MatMul" and node.input[1] in transposed:
            out.append((transposed[node.input[1]], node, "matmul_t"))
        elif node.op_type == "Gather" and node.input[0] in inits and len(inits[node.input[0]].dims) == 2:
            out.append((node.input[0], node, "gather"))
    return out


def read_initializer(tensor, folder: Path) -> np.ndarray:
    """One initializer's values, read from the graph's external data file by offset (the fp32 graph's
    weights are never all in memory: the 1.5B's are 7 GB)."""
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data

    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    count = int(np.prod(tensor.dims))
    with open(folder / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        raw = f.read(int(info.get("length", 4 * count)))
    return np.frombuffer(raw, dtype=np.float32, count=count).reshape(tuple(tensor.dims))


def _digest(arr: np.ndarray) -> str:
    a = np.ascontiguousarray(arr, dtype=np.float32)
    return f"{a.shape}:" + hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _row_processor(arch: str, hf_config: dict):
    """name, N -> the row order transformers gives this tensor when it loads the file (None: unchanged)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    from specexport.export.gguf_weights import row_order

    cls = TENSOR_PROCESSORS.get(arch)
    if cls is None:
        return lambda name, n: None
    proc = cls(config=hf_config)
    return lambda name, n: row_order(proc, name, n)


def tensor_codes(t, rows=None) -> BlockCodes:
    """A quantized 2-D file tensor (the gguf package's ReaderTensor) as BlockCodes [N, K], its output
    rows in the order `rows` (None: the file's)."""
    K, N = (int(x) for x in t.shape)                   # ggml order: ne0 = K (the row length)
    codes = decode(t.tensor_type.name, t.data, (N, K))
    return codes if rows is None else take_block_rows(codes, rows)


def take_block_rows(c: BlockCodes, rows: np.ndarray) -> BlockCodes:
    """The same blocks with the output rows (N) reordered: blocks run along K, so rows move whole."""
    def take(x):
        return None if x is None else x[rows]

    return BlockCodes(c.bits, c.block, c.codes[rows], c.d[rows], sc=take(c.sc), c_d=take(c.c_d), c_m=take(c.c_m),
                      c_shift=c.c_shift, c_sign=c.c_sign)


# -- graph building ----------------------------------------------------------------------------------

# 5/6-bit codes stored as the kernels read them (8 bits) rather than packed (4 + 1 or 2 bits, put
# together in the graph when ONNX Runtime loads it): ORT's constant folding keeps every intermediate of
# those unpacking chains until it is done, so each costs about four times its codes at load. Measured on
# Qwen2.5-Coder-1.5B Q4_K_M (ORT 1.32, one session, prepacking on): all packed, peak 6.85 GiB and 24 s
# to load; all 8-bit, 3.07 GiB and 5 s but the graph 11% over the file. So the largest tensors go 8-bit
# while the growth stays within WIDE_BUDGET of the file's tensor bytes (the graph within 10% of the
# file: its scales take a little more room than the file's too); the rest stay packed.
WIDE_BUDGET = 0.05


def wide_tensors(tensors) -> set[str]:
    """The names of the 5/6-bit tensors whose codes are stored 8-bit: largest first, within WIDE_BUDGET.
    `tensors`: the gguf package's ReaderTensor list of a file."""
    from specexport.quant.gguf_blocks import INFO_BITS

    total = sum(int(t.n_bytes) for t in tensors)
    narrow = [(int(np.prod(t.shape)) * (8 - INFO_BITS[t.tensor_type.name]) // 8, t.name) for t in tensors
              if t.tensor_type.name in INFO_BITS]
    wide, grown = set(), 0
    for growth, name in sorted(narrow, reverse=True):
        if grown + growth <= WIDE_BUDGET * total:
            wide.add(name)
            grown += growth
    return wide


class Builder:
    """Adds the block-quantized nodes and their compact initializers; removes what they replace."""

    def __init__(self, model, accuracy_level: int, wide: set[str] = frozenset(), data: Path | None = None,
                 kernels: bool = False, layout: str = "file"):
        self.model, self.level, self.wide, self.kernels = model, accuracy_level, wide, kernels
        self.layout, self.tails = layout, {}       # "file" or "r8" (gguf_raw.kernel_node); r8: tensor -> its tail rows
        self.data = data                           # the external data file: constants go there as made
        self.nodes: dict[int, list] = {}           # index of the replaced node -> its replacement nodes
        self.head: list = []                       # constant sub-graphs (scales, C): first in the graph
        self.inits: list = []
        self.shared: dict = {}                     # GGUF tensor -> (codes, scale, c) value names
        self.removed: set[int] = set()

    def _const(self, name, arr):
        """A constant initializer; one of 1 KiB or more is appended to the data file at once (the
        graph's constants are never all in memory: the 3B's are 2 GB)."""
        from onnx import TensorProto, helper, numpy_helper

        arr = np.ascontiguousarray(arr)
        if self.data is None or arr.nbytes < 1024:
            self.inits.append(numpy_helper.from_array(arr, name))
            return name
        with open(self.data, "ab") as f:
            offset = f.tell()
            f.write(arr.tobytes())
        tensor = TensorProto(name=name, dims=arr.shape, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype),
                             data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.data.name), ("offset", str(offset)), ("length", str(arr.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.inits.append(tensor)
        return name

    def _node(self, at, op, ins, outs, domain="", **attrs):
        from onnx import helper

        made = helper.make_node(op, ins, outs, name=outs[0], domain=domain, **attrs)
        (self.head if at is None else self.nodes.setdefault(at, [])).append(made)
        return outs[0]

    def _parts(self, c: BlockCodes, prefix: str):
        """(codes [N, nb, blob], scale [N, nb], C [N, nb] or None) value names, made once per GGUF tensor."""
        if prefix in self.shared:
            return self.shared[prefix]
        N, K = c.codes.shape
        nb = K // c.block
        unpack = c.info_bits and prefix.removesuffix(".vocab") not in self.wide
        codes = self._unpacked(c, prefix) if unpack else self._const(f"{prefix}.codes", c.packed_codes())
        scale = self._per_block(f"{prefix}.scale", c.d, c.sc, N=N, nb=nb)       # d [N, S] (x sub-block scales)
        const = None
        if c.affine:
            const = self._constant(c, prefix, scale, N, nb)
        self.shared[prefix] = (codes, scale, const)
        return self.shared[prefix]

    def _unpacked(self, c: BlockCodes, prefix: str) -> str:
        """[N, nb, block] uint8 codes of a 5/6-bit type from its packed low nibbles and high bits:
        code = (low | high << 4) + offset (folded into a constant when ONNX Runtime loads the graph)."""
        N, K = c.codes.shape
        low, high, h = c.split_codes()

        def unpack(name, packed, width, *, per):
            arr = self._const(f"{prefix}.{name}", packed[..., None])                   # [N, K / per, 1]
            shifts = self._const(f"{prefix}.{name}.shifts", (np.arange(per) * width).astype(np.uint8))
            mask = self._const(f"{prefix}.{name}.mask", np.array([2 ** width - 1], np.uint8))
            moved = self._node(None, "BitShift", [arr, shifts], [f"{prefix}.{name}.moved"], direction="RIGHT")
            bits = self._node(None, "BitwiseAnd", [moved, mask], [f"{prefix}.{name}.bits"])   # [N, K / per, per]
            return self._node(None, "Reshape", [bits, self._const(f"{prefix}.{name}.nk", np.array([N, K], np.int64))],
                              [f"{prefix}.{name}.flat"])

        lo, hi = unpack("lo", low, 4, per=2), unpack("hi", high, h, per=8 // h)
        four = self._const(f"{prefix}.four", np.array([4], np.uint8))
        hi4 = self._node(None, "BitShift", [hi, four], [f"{prefix}.hi4"], direction="LEFT")
        q = self._node(None, "BitwiseOr", [lo, hi4], [f"{prefix}.q"])
        code = self._node(None, "Add", [q, self._const(f"{prefix}.offset", np.array([c.offset], np.uint8))],
                          [f"{prefix}.code"])
        shape = self._const(f"{prefix}.blocks", np.array([N, K // c.block, c.block], np.int64))
        return self._node(None, "Reshape", [code, shape], [f"{prefix}.codes"])

    def _per_block(self, name: str, per_super, per_sub, *, N: int, nb: int) -> str:
        """[N, nb] float32: fp16 values per super-block [N, S], times integer ones per block [N, nb] if
        given (a K-quant's d * sc_j, dmin * m_j); exact in fp32."""
        d = self._node(None, "Cast", [self._const(f"{name}.super", per_super)], [f"{name}.super32"], to=1)
        if per_sub is None:
            return d
        per = nb // per_super.shape[1]
        d3 = self._node(None, "Unsqueeze", [d, self._const(f"{name}.ax2", np.array([2], np.int64))], [f"{name}.d3"])
        sub = self._node(None, "Cast", [self._const(f"{name}.sub", per_sub)], [f"{name}.sub32"], to=1)
        sub3 = self._node(None, "Reshape", [sub, self._const(f"{name}.shape3", np.array([N, nb // per, per], np.int64))],
                          [f"{name}.sub3"])
        prod = self._node(None, "Mul", [sub3, d3], [f"{name}.prod3"])
        return self._node(None, "Reshape", [prod, self._const(f"{name}.shape2", np.array([N, nb], np.int64))],
                          [f"{name}.blocks"])

    def _constant(self, c: BlockCodes, prefix, scale, N, nb):
        """C = c_shift * scale + c_sign * c_d (* c_m): [N, nb] float32 (quant/gguf_blocks.py)."""
        m = self._per_block(f"{prefix}.min", c.c_d, c.c_m, N=N, nb=nb)
        m = self._node(None, "Mul", [m, self._const(f"{prefix}.csign", np.float32(c.c_sign))], [f"{prefix}.csigned"])
        if c.c_shift:
            shifted = self._node(None, "Mul", [scale, self._const(f"{prefix}.cshift", np.float32(c.c_shift))],
                                 [f"{prefix}.cshifted"])
            m = self._node(None, "Add", [shifted, m], [f"{prefix}.C"])
        return m

    def replace(self, node, kind: str, c: BlockCodes | None, *, prefix: str, raw: RawBlocks | None = None) -> None:
        at = list(self.model.graph.node).index(node)
        if self.kernels:
            return kernel_node(self, at, node, kind=kind, raw=raw, prefix=prefix)
        codes, scale, const = self._parts(c, prefix)
        N, K = c.codes.shape
        nb = K // c.block
        out = node.output[0]
        if kind == "matmul":
            y = self._node(at, "MatMulNBits", [node.input[0], codes, scale], [f"{out}.nbits" if const else out],
                           domain="com.microsoft", K=K, N=N, bits=c.bits, block_size=c.block,
                           accuracy_level=self.level)
            if const:
                sums = self._block_sums(at, node.input[0], nb, block=c.block, out=out)
                ct = self._node(at, "Transpose", [const], [f"{out}.Ct"], perm=[1, 0])
                corr = self._node(at, "MatMul", [sums, ct], [f"{out}.corr"])
                self._node(at, "Add", [y, corr], [out])
        else:
            data = self._node(at, "Reshape", [codes, self._const(f"{out}.dshape", np.array([N, nb * c.block * c.bits // 8], np.int64))],
                              [f"{out}.data"])
            y = self._node(at, "GatherBlockQuantized", [data, node.input[1], scale], [f"{out}.gbq" if const else out],
                           domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=c.block, bits=c.bits)
            if const:
                rows = self._node(at, "Gather", [const, node.input[1]], [f"{out}.crows"])          # [B, T, nb]
                per = self._node(at, "Unsqueeze", [rows, self._const(f"{out}.ax", np.array([-1], np.int64))], [f"{out}.c4"])
                ones = self._const(f"{out}.ones", np.ones((1, 1, 1, c.block), np.float32))
                full = self._node(at, "Mul", [per, ones], [f"{out}.cfull"])                     # [B, T, nb, block]
                shape = self._node(at, "Shape", [y], [f"{out}.yshape"])
                flat = self._node(at, "Reshape", [full, shape], [f"{out}.cflat"])
                self._node(at, "Add", [y, flat], [out])
        self.removed.add(at)

    def _block_sums(self, at, a: str, nb: int, *, block: int, out: str) -> str:
        """[B, T, K] -> [B, T, K / block]: each block's sum of the activations."""
        shape = self._const(f"{out}.bshape", np.array([0, 0, nb, block], np.int64))
        blocks = self._node(at, "Reshape", [a, shape], [f"{out}.ablocks"])
        axes = self._const(f"{out}.baxes", np.array([-1], np.int64))
        return self._node(at, "ReduceSum", [blocks, axes], [f"{out}.asums"], keepdims=0)

    def finish(self, replaced: dict) -> None:
        """Put the new nodes where the old ones stood (topological order kept), drop the replaced
        initializers and the nodes left without a consumer (a tied lm_head's Transpose), declare the
        com.microsoft domain."""
        from onnx import helper

        graph = self.model.graph
        nodes = list(self.head)
        for i, node in enumerate(graph.node):
            nodes += self.nodes.get(i, []) if i in self.removed else [node]
        outputs = {o.name for o in graph.output}
        if self.kernels:
            kernel_attention(nodes)
            consts = {t.name: list(t.dims) for t in [*graph.initializer, *self.inits] if t.name not in replaced}
            nodes = kernel_addends(kernel_groups(nodes), consts, outputs)
        while True:                                   # unused nodes, until none is left
            used = {x for n in nodes for x in n.input} | outputs
            live = [n for n in nodes if any(o in used for o in n.output)]
            if len(live) == len(nodes):
                break
            nodes = live
        del graph.node[:]
        graph.node.extend(nodes)
        used = {x for n in nodes for x in n.input}
        keep = [t for t in graph.initializer if t.name not in replaced and t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep + [t for t in self.inits if t.name in used])
        domains = {n.domain for n in nodes} - {""}
        for domain in sorted(domains - {o.domain for o in self.model.opset_import}):
            self.model.opset_import.append(helper.make_opsetid(domain, 1))


def data_file(dest: Path) -> Path:
    """dest's external data file, new and empty (the builder appends to it; onnx.save appends the rest)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    data = dest.with_name(dest.name + ".data")
    data.write_bytes(b"")
    return data


def save(model, dest: Path) -> None:
    """dest + dest.data: the constants the builder has not written yet are appended to the data file."""
    onnx = require("onnx")
    onnx.save(model, str(dest), save_as_external_data=True, location=dest.name + ".data", size_threshold=1024)
    for f in (dest, dest.with_name(dest.name + ".data")):
        f.chmod(0o644)                    # onnx writes the data file 0600; the build's files are readable alike
