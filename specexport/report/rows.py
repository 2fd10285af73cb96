"""The records of a bench report: one row per configuration (`_row`, keys `ROW_KEYS`; the arithmetic is
in `accounting.py`), the peers (opened in their own processes by `peers.py`) and their rows, and the
memory figures (weights, KV buffers, peak RSS).
"""
from __future__ import annotations

import resource
import statistics
from pathlib import Path

from specexport.report import accounting as acc
from specexport.report.grid import VANILLA, Config, accuracy_only

ROW_KEYS = ("precision", "draft_precision", "method", "gamma", "tokens_per_s", "ttft_ms", "tpot_ms_p50", "tpot_ms_p90",
            "acceptance_rate", "acceptance_per_position", "mean_accepted_tokens", "speedup_vs_vanilla",
            "speedup_ci95", "ideal_speedup", "efficiency", "draft_step_ratio", "verify_step_ratio",
            "ideal_free_draft", "ideal_free_verify", "capped_by", "speedup_vs_fp32_vanilla", "speedup_vs_fp32_ci95",
            "accuracy_only")
# Rows whose target or draft is a GPU precision (fp16 / fp8 / int8_sq graphs) run on ONNX Runtime CPU as an
# accuracy path (FP8 Q/DQ is emulated there): they report acceptance and tokens per pass, and no time.
SPEED_KEYS = ("tokens_per_s", "ttft_ms", "prefill_ms", "draft_prefill_ms", "tpot_ms_p50", "tpot_ms_p90",
              "tokens_per_s_end_to_end", "speedup_vs_vanilla", "speedup_ci95", "ideal_speedup", "efficiency",
              "draft_step_ratio", "verify_step_ratio", "ideal_free_draft", "ideal_free_verify", "capped_by",
              "speedup_vs_fp32_vanilla", "speedup_vs_fp32_ci95")


def config_row(c: Config, runs, costs) -> dict:
    method, tp, dp, g, stop = c.method, c.precision, c.draft_precision, c.gamma, c.draft_stop
    st = runs[c]
    vanilla = runs.get(Config(VANILLA, tp, None, 0))
    # the row's own forwards price its ideal (accounting.row_costs); the session's means where runs carry none
    pooled = costs[(tp, c.proposer)]
    cost = acc.row_costs(st) or pooled
    c1 = ((vanilla and acc.row_costs(vanilla)) or pooled)["target"].get(1)
    tps = acc.throughput(st)
    base = acc.throughput(vanilla) if vanilla else None
    speedup = tps / base if tps and base else None
    fp32 = runs.get(Config(VANILLA, "fp32", None, 0))      # a quantized row against the fp32 target's vanilla
    fp32_tps = acc.throughput(fp32) if fp32 and tp != "fp32" else None
    where = dict.fromkeys(("draft_step_ratio", "verify_step_ratio", "ideal_free_draft", "ideal_free_verify",
                           "capped_by"))
    if method == VANILLA:
        ideal, interval = 1.0, [1.0, 1.0]
    else:
        ideal = acc.ideal_speedup(st, c_vanilla1=c1, c_target=cost["target"], c_draft=cost["draft"]) if c1 else None
        interval = acc.speedup_interval(st, vanilla) if vanilla else None
        if c1:
            where = acc.where_time_goes(st, c_vanilla1=c1, c_target=cost["target"], c_draft=cost["draft"])
    row = {
        "precision": tp, "draft_precision": dp, "method": method, "gamma": g, "draft_stop": stop, "tree": c.tree,
        "tokens_per_s": tps, **acc.timing_figures(st),
        # conditional acceptance per position needs chains of a fixed length: not adaptive, lookup or tree rows
        **acc.acceptance_figures(st, g, bool(stop) or method in ("lookup", "suffix") or c.tree is not None),
        "speedup_vs_vanilla": speedup, "speedup_ci95": interval, "ideal_speedup": ideal,
        "efficiency": speedup / ideal if speedup and ideal else None, **where,
        "speedup_vs_fp32_vanilla": tps / fp32_tps if tps and fp32_tps else None,
        "speedup_vs_fp32_ci95": acc.speedup_interval(st, fp32) if fp32_tps else None,
        "accuracy_only": accuracy_only(tp, dp),
        **(_suffix_figures(st) if method == "suffix" else {}),
    }
    return {**row, **dict.fromkeys(SPEED_KEYS)} if row["accuracy_only"] else row


def _suffix_figures(runs) -> dict:
    """A suffix row's lookups over all its runs: the share that found a match and proposed, the share of
    proposals taken from the shared cache, and the mean proposal time (µs, lookup and tree)."""
    lookups = sum(st.proposer.get("lookups", 0) for st in runs)
    hits = sum(st.proposer.get("hits", 0) for st in runs)
    shared = sum(st.proposer.get("from_shared", 0) for st in runs)
    us = sum((st.proposer.get("propose_us") or 0) * st.proposer.get("lookups", 0) for st in runs)
    return {"suffix_hit_rate": hits / lookups if lookups else None,
            "suffix_from_shared": shared / hits if hits else None,
            "suffix_propose_us": us / lookups if lookups else None}


