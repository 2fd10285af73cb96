"""Issue 10 item 6(a): does updating the KV cache in place in the graph make verification cheaper on
ONNX Runtime CPU? Exports a build's target a second way and times both graphs, interleaved.

    python benchmarks/inplace_kv.py engines/demo [--contexts 64,512] [--reps 15] [--capacity 1024]

The build's graph (graph contract 2) concatenates the committed past and the new K/V in every layer
(the runtime binds the past as a zero-copy prefix view and the new rows straight into the buffer, so
the only extra work is that in-graph Concat). The variant made here is ORT's in-place layout: every
layer's attention is `com.microsoft::GroupQueryAttention` with one [1, Hkv, capacity, D] cache bound
as both past and present (ORT writes the new rows at P..P+T-1 and attends over P+T rows, not the
capacity), and the tree mask comes as an additive bias over the P+T positions. Same weights, same
RoPE; the two graphs' logits are compared first (prefill, decode, a tree) and must agree to 1e-4.

Prints c(T) and c(T)/c(1) for both at each context, and their ratio. Run alone: the machine is shared.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from specexport.export.arch import arch_spec_from_hf
from specexport.export.registry import get_adapter
from specexport.export.to_onnx import load_hf_model, quiet_exporter
from specexport.export.wrapper import StaticKVDecoder, torch
from specexport.io_spec import ModelIO
from specexport.manifest import read_manifest, stage_dir
from specexport.runtime.backends.ort import OrtBackend, _binding_calls, open_session

SIZES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64]


# -- the in-place graph ------------------------------------------------------------------------
def _register_gqa_schema():
    """onnx ships no schema for ORT's contrib ops, and onnxscript (the exporter's graph builder) needs
    one to emit a node: declare the inputs/outputs/attributes of com.microsoft::GroupQueryAttention we use."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has("GroupQueryAttention", "com.microsoft"):
        return
    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
             "cos_cache", "sin_cache", "position_ids", "attention_bias"]
    types = {"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "P"}
    required = {"query", "seqlens_k", "total_sequence_length"}
    inputs = [param(n, types.get(n, "T")) if n in required else param(n, types.get(n, "T"), param_option=optional)
              for n in names]
    attr, kind = OpSchema.Attribute, OpSchema.AttrType
    onnx.defs.register_schema(OpSchema(
        "GroupQueryAttention", "com.microsoft", 1,
        inputs=inputs, outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], ""),
                          ("P", ["tensor(int64)"], "")],
        attributes=[attr("num_heads", kind.INT, ""), attr("kv_num_heads", kind.INT, ""),
                    attr("scale", kind.FLOAT, "")]))


@torch.library.custom_op("specexport_bench::gqa_inplace", mutates_args=())
def gqa_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                bias: torch.Tensor, num_heads: int, kv_num_heads: int, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError("export-only: this op exists to become GroupQueryAttention in the ONNX graph")


@gqa_inplace.register_fake
def _(q, k, v, cache_k, cache_v, bias, num_heads, kv_num_heads, scale):
    return torch.empty_like(q), torch.empty_like(cache_k), torch.empty_like(cache_v)


def _gqa_translation(q, k, v, cache_k, cache_v, bias, num_heads: int, kv_num_heads: int, scale: float):
    import onnxscript
    from onnxscript import opset23 as op

    msft = onnxscript.values.Opset("com.microsoft", 1)
    total = op.Shape(bias, start=3, end=4)                                     # [1]: P + T
    seqlens = op.Cast(op.Expand(op.Sub(total, op.Constant(value_ints=[1])), op.Shape(q, start=0, end=1)), to=6)
    return msft.GroupQueryAttention(q, k, v, cache_k, cache_v, seqlens, op.Cast(op.Squeeze(total), to=6),
                                    None, None, None, bias, num_heads=num_heads, kv_num_heads=kv_num_heads,
                                    scale=scale)


