"""EagleStage: export the head, check it against the published head in PyTorch on the
target fp32 graph's own features, choose `tree: auto`, and check the speculative output.

`tree: auto` (EAGLE-2's dynamic tree has three knobs; which are best depends on the head's accuracy
and on what a verify pass of T tokens costs on this machine, 1.15x-1.6x a step on a CPU): for each
candidate (top_k, depth, total_tokens) the build decodes the target's greedy continuations of
`eagle.prompts` (a chat model's are user messages of its chat template: what it will be asked), or of
prefixes of the held-out text, with the graphs just built, counts the tokens each target pass gave, and predicts
the speedup over vanilla from the measured costs: tokens per pass x c(1) / (c(T + 1) + the head's
time per round), c(T) the target's median T-token pass. Every one of those decodes must equal vanilla
greedy decoding token for token: the build's end-to-end check of the head, the proposer and the target
graph together.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from specexport import owned
from specexport._console import Steps
from specexport.builder.context import eval_sequences, files_entry
from specexport.builder.stages.head_blocks import PRECISION, SEQUENCES, eagle_checks, kernel_head
from specexport.builder.stages.medusa import HeadsStage
from specexport.errors import ParityError
from specexport.io_spec import AUX_HIDDEN_STATES

# (top_k, depth, total_tokens) tried by tree: auto; total_tokens is capped by max_verify_tokens - 1
AUTO_CANDIDATES = ((1, 3, 3), (1, 5, 5), (2, 4, 7), (2, 6, 11), (4, 5, 15), (4, 6, 31), (8, 6, 63))
AUTO_PROMPTS, AUTO_PREFIX, AUTO_TOKENS = 4, 16, 48
SCRATCH_ROWS = 512            # head cache rows beyond max_seq_len for a round's draft levels (runtime too)


@dataclass(frozen=True)
class EagleStage(HeadsStage):
    def run(self, ctx) -> dict:
        """Export + parity + tree: auto for an EAGLE head: the manifest's heads.eagle record."""
        hp, cfg, w = self.heads, ctx.config, self.heads.weights
        target_dir = ctx.stage_dir("target/fp32")
        partial, final = ctx.folders.new(hp.role, "fp32")
        start = time.perf_counter()
        try:
            embed, lm_head = target_embeddings(ctx.model("target"), hp.weights.version)
            names, report, session, case = _export_and_check(ctx, hp, target_dir, partial=partial, embed=embed,
                                                             lm_head=lm_head)
            prefixes, source = _auto_prefixes(ctx, hp, session)
            case["sequences"] = _held_out_features(ctx, hp, session)
            del session
            with ctx.reporter.stage("tree: auto from greedy decoding of held-out prompts (and its check against "
                                    "vanilla)") as steps:
                auto = auto_tree(target_dir, partial, ctx.plan, hp, prefixes, steps=steps)
            ctx.reporter.note(f"  tree auto: top_k {auto['top_k']}, depth {auto['depth']}, {auto['total_tokens']} "
                              f"tokens, {auto['tokens_per_pass']:.2f} tokens per target pass, predicted "
                              f"{auto['predicted_speedup']:.2f}x")
            ctx.folders.publish(partial, final)
        finally:
            owned.remove(partial)          # ours: marked when made
        blocks = kernel_head(ctx, hp, final, **eagle_checks(hp, embed, lm_head, case=case))
        stage = {**files_entry(ctx.out, final, names), "parity_reference": "pytorch",
                 "parity_max_rel_error": report["max_rel_error"], "parity_per_phase": report["per_phase"],
                 "parity_rows": report["rows"], "parity_tolerance": cfg.parity_tolerance,
                 "build_seconds": round(time.perf_counter() - start, 2)}
        return {"source": str(hp.config.path), "version": w.version, "aux_layers": list(w.aux_layers),
                "draft_vocab": w.draft_vocab, "target_ids": None if w.version != 3 else w.target_ids().tolist(),
                "top_k": hp.io.top_k, "fingerprint": hp.fingerprint, "io": hp.io.to_dict(),
                "scratch_rows": SCRATCH_ROWS, "auto_tree": {**auto, "text": f"greedy continuations of {source}"},
                "precisions": {"fp32": stage, **({PRECISION: blocks} if blocks else {})}}


