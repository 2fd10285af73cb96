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


def kernel_node(builder, at: int, node, kind: str, raw: RawBlocks, prefix: str) -> None:
    """In quant/gguf_graph.py's _Builder: GgufMatMul / GgufGather on the file's bytes in place of `node`,
    one constant per GGUF tensor (an embedding tied to the lm_head serves both)."""
    from specexport.plugins import cpu

    N, K = raw.shape
    if raw.qtype not in cpu.TYPES or K % cpu.BLOCK[raw.qtype]:
        raise ValueError(f"{prefix}: {raw.qtype} [{N}, {K}] is not one the CPU kernels take (types "
                         f"{', '.join(cpu.TYPES)}, K a multiple of the type's block)")
    key = f"{prefix}#blocks"
    if key not in builder.shared:
        builder.shared[key] = builder._const(f"{prefix}.blocks", raw.raw)
    blocks, out = builder.shared[key], node.output[0]
    attrs = {"type": cpu.TYPES[raw.qtype], "K": K, "N": N}
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
            a = {x.name: x.i for x in n.attribute}
            groups.setdefault((n.input[0], a.get("exact", 0)), []).append((n, a))
    first, fused = {}, set()
    for (x, exact), members in groups.items():
        if len(members) < 2:
            continue
        node = helper.make_node("GgufMatMulN", [x, *(n.input[1] for n, _ in members)],
                                [n.output[0] for n, _ in members], name=members[0][0].name + ".group",
                                domain=cpu.DOMAIN, types=[a["type"] for _, a in members],
                                Ns=[a["N"] for _, a in members], K=members[0][1]["K"], exact=exact)
        first[id(members[0][0])] = node
        fused |= {id(n) for n, _ in members}
    return [first.get(id(n), n) for n in nodes if id(n) in first or id(n) not in fused]