# -- peers and memory ----------------------------------------------------------------------------------
PEER_FAMILIES = ("transformers", "onnxruntime-genai", "llama.cpp", "ik_llama.cpp")
SERVERS = ("llama.cpp", "ik_llama.cpp")          # report/llama_cpp.py's families


def open_peers(manifest, precisions, cfg, log):
    if not cfg.peers:
        return [], [{"peer": "all", "skipped": "peers not requested"}]
    if cfg.temperature > 0:
        return [], [{"peer": "all", "skipped": "peers run greedy; this bench samples"}]
    from specexport.report.peers import PeerProcess, peer_specs

    wanted = set(cfg.peer_families or PEER_FAMILIES)
    specs, skipped = peer_specs(manifest, precisions, work_dir=Path(cfg.out or cfg.output_dir / "bench") / "peers",
                                log=log, families=tuple(wanted - set(SERVERS)))
    peers = []
    for spec in specs:
        try:
            peers.append(PeerProcess(spec))
        except RuntimeError as err:
            skipped.append({"peer": f"{spec.family} {spec.precision}", "skipped": str(err)})
    if cfg.peer_families is None and cfg.ik_llama_cpp is None:
        wanted.discard("ik_llama.cpp")          # only where asked for: its binary is never looked up on PATH
    for family, bin_dir in (("llama.cpp", cfg.llama_cpp), ("ik_llama.cpp", cfg.ik_llama_cpp)):
        if family not in wanted:
            continue
        from specexport.report.llama_cpp import FLAVOURS, open_llama_cpp

        more, more_skipped = open_llama_cpp(manifest, bin_dir, threads=cfg.threads, n_max=cfg.llama_cpp_n_max,
                                            out=cfg.output_dir, precisions=precisions, flavour=FLAVOURS[family])
        peers, skipped = peers + more, skipped + more_skipped
    log(f"peers: {', '.join(n for p in peers for n in p.names) or 'none'} (each in its own process)")
    return peers, skipped


def peer_row(peer, name: str, runs, *, references: dict, manifest: dict) -> dict:
    """A peer's decode-time tokens/s, and how often its whole output equals our vanilla output on the same
    weights (fp32; llama.cpp: the gguf precision, where built)."""
    eos = set(manifest["special_tokens"]["eos_token_ids"] or [])
    precision = getattr(peer, "reference_precision", "fp32")
    reference = references.get(precision) or []
    same = [_same_output(g.tokens, reference[i] if reference else None, eos) for i, g in runs]
    gens = [g for _, g in runs]
    per_run = [(max(len(g.tokens) - 1, 0), g.total_s - g.ttft_s) for g in gens]
    tokens, seconds = sum(n for n, _ in per_run), sum(s for _, s in per_run)
    return {"peer": name, "precision": peer.spec.precision, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "tokens_per_s_ci95": acc.throughput_interval([n for n, _ in per_run], [s for _, s in per_run]),
            "ttft_ms": statistics.median(g.ttft_s * 1e3 for g in gens) if gens else None,
            f"same_tokens_as_{precision}_vanilla": sum(same) / len(same) if same and reference else None,
            "runs": len(gens), **_speculation(peer, name)}


def _speculation(peer, name: str) -> dict:
    """What a speculative peer reports of its own drafting (llama.cpp: drafted and accepted tokens)."""
    totals = getattr(peer, "draft_totals", {}).get(name)
    if not totals or not totals[0]:
        return {}
    return {"drafted": totals[0], "accepted": totals[1], "acceptance_rate": totals[1] / totals[0]}


def _same_output(got: list[int], ref: list[int] | None, eos: set) -> bool:
    """Whole outputs equal (a trailing EOS aside, which some peers drop); an empty output never is."""
    if not got or ref is None:
        return False
    strip = lambda ids: ids[:-1] if ids and ids[-1] in eos else ids      # noqa: E731
    return strip(list(got)) == strip(list(ref))


def memory(manifest, pipes, peers) -> dict:
    weights = {f"{role}/{p}": e["size_bytes"] for role, m in (*manifest["models"].items(),
                                                              *manifest.get("heads", {}).items())
               for p, e in m["precisions"].items()}
    kv = {f"{tp}/{dp}": p.target.kv_bytes + d.kv_bytes for tp, p in pipes.items() for dp, d in p.drafts.items()}
    kv.update({f"{tp}/-": p.target.kv_bytes for tp, p in pipes.items()})
    return {"weights_bytes": weights, "kv_buffer_bytes": kv,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_rss_note": "the bench process: every configuration's sessions; peers are apart",
            "peers_peak_rss_bytes": {f"{p.spec.family} {p.spec.precision}": p.peak_rss_bytes for p in peers}}