class InplaceKVDecoder(StaticKVDecoder):
    """Input 3 is attention_mask [B, T, P+T] (committed columns and the tree), the caches are [B, Hkv, C, D]."""

    @staticmethod
    def _visible(attention_mask, past_length):
        zero = torch.zeros((), dtype=torch.float32)
        return torch.where(attention_mask, zero, torch.finfo(torch.float32).min).unsqueeze(1)   # [B, 1, T, S]

    def _attend(self, q, k, v, cache_k, cache_v, bias, *, scale):
        return torch.ops.specexport_bench.gqa_inplace(q, k, v, cache_k, cache_v, bias, self.arch.num_heads,
                                                      self.arch.num_kv_heads, float(scale))


def export_inplace(checkpoint: Path, io: ModelIO, onnx_path: Path) -> None:
    _register_gqa_schema()
    model = load_hf_model(checkpoint)
    module = InplaceKVDecoder(model, get_adapter(model.config.model_type), arch_spec_from_hf(model.config))
    B, T, P, C = 2, 3, 4, 16            # every traced size >= 2, so no axis is specialized
    ids = torch.randint(0, io.vocab_size, (B, T))
    pos = (torch.arange(T) + P).expand(B, T).contiguous()
    mask = torch.ones(B, T, P + T, dtype=torch.bool)
    rows = torch.arange(1, 3).expand(B, 2).contiguous()
    caches = tuple(torch.randn(B, io.num_kv_heads, C, io.head_dim) for _ in range(2 * io.num_layers))
    dim = torch.export.Dim
    b, t, s, r, c = (dim(n, min=1) for n in ("batch", "tokens", "total", "rows", "capacity"))
    shapes = ({0: b, 1: t}, {0: b, 1: t}, {0: b, 1: t, 2: s}, {0: b, 1: r}, tuple({0: b, 2: c} for _ in caches))
    names = io.input_names
    names[2] = "attention_mask"
    with torch.no_grad(), quiet_exporter():
        torch.onnx.export(module, (ids, pos, mask, rows, *caches), str(onnx_path), input_names=names,
                          output_names=io.output_names, dynamic_shapes=shapes, dynamo=True, opset_version=23,
                          external_data=True, optimize=True,
                          custom_translation_table={torch.ops.specexport_bench.gqa_inplace.default: _gqa_translation})


class InplaceRunner:
    """The in-place graph driven like OrtBackend: one cache per layer bound as past and present."""

    def __init__(self, path: Path, io: ModelIO, capacity: int, max_tokens: int):
        import onnxruntime as ort

        self.io, self.session = io, open_session(path, threads=None, spin=True)
        self._in, self._out, self._run = _binding_calls(ort, self.session, self.session.io_binding())
        self.caches = [np.zeros((1, io.num_kv_heads, capacity, io.head_dim), np.float32)
                       for _ in range(2 * io.num_layers)]
        self._names = [(p, p.replace("past_", "present_")) for p in io.past_input_names]
        self.logits = np.zeros((1, max_tokens, io.vocab_size), np.float32)
        self.hidden = np.zeros((1, max_tokens, io.hidden_size), np.float32)
        self._mask = np.ones(max_tokens * (capacity + max_tokens), bool)
        self.length = 0

    def forward(self, tokens, depths=None, tree_mask=None):
        T, P = len(tokens), self.length
        mask = self._mask[:T * (P + T)].reshape(1, T, P + T)
        mask[0, :, :P] = True
        mask[0, :, P:] = np.tril(np.ones((T, T), bool)) if tree_mask is None else tree_mask
        # ORT binds these numpy inputs by address: they must stay alive until the run
        ids = np.asarray(tokens, np.int64).reshape(1, T)
        positions = (P + (np.arange(T) if depths is None else np.asarray(depths))).astype(np.int64).reshape(1, T)
        rows = np.arange(T, dtype=np.int64).reshape(1, T)
        self._in("input_ids", ids)
        self._in("position_ids", positions)
        self._in("attention_mask", mask)
        self._in("logits_rows", rows)
        for (past, present), cache in zip(self._names, self.caches):
            self._in(past, cache.shape, cache.ctypes.data)
            self._out(present, cache.shape, cache.ctypes.data)
        self._out("logits", (1, T, self.io.vocab_size), self.logits.ctypes.data)
        self._out("hidden_states", (1, T, self.io.hidden_size), self.hidden.ctypes.data)
        self._run()
        return self.logits[0, :T]


