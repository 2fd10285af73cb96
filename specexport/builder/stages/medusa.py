"""MedusaStage: the Medusa heads' graph, checked against Medusa's own head structure in PyTorch on the
target fp32 graph's own hidden states (the parity gate), and `tree: auto` (heads/medusa_tree.py): the
manifest's heads.medusa record."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport import owned
from specexport.builder.context import eval_sequences, files_entry
from specexport.builder.stage import Stage
from specexport.builder.stages.head_blocks import PRECISION, SEQUENCES, dequantized, kernel_head
from specexport.errors import ParityError
from specexport.io_spec import HIDDEN_STATES
from specexport.manifest import files_intact


@dataclass(frozen=True)
class HeadsStage(Stage):
    """Heads on the target's states, exported as their own graph: heads.<kind> in the manifest."""
    heads: object = None              # builder.plan.HeadsPlan

    def previous(self, ctx) -> dict | None:
        return ctx.previous.get("heads", {}).get(self.name)

    def reusable(self, ctx, entry: dict) -> bool:
        stages = entry.get("precisions", {})
        return entry.get("fingerprint") == self.fingerprint and "fp32" in stages and \
            all(files_intact(ctx.out, stage["files"]) for stage in stages.values())

    def describe(self, entry: dict) -> str:
        return entry["precisions"]["fp32"]["dir"]

    def place(self, manifest: dict, entry: dict) -> None:
        manifest.setdefault("heads", {})[self.name] = entry


@dataclass(frozen=True)
class MedusaStage(HeadsStage):
    def run(self, ctx) -> dict:
        """Export the heads' graph, check it against the published math in PyTorch on the target fp32
        graph's own hidden states, choose tree: auto."""
        from specexport.export.validate import parity_case
        from specexport.heads.medusa import export_heads, heads_parity, target_states
        from specexport.quant.quality import runtime_session

        hp, plan, out, reporter = self.heads, ctx.plan, ctx.out, ctx.reporter
        w, target = hp.weights, ctx.model("target")
        target_dir = ctx.stage_dir("target/fp32")
        partial, final = ctx.folders.new(hp.role, "fp32")
        start = time.perf_counter()
        try:
            label = f"{w.num_heads} heads x {w.num_layers} blocks, {w.format}, lm_head {w.lm_head}"
            lm_head = target_lm_head(target) if w.lm_head == "target" else None
            with reporter.stage(f"export {hp.role} heads ({label}) to ONNX"):
                names = [f.name for f in export_heads(w, lm_head, hp.io, onnx_path=partial / "model.onnx")]
            with reporter.stage(f"check {hp.role} heads against PyTorch on the target's hidden states"):
                case = parity_case(target.io, max_seq_len=plan.config.max_seq_len,
                                   max_verify_tokens=plan.config.max_verify_tokens)
                session = runtime_session(target_dir / "model.onnx")
                hidden, = target_states(session, target.io, case.seq)
                report = heads_parity(w, lm_head, hp.io, onnx_path=partial / "model.onnx", hidden=hidden)
                held_out = _held_out_states(ctx, target, session)
                del session
            tolerance = plan.config.parity_tolerance
            if not report["max_rel_error"] <= tolerance:
                raise ParityError(f"{hp.role} heads: parity check failed: max|Δlog-prob| / max|log-prob| = "
                                  f"{report['max_rel_error']:.3e} > tolerance {tolerance:.1e}")
            auto = auto_tree(ctx, hp, target_dir, partial)
            ctx.folders.publish(partial, final)
        finally:
            owned.remove(partial)          # ours: marked when made
        blocks = kernel_head(ctx, hp, final, **medusa_checks(hp, lm_head, hidden, held_out))
        stage = {**files_entry(out, final, names), "parity_reference": "pytorch",
                 "parity_max_rel_error": report["max_rel_error"], "parity_rows": report["rows"],
                 "parity_tolerance": tolerance, "build_seconds": round(time.perf_counter() - start, 2)}
        return {"source": str(hp.config.path), "file": w.file.name, "format": w.format, "num_heads": w.num_heads,
                "num_layers": w.num_layers, "lm_head": w.lm_head, "top_k": hp.io.top_k,
                "config_num_heads": w.config_num_heads, "fingerprint": hp.fingerprint, "io": hp.io.to_dict(),
                "auto_tree": auto, "precisions": {"fp32": stage, **({PRECISION: blocks} if blocks else {})}}


