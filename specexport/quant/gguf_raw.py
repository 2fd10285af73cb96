"""The kernels route of the `gguf` precision (quant/gguf_graph.py): a weight as the file's blocks verbatim,
the node of ours (specexport/plugins/cpu) that multiplies or gathers with them, and our attention in place
of ONNX Runtime's GroupQueryAttention (the same contract; each row computed alone, so a row's bits do not
depend on its pass)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.plugins.cpu.graph import kernel_attention  # noqa: F401  (gguf_graph's, as before)


@dataclass
class RawBlocks:
    """One [N, K] weight as the file's blocks, verbatim: raw [N, row bytes] uint8, rows in the graph's order."""
    qtype: str
    raw: np.ndarray
    K: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.K)

    def take_rows(self, rows: np.ndarray) -> RawBlocks:
        return RawBlocks(self.qtype, np.ascontiguousarray(self.raw[rows]), self.K)


def tensor_raw(t, rows=None) -> RawBlocks:
    """A quantized 2-D file tensor's blocks (the gguf package's ReaderTensor), rows in the order `rows`."""
    K, N = (int(x) for x in t.shape)
    raw = RawBlocks(t.tensor_type.name, np.asarray(t.data, dtype=np.uint8).reshape(N, -1), K)
    return raw if rows is None else raw.take_rows(rows)


def kernel_node(builder, at: int, node, *, kind: str, raw: RawBlocks, prefix: str) -> None:
    """In quant/gguf_graph.py's _Builder: GgufMatMul / GgufGather on the file's bytes in place of `node`,
    one constant per GGUF tensor (an embedding tied to the lm_head serves both), in the builder's layout:
    "file" (the bytes verbatim) or "r8" (the same bytes, eight rows interleaved: sx_layout.h; the gather
    reads it too, so a tied tensor stays one copy)."""
    from specexport.plugins import cpu
    from specexport.plugins.cpu import layout

    N, K = raw.shape
    if raw.qtype not in cpu.TYPES or K % cpu.BLOCK[raw.qtype]:
        raise ValueError(f"{prefix}: {raw.qtype} [{N}, {K}] is not one the CPU kernels take (types "
                         f"{', '.join(cpu.TYPES)}, K a multiple of the type's block)")
    key = f"{prefix}#blocks"
    if key not in builder.shared:
        data = raw.raw if builder.layout == "file" else layout.repack(raw.qtype, raw.raw, K, builder.layout, cpu.status().library)
        if builder.layout != "file" and N % 8:
            builder.tails[prefix] = N % 8
        builder.shared[key] = builder._const(f"{prefix}.blocks", data)
    blocks, out = builder.shared[key], node.output[0]
    attrs = {"type": cpu.TYPES[raw.qtype], "K": K, "N": N,
             **({"layout": builder.layout} if builder.layout != "file" else {})}   # file: the attribute's default
    if kind == "matmul":
        builder._node(at, "GgufMatMul", [node.input[0], blocks], [out], domain=cpu.DOMAIN,
                      exact=int(builder.level == 0), **attrs)     # level 0: float activations, as MatMulNBits's
    else:
        builder._node(at, "GgufGather", [blocks, node.input[1]], [out], domain=cpu.DOMAIN, **attrs)
    builder.removed.add(at)


def kernel_groups(nodes: list) -> list:
    """GgufMatMul nodes of one input (a layer's q, k and v; its gate and up) become one GgufMatMulN, at
    the first one's place (its input exists there, and every output's users come after its own node).
    The outputs' bits are unchanged (sx_ort.cc); a small model saves a node's fixed cost per weight."""
    from onnx import helper

    from specexport.plugins import cpu

    groups: dict = {}
    for n in nodes:
        if n.domain == cpu.DOMAIN and n.op_type == "GgufMatMul":
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            layout = a.get("layout", b"file")
            groups.setdefault((n.input[0], a.get("exact", 0), layout), []).append((n, a))
    first, fused = {}, set()
    for (x, exact, layout), members in groups.items():
        if len(members) < 2:
            continue
        node = helper.make_node("GgufMatMulN", [x, *(n.input[1] for n, _ in members)],
                                [n.output[0] for n, _ in members], name=members[0][0].name + ".group",
                                domain=cpu.DOMAIN, types=[a["type"] for _, a in members],
                                Ns=[a["N"] for _, a in members], K=members[0][1]["K"], exact=exact,
                                **({"layout": layout.decode()} if layout != b"file" else {}))
        first[id(members[0][0])] = node
        fused |= {id(n) for n, _ in members}
    return [first.get(id(n), n) for n in nodes if id(n) in first or id(n) not in fused]


def kernel_addends(nodes: list, consts: dict, outputs: set) -> list:
    """An Add of a GgufMatMul(N) output and a bias (a constant [N]) or a tensor that exists before the
    matmul runs (the residual) becomes the matmul's addend C (sx_ort.cc): the same float add, the Add
    node and its pass over Y gone (a small model's decode step spends ~5% in such Adds' fixed cost).
    consts: initializer name -> dims; outputs: the graph's outputs (never folded away)."""
    from onnx import helper

    from specexport.plugins import cpu

    made = {o: i for i, n in enumerate(nodes) for o in n.output}
    readers: dict = {}
    for n in nodes:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    addend: dict = {}                                  # matmul index -> {output slot: (C, Add's output)}
    folded = set()
    for add in nodes:
        if add.op_type != "Add" or add.domain or len(add.input) != 2:
            continue
        for y, c in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
            p = made.get(y)
            mm = nodes[p] if p is not None else None
            if mm is None or mm.domain != cpu.DOMAIN or mm.op_type not in ("GgufMatMul", "GgufMatMulN"):
                continue
            if readers.get(y) != 1 or y in outputs or c == y:
                continue
            slot = list(mm.output).index(y)
            a = {x.name: (x.ints if x.type == x.INTS else x.i) for x in mm.attribute}
            N = a["Ns"][slot] if mm.op_type == "GgufMatMulN" else a["N"]
            if c in consts:
                if list(consts[c]) != [N]:
                    continue
            elif c in made and made[c] >= p:           # computed after the matmul: not there yet
                continue
            if slot in addend.setdefault(p, {}) or len(mm.input) > (2 if mm.op_type == "GgufMatMul" else len(a["Ns"]) + 1):
                continue
            addend[p][slot] = (c, add.output[0])
            folded.add(id(add))
            break
    out = []
    for i, n in enumerate(nodes):
        if id(n) in folded:
            continue
        if i in addend:
            outs = list(n.output)
            for slot, (_, o) in addend[i].items():
                outs[slot] = o
            attrs = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            cs = [addend[i][s][0] for s in sorted(addend[i])]
            if n.op_type == "GgufMatMulN":
                attrs["adds"] = [int(s in addend[i]) for s in range(len(outs))]
            n = helper.make_node(n.op_type, [*n.input, *cs], outs, name=n.name, domain=n.domain, **attrs)
        out.append(n)
    return out