def _export_and_check(ctx, hp, target_dir, *, partial, embed, lm_head):
    """Export the head graph into `partial` and check it against the published head in PyTorch on the
    target graph's features: (file names, parity report, the open target session, {seq, features})."""
    from specexport.export.validate import parity_case
    from specexport.heads.eagle_graph import export_head, head_parity
    from specexport.plugins.cpu.graph import with_our_attention
    from specexport.quant.quality import runtime_session
    from specexport.runtime.backends.ort import open_session

    cfg, target, w = ctx.config, ctx.model("target"), hp.weights
    label = (f"EAGLE-{w.version}" + (f", layers {list(w.aux_layers)}, draft vocabulary {w.draft_vocab}"
                                     if w.version == 3 else ""))
    with ctx.reporter.stage(f"export the {label} head to ONNX"):
        names = [f.name for f in export_head(w, embed, lm_head, io=hp.io, onnx_path=partial / "model.onnx")]
    with ctx.reporter.stage(f"check the {hp.role} head against PyTorch on the target's features"):
        case = parity_case(target.io, max_seq_len=cfg.max_seq_len, max_verify_tokens=cfg.max_verify_tokens)
        session = runtime_session(target_dir / "model.onnx")
        seq = case.seq[:min(len(case.seq), 24)]
        feats = target_features(session, target.io, seq, w)
        report = head_parity(w, embed, lm_head, io=hp.io, onnx_path=partial / "model.onnx", tokens=seq,
                             features=feats[:-1])
        # a target in `gguf` (our kernels) runs the head on our attention too: checked here; no other build
        # compiles the kernels for its head
        gguf = target.config.on_kernels
        ours = with_our_attention(partial / "model.onnx", hp.io.head_dim) if gguf else None
        if ours is not None:
            mine = head_parity(w, embed, lm_head, io=hp.io, onnx_path=partial / "model.onnx", tokens=seq,
                               features=feats[:-1],
                               session=open_session(partial / "model.onnx", threads=None, spin=False, model=ours))
            report["per_phase"].update({f"{k}, our attention": v for k, v in mine["per_phase"].items()})
            report["max_rel_error"] = max(report["max_rel_error"], mine["max_rel_error"])
    if not report["max_rel_error"] <= cfg.parity_tolerance:
        raise ParityError(f"{hp.role} head: parity check failed: relative error {report['max_rel_error']:.3e} "
                          f"({', '.join(f'{k} {v:.2e}' for k, v in report['per_phase'].items())}) > tolerance "
                          f"{cfg.parity_tolerance:.1e}")
    return names, report, session, {"seq": seq, "target_states": feats[:-1]}


def _held_out_features(ctx, hp, session) -> list:
    """(tokens, the target's features [S - 1, F]) of up to SEQUENCES held-out sequences: where the
    quantized head's proposals are compared with the fp32 head's."""
    sequences, _ = eval_sequences(ctx, ctx.model("target"), session)
    return [(seq, target_features(session, ctx.model("target").io, seq, hp.weights)[:-1])
            for seq in sequences[:SEQUENCES] if len(seq) > 2]


def _auto_prefixes(ctx, hp, session):
    """The prompts tree: auto decodes from, and a line saying what they are."""
    if hp.prompt_ids:                    # eagle.prompts: what the model will be asked
        prefixes = [np.asarray(p, np.int64) for p in hp.prompt_ids[:AUTO_PROMPTS]]
        return prefixes, f"the first {len(prefixes)} of eagle.prompts {hp.config.prompts}"
    sequences, text = eval_sequences(ctx, ctx.model("target"), session)   # held-out text: each one's first tokens
    prefixes = [seq[:AUTO_PREFIX] for seq in sequences if len(seq) > AUTO_PREFIX][:AUTO_PROMPTS]
    return prefixes, f"{AUTO_PREFIX}-token prefixes of {text['description']}"


def target_embeddings(target, version: int):
    """The target's embedding [V, H] and (EAGLE-1) lm_head [V, H] as float32 numpy; a tied lm_head is
    the embedding array itself, so the head graph stores it once."""
    from specexport.export.registry import get_adapter
    from specexport.export.to_onnx import load_hf_model

    model = load_hf_model(target.config.path)
    adapter = get_adapter(target.arch.model_type)
    emb_w, head_w = adapter.embed_tokens(model).weight, adapter.lm_head(model).weight
    embed = emb_w.detach().float().numpy().copy()
    if version != 1:
        return embed, None
    return embed, (embed if head_w is emb_w else head_w.detach().float().numpy().copy())


def target_features(session, target_io, tokens, weights) -> np.ndarray:
    """[S, F] the head's features of every position of `tokens`, from the target graph (an open session):
    EAGLE-1 its final state, EAGLE-3 its aux layers' inputs in the head's order."""
    from specexport.heads.medusa import target_states
    from specexport.runtime.proposers.eagle import feature_columns

    if weights.version == 1:
        return target_states(session, target_io, tokens)[0]
    aux, = target_states(session, target_io, tokens, outputs=(AUX_HIDDEN_STATES,))
    columns = feature_columns(target_io.aux_hidden_layers, weights.aux_layers, target_io.hidden_size)
    return aux if columns is None else aux[:, columns]