def _held_out_states(ctx, target, session) -> list:
    """The target's hidden states [S, H] of up to SEQUENCES held-out sequences: where the heads' blocks
    are compared with their fp32 weights."""
    from specexport.heads.medusa import target_states

    sequences, _ = eval_sequences(ctx, target, session)
    return [target_states(session, target.io, seq)[0] for seq in sequences[:SEQUENCES]]


def medusa_checks(hp, lm_head, hidden, held_out) -> dict:
    """kernel_head's parity and proposals for Medusa heads: heads_parity on the dequantized weights;
    each head's top-1 at every held-out position."""
    from specexport.heads.medusa import heads_parity

    w = hp.weights
    deq = dataclasses.replace(w, blocks=tuple(tuple((dequantized(a), b) for a, b in blocks) for blocks in w.blocks),
                              projections=tuple(None if p is None else dequantized(p) for p in w.projections))
    lm = None if lm_head is None else dequantized(lm_head)

    def parity(twin, session):
        return heads_parity(deq, lm, hp.io, onnx_path=twin, hidden=hidden, session=session)

    def proposals(session):
        return np.concatenate([session.run(None, {HIDDEN_STATES: h[None].astype(np.float32)})[0][0, ..., 0].ravel()
                               for h in held_out]) if held_out else np.zeros(0, np.int64)

    return {"parity": parity, "proposals": proposals}


def auto_tree(ctx, hp, target_dir: Path, heads_dir: Path) -> dict:
    """`tree: auto`: the heads' accuracy on held-out sequences and the target's verify cost per size
    (heads/medusa_tree.py), measured on the graphs just built."""
    from specexport.heads.medusa_tree import (PREFIX, choose_tree, greedy_continuation, head_accuracy, heads_cost,
                                               verify_costs)
    from specexport.quant.quality import runtime_session
    from specexport.runtime.backends.heads import OrtHeads
    from specexport.runtime.backends.ort import OrtBackend

    plan, reporter, target = ctx.plan, ctx.reporter, ctx.model("target")
    session = runtime_session(target_dir / "model.onnx")
    sequences, text = eval_sequences(ctx, target, session)
    label = f"greedy continuations of {PREFIX}-token prefixes of {text['label']}"
    with reporter.stage(f"tree: auto from the heads' accuracy on {label} and the target's verify cost"):
        max_tokens = plan.config.max_verify_tokens
        with OrtBackend(target_dir, io=target.io, capacity=plan.config.max_seq_len,
                        max_tokens=max(max_tokens, 64)) as backend:
            # what greedy decoding feeds the heads: the target's own continuations, not sampled text
            sequences = [greedy_continuation(backend, seq[:PREFIX], len(seq)) for seq in sequences
                         if len(seq) > PREFIX + 2]
            costs = verify_costs(backend, range(1, max_tokens + 1))
        acc = head_accuracy(session, target.io, runtime_session(heads_dir / "model.onnx"), sequences=sequences,
                            top_k=hp.io.top_k,
                            start=PREFIX - 1)
        del session
        heads = OrtHeads(heads_dir, io=hp.io)
        choice = choose_tree(acc, costs, heads_cost(heads, hp.io.hidden_size), max_nodes=max_tokens - 1)
    reporter.note(f"  tree auto: {choice['nodes']} nodes, {choice['expected_tokens']:.2f} expected tokens per pass, "
                  f"predicted {choice['predicted_speedup']:.2f}x (head top-1 accuracy "
                  f"{', '.join(f'{a:.2f}' for a in acc[:, 0])})")
    return {**choice, "accuracy": acc.round(4).tolist(),
            "accuracy_text": f"greedy continuations of {PREFIX}-token prefixes of {text['description']}",
            "verify_cost_ms": {str(t): round(c * 1e3, 4) for t, c in costs.items()}}


def target_lm_head(target):
    """The target's lm_head weight [V, H] (for heads that reuse it), read through its adapter."""
    from specexport.export.registry import get_adapter
    from specexport.export.to_onnx import load_hf_model

    model = load_hf_model(target.config.path)
    return get_adapter(target.arch.model_type).lm_head(model).weight.detach().float().numpy().copy()