# -- the comparison ------------------------------------------------------------------------------
def agreement(concat: OrtBackend, inplace: InplaceRunner, vocab: int) -> float:
    """Max relative logit difference over a 70-token prefill, 5 decode steps and a 6-node tree."""
    toks = np.random.default_rng(0).integers(0, vocab, 80)
    worst = 0.0

    def compare(a, b):
        nonlocal worst
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))

    compare(concat.forward(toks[:70]).logits, inplace.forward(toks[:70]))
    concat.commit(70)
    inplace.length = 70
    for s in range(70, 75):
        compare(concat.forward(toks[s:s + 1]).logits, inplace.forward(toks[s:s + 1]))
        concat.commit(1)
        inplace.length += 1
    parents = [-1, 0, 0, 1, 2, 3]
    mask, depth = np.eye(6, dtype=bool), np.zeros(6, np.int64)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    compare(concat.forward(toks[:6], depths=depth, tree_mask=mask).logits,
            inplace.forward(toks[:6], depths=depth, tree_mask=mask))
    concat.rollback(0)
    inplace.length = 0
    return worst


def curves(concat: OrtBackend, inplace: InplaceRunner, context: int, reps: int, vocab: int):
    filler = np.resize(np.arange(3, vocab), context)
    concat.rollback(0)
    concat.forward(filler, phase="prefill")
    concat.commit(context)
    inplace.length = 0
    inplace.forward(filler)
    inplace.length = context
    times = {(kind, t): [] for kind in ("concat", "inplace") for t in SIZES}
    for _ in range(reps):
        for t in SIZES:
            tokens = np.resize(filler, t)
            start = time.perf_counter()
            concat.forward(tokens)
            times["concat", t].append(time.perf_counter() - start)
            concat.rollback(context)
            start = time.perf_counter()
            inplace.forward(tokens)
            times["inplace", t].append(time.perf_counter() - start)
    return {key: float(np.median(v)) for key, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--contexts", default="64,512")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--work", default=None, help="where the in-place graph goes (default: a temporary folder)")
    args = ap.parse_args()
    m = read_manifest(args.build)
    target = m["models"]["target"]
    io = ModelIO.from_dict(target["io"])
    contexts = [int(c) for c in args.contexts.split(",")]
    max_tokens = max(SIZES + contexts + [70])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.work or tmp) / "inplace.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        export_inplace(Path(target["source"]), io, path)
        print(f"exported the in-place graph of {target['source']} in {time.perf_counter() - start:.0f} s")
        inplace = InplaceRunner(path, io, args.capacity, max_tokens)
        with OrtBackend(stage_dir(Path(args.build), m, "target", "fp32"), io=io, capacity=args.capacity,
                        max_tokens=max_tokens) as concat:
            err = agreement(concat, inplace, io.vocab_size)
            print(f"logits agree: max relative difference {err:.1e}")
            if err > 1e-4:
                raise SystemExit("the two graphs disagree: not timing them")
            for context in contexts:
                c = curves(concat, inplace, context, args.reps, io.vocab_size)
                print(f"\ncontext {context}, capacity {args.capacity}, median of {args.reps} interleaved passes")
                print("T    concat ms  c(T)/c(1)   in-place ms  c(T)/c(1)   in-place/concat")
                for t in SIZES:
                    a, b = c["concat", t], c["inplace", t]
                    print(f"{t:<4} {a * 1e3:9.2f}  {a / c['concat', 1]:8.2f}   {b * 1e3:10.2f}  "
                          f"{b / c['inplace', 1]:8.2f}   {b / a:8.2f}")


if __name__ == "__main__":
    main()