def auto_tree(target_dir, head_dir, plan, hp, prefixes, steps=None) -> dict:
    """Decode AUTO_TOKENS greedy tokens after each prefix (token arrays) with each candidate tree; check
    them against vanilla; choose by predicted speedup (module docstring). steps: _console.Steps, told of
    each decode (vanilla once per prefix, then every candidate's)."""
    from specexport.heads.medusa_tree import greedy_continuation, verify_costs
    from specexport.runtime.backends.eagle import OrtEagleHead
    from specexport.runtime.backends.ort import OrtBackend
    from specexport.runtime.loop import DecodeStats, decode
    from specexport.runtime.proposers.eagle import DynamicTree, EagleTree, feature_columns
    from specexport.runtime.sampling import SamplingParams

    cfg, target, w = plan.config, plan.target, hp.weights
    max_nodes = cfg.max_verify_tokens - 1
    candidates = sorted({(min(k, hp.io.top_k), d, min(t, max_nodes)) for k, d, t in AUTO_CANDIDATES})
    prefixes = [p[-(cfg.max_seq_len // 2):] for p in prefixes]             # room for the continuation
    new = min(AUTO_TOKENS, cfg.max_seq_len - 1 - max(len(p) for p in prefixes))
    steps = steps or Steps()
    steps.total(len(prefixes) * (1 + len(candidates)))
    with OrtBackend(target_dir, io=target.io, capacity=cfg.max_seq_len, max_tokens=max(cfg.max_verify_tokens, 64)) \
            as backend, OrtEagleHead(head_dir, io=hp.io, capacity=cfg.max_seq_len + SCRATCH_ROWS,
                                     max_tokens=max(cfg.max_verify_tokens, 64, hp.io.top_k)) as head:
        vanilla = []
        for p in prefixes:
            vanilla.append(greedy_continuation(backend, p, len(p) + new))
            steps.advance()
        costs = verify_costs(backend, range(1, max_nodes + 2))
        source = "hidden" if w.version == 1 else "aux"
        columns = None if w.version == 1 else feature_columns(target.io.aux_hidden_layers, w.aux_layers,
                                                              target.io.hidden_size)
        ids = None if w.version == 1 else w.target_ids()
        measured = {}
        for k, d, t in candidates:
            proposer = EagleTree(head, DynamicTree(top_k=k, depth=d, total_tokens=t), target_ids=ids,
                                 feature_columns=columns, feature_source=source)
            passes = tokens = 0
            verify, head_time = [], []
            head.timings = {}
            for prefix, expected in zip(prefixes, vanilla):
                stats = DecodeStats()
                got = np.concatenate([prefix, *decode(backend, proposer, prefix, max_new_tokens=new,
                                                      params=SamplingParams(0.0), rng=np.random.default_rng(0),
                                                      stats=stats)])
                if not np.array_equal(got, expected):
                    at = int(np.flatnonzero(got != expected)[0])
                    raise ParityError(f"eagle head: greedy speculative decoding (tree top_k {k}, depth {d}, {t} tokens) "
                                      f"differs from vanilla greedy decoding at token {at - len(prefix)} of a "
                                      f"held-out prefix: the head graph, its proposer or the target graph is wrong")
                passes += stats.target_passes
                tokens += stats.emitted - 1
                steps.advance()
                verify += [costs[min(p + 1, max_nodes + 1)] for p, _ in stats.rounds]
            head_time = sum(sum(v) for (phase, _), v in head.timings.items() if phase == "decode")
            head.timings = None
            per_pass = tokens / max(passes, 1)
            cost = statistics.fmean(verify) + head_time / max(passes, 1)
            measured[(k, d, t)] = {"tokens_per_pass": per_pass, "predicted_speedup": per_pass * costs[1] / cost,
                                   "head_ms_per_round": 1e3 * head_time / max(passes, 1)}
    best = max(measured, key=lambda c: measured[c]["predicted_speedup"])
    return {"top_k": best[0], "depth": best[1], "total_tokens": best[2], **measured[best],
            "candidates": [{"top_k": k, "depth": d, "total_tokens": t, **m} for (k, d, t), m in measured.items()],
            "prompts": len(prefixes), "new_tokens": new,
            "verify_cost_ms": {str(t): round(c * 1e3, 4) for t, c in costs.items()}}
