"""`specexport bench`: configurations interleaved and repeated; report.json / report.md / plots.

A configuration is (method, target precision, draft precision, γ, draft_stop). Before measuring,
the target's thread settings are chosen (the fastest for vanilla, `threads.py`) and every
configuration runs once untimed (warm-up). Then every round runs every configuration once per
prompt, followed by the peers (each in its own process), so machine noise hits all of them alike.
The arithmetic of the rows (decode-time throughput, ideal from the rounds that ran, efficiency,
bootstrap intervals) is in `accounting.py`; the markdown and the plot in `render.py`.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from specexport.config import GPU_PRECISIONS
from specexport.errors import SpecexportError
from specexport.gamma import store_gamma_choices
from specexport.manifest import read_manifest, write_json_atomic, write_text_atomic
from specexport.report import accounting as acc
from specexport.report.folder import REPORT_FILES, claim_report_folder, record_report_files
from specexport.report.model import choose_gamma, extend, predicted_speedup
from specexport.report.threads import ThreadSetting, fastest_for_vanilla

DEFAULT_PROMPTS = ("def fibonacci(n):", "import os\n\ndef main():", "class Stack:\n    def __init__(self):")
METHODS = ("vanilla", "draft", "lookup", "medusa", "eagle")
HEAD_METHODS = ("medusa", "eagle")               # proposers that read the target's states: priced as "draft"
# A peer's thread pools (torch's OpenMP, ONNX Runtime's) spin for a while after it answers, in its own
# process but on our cores: measured on the demo, the run right after the peers had its prefill 38%
# slower (20.3 vs 14.7 ms) until this pause was added. Rotating the order spreads whatever remains.
PEER_SETTLE_S = 0.1
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


def accuracy_only(precision: str, draft_precision: str | None) -> bool:
    return precision in GPU_PRECISIONS or draft_precision in GPU_PRECISIONS


class Config(NamedTuple):
    """One row of the report."""
    method: str
    precision: str                  # the target's
    draft_precision: str | None
    gamma: int                      # chain length, or lookup's longest proposal; 0 for vanilla
    draft_stop: float = 0.0
    tree: str | None = None         # a DRAFT_TREES name (draft), a MEDUSA_TREES name (medusa), or auto / dynamic /
                                    #   a DRAFT_TREES name (eagle)

    @property
    def proposer(self) -> str | None:
        """What proposes besides the target: the draft's precision, "medusa" or "eagle", or None."""
        return self.draft_precision or (self.method if self.method in HEAD_METHODS else None)


VANILLA = "vanilla"


@dataclass(frozen=True)
class BenchConfig:
    output_dir: Path
    prompts: tuple[str, ...]
    precisions: tuple[str, ...] | None = None      # default: every precision built for the target
    methods: tuple[str, ...] = ("vanilla", "draft")
    gammas: tuple[int, ...] = (2, 3, 4, 5, 6)
    draft_stops: tuple[float, ...] = ()             # adaptive-γ rows, at the largest γ, per value
    trees: tuple[str, ...] = ()                     # draft-tree rows (DRAFT_TREES names), per precision
    medusa_trees: tuple[str, ...] = ("auto",)       # Medusa rows ("auto" or MEDUSA_TREES names) with method medusa
    eagle_trees: tuple[str, ...] = ("auto",)        # EAGLE rows ("auto", "dynamic" or DRAFT_TREES names) with eagle
    max_new_tokens: int = 128
    chat: bool = False                              # each prompt is a user message of the build's chat template
    temperature: float = 0.0                        # > 0: every row samples (seeded per prompt and round), lossless
    rounds: int = 3
    out: Path | None = None                         # default: <output_dir>/bench
    threads: int | None = None                      # the target's intra-op threads; None: the fastest for vanilla
    peers: bool = True
    plots: bool = True


def run_bench(cfg: BenchConfig, *, log=print, clock=time.perf_counter, open_pipeline=None) -> dict:
    """Run the bench and write its report. `clock` and `open_pipeline(precision=, threads=, spin=)` are
    for tests: every time the report uses comes from `clock`."""
    import specexport

    manifest = read_manifest(cfg.output_dir)
    precisions, has_draft = _check_request(cfg, manifest)
    claim_report_folder(Path(cfg.out or cfg.output_dir / "bench"))
    configs = _configs(precisions, manifest, cfg, has_draft)
    if open_pipeline is None:
        def open_pipeline(**kw):
            return specexport.load(cfg.output_dir, **kw)
    first_prompt = cfg.prompts[0]
    settings, probes = {}, {}
    for tp in precisions:
        if cfg.threads is None:
            settings[tp], probes[tp] = fastest_for_vanilla(
                open_pipeline, tp, lambda pipe: _encode(pipe, first_prompt, cfg.chat), log=log)
        else:
            settings[tp] = ThreadSetting(cfg.threads, True)
    pipes = {tp: _clocked(open_pipeline(precision=tp, **settings[tp].options()), clock) for tp in precisions}
    try:
        return _measure(cfg, manifest, configs, pipes, settings, probes, clock, log)
    finally:
        for pipe in pipes.values():
            pipe.close()


def _measure(cfg, manifest, configs, pipes, settings, probes, clock, log) -> dict:
    drafts = sorted({(c.precision, c.draft_precision) for c in configs if c.draft_precision is not None})
    for tp, dp in drafts:                           # open every draft before the runs
        pipes[tp].use_draft_precision(dp)
        pipes[tp].draft.clock = clock
    for kind in {c.method for c in configs} & set(HEAD_METHODS):
        for pipe in pipes.values():
            getattr(pipe, kind).clock = clock
    prompt_ids = {p: _encode(next(iter(pipes.values())), p, cfg.chat) for p in cfg.prompts}
    log(f"bench: warm-up, {len(configs)} configurations")
    for c in configs:
        _run(pipes, c, prompt_ids[cfg.prompts[0]], cfg.max_new_tokens, cfg.temperature)
    reference = _reference_outputs(cfg, pipes, prompt_ids) if cfg.peers and cfg.temperature == 0 else []
    for pipe in pipes.values():                     # time every forward from here on
        for b in pipe.opened:
            b.timings = {}
    peers, peer_skips = _open_peers(manifest, list(pipes), cfg, log)
    runs = {c: [] for c in configs}
    peer_runs = {name: [] for peer in peers for name in peer.names}
    log(f"bench: {len(configs)} configurations + {len(peer_runs)} peers x {len(cfg.prompts)} prompts x {cfg.rounds} "
        "rounds, interleaved")
    try:
        for r in range(cfg.rounds):
            for i, prompt in enumerate(cfg.prompts):
                # rotate the order per cell: no configuration always runs first, right after the peers
                shift = (r * len(cfg.prompts) + i) % len(configs)
                for c in configs[shift:] + configs[:shift]:
                    runs[c].append(_run(pipes, c, prompt_ids[prompt], cfg.max_new_tokens, cfg.temperature,
                                        seed=r * 1000 + i))
                for peer in peers:
                    for name in peer.names:
                        peer_runs[name].append((i, peer.run(name, prompt_ids[prompt], cfg.max_new_tokens)))
                if peers:
                    time.sleep(PEER_SETTLE_S)
            log(f"  round {r + 1}/{cfg.rounds} done")
    finally:
        for peer in peers:
            peer.close()
    # "draft" prices every forward that is not the target's: the draft model's, or the Medusa / EAGLE
    # heads' (keyed by Config.proposer; lookup rows make none)
    costs = {(tp, key): {"target": acc.decode_costs(pipes[tp].target.timings),
                         "draft": acc.decode_costs(_proposer_timings(pipes[tp], key))}
             for tp, key in {(c.precision, c.proposer) for c in configs}}
    for pipe in pipes.values():                     # the isolated timing below is not part of the runs
        for b in pipe.opened:
            b.timings = None
    max_t = max(cfg.gammas) + 1
    isolated = {(tp, key): _isolated_costs(pipes[tp], None if key in HEAD_METHODS else key, max_t, clock)
                for tp, key in costs if not accuracy_only(tp, key)}   # only the γ choice uses these
    rows = [_row(c, runs, costs) for c in configs]
    choice = _gamma_choice(rows, costs, isolated, max(cfg.gammas))
    report = {
        "command": " ".join(sys.argv),
        "output_dir": str(cfg.output_dir),
        "build_id": manifest["build_id"],
        "settings": {"prompts": len(cfg.prompts), "rounds": cfg.rounds, "max_new_tokens": cfg.max_new_tokens,
                     "greedy": cfg.temperature == 0, "temperature": cfg.temperature,
                     "bootstrap_resamples": acc.BOOTSTRAP_RESAMPLES,
                     "target_threads": {tp: s.label for tp, s in settings.items()},
                     "thread_probe_tokens_per_s": probes,
                     "draft_threads": 1},
        "rows": rows,
        "step_costs_ms": {f"{tp}/{key or '-'}": _ms(v) for (tp, key), v in costs.items()},
        "step_costs_isolated_ms": {f"{tp}/{key or '-'}": _ms(v) for (tp, key), v in isolated.items()},
        "gamma_auto": {f"{tp}/{dp}": c for (tp, dp), c in choice.items()},
        "acceptance_drop": _acceptance_drop(rows),
        "memory": _memory(manifest, pipes, peers),
        "peers": [_peer_row(p, name, peer_runs[name], reference, manifest) for p in peers for name in p.names]
                 + peer_skips,
    }
    stored = {k: {"gamma": c["gamma"], "predicted_speedup": c["predicted_speedup"],
                  "measured_tokens": c["measured_tokens"]} for k, c in choice.items()}
    methods = method_choices(rows)
    report["method_auto"] = {f"{tp}/{dp}": c for (tp, dp), c in methods.items()}
    if cfg.temperature == 0:
        report["gamma_store"] = store_gamma_choices(cfg.output_dir, stored, build_id=manifest["build_id"],
                                                    command=report["command"])
        report["gamma_store"] += store_gamma_choices(cfg.output_dir, methods, build_id=manifest["build_id"],
                                                     command=report["command"], section="method_auto")
    else:                       # `--gamma auto` / `--method auto` are greedy measurements; this one samples
        report["gamma_store"] = [f"not stored: this bench sampled at temperature {cfg.temperature} (the stored "
                                 f"choices are greedy measurements)"]
    for line in report["gamma_store"]:
        log(f"bench: {line}")
    _write_report(report, Path(cfg.out or cfg.output_dir / "bench"), cfg.plots, log)   # claimed by run_bench
    return report


def _proposer_timings(pipe, key) -> dict | None:
    """Timings of what proposes in rows whose Config.proposer is `key`: a draft precision, "medusa" or
    "eagle" (their heads), None for rows that make no proposer forwards (vanilla, lookup)."""
    model = pipe.opened_heads.get(key) if key in HEAD_METHODS else pipe.drafts[key] if key else None
    return model.timings if model is not None else None


def _check_request(cfg: BenchConfig, manifest: dict) -> tuple[list[str], bool]:
    models = manifest["models"]
    built = list(models["target"]["precisions"])
    for m in cfg.methods:
        if m not in METHODS:
            raise SpecexportError(f"--methods: {m!r} is not a method; methods: {', '.join(METHODS)}")
    precisions = list(cfg.precisions or built)
    for p in precisions:
        if p not in built:
            raise SpecexportError(f"--precisions: {p!r} was not built for the target of {cfg.output_dir}; "
                                  f"built: {', '.join(built)}")
    if not cfg.prompts:
        raise SpecexportError("--prompts: no prompts")
    if "draft" not in models and set(cfg.methods) <= {"draft"}:
        raise SpecexportError(f"--methods: {cfg.output_dir} has no draft model; 'vanilla' and 'lookup' can run")
    if "medusa" in cfg.methods and "medusa" not in manifest.get("heads", {}):
        raise SpecexportError(f"--methods: {cfg.output_dir} has no Medusa heads (add medusa: to the model.yaml)")
    if "eagle" in cfg.methods and "eagle" not in manifest.get("heads", {}):
        raise SpecexportError(f"--methods: {cfg.output_dir} has no EAGLE head (add eagle: to the model.yaml)")
    return precisions, "draft" in models and "draft" in cfg.methods


def _clocked(pipe, clock):
    pipe.clock = pipe.target.clock = clock
    return pipe


def _encode(pipe, prompt: str, chat: bool) -> list[int]:
    return pipe.chat_ids(prompt) if chat else pipe.encode(prompt)


def _run(pipes, c: Config, prompt_ids, max_new_tokens: int, temperature: float = 0.0, *, seed: int = 0):
    """One generation; sampled (temperature > 0) with the same seed for every configuration of a cell."""
    pipe = pipes[c.precision]
    if c.draft_precision is not None:
        pipe.use_draft_precision(c.draft_precision)
    return pipe.generate(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, method=c.method, gamma=max(c.gamma, 1),
                         draft_stop=c.draft_stop, tree=c.tree, temperature=temperature, seed=seed).stats


def _configs(precisions, manifest, cfg, has_draft):
    """Per target precision: vanilla; the draft of the same precision at every γ (and the adaptive
    rows); with an fp32 target, every quantized draft at every γ (the edge trick: quantize the draft
    harder); with a quantized target, the fp32 draft at the first γ (acceptance cost of that side)."""
    from specexport.runtime.pipeline import DRAFT_TREES, MEDUSA_TREES
    from specexport.runtime.tree import from_rank_paths

    configs, models = [], manifest["models"]
    auto = manifest.get("heads", {}).get("medusa", {}).get("auto_tree")
    draft_built = models.get("draft", {}).get("precisions", {}) if has_draft else {}
    for p in precisions:
        if "vanilla" in cfg.methods:
            configs.append(Config(VANILLA, p, None, 0))
        if "lookup" in cfg.methods:                 # prompt lookup: the target alone, up to γ tokens per round
            configs += [Config("lookup", p, None, g) for g in cfg.gammas]
        if "medusa" in cfg.methods:
            for name in cfg.medusa_trees:
                paths = auto["paths"] if name == "auto" and auto else MEDUSA_TREES.get(name)
                if paths is None:
                    raise SpecexportError(f"--medusa-trees: {name!r} is not a known tree; known: auto, "
                                          f"{', '.join(MEDUSA_TREES)}")
                tree = from_rank_paths(paths)[0]
                if tree.size > manifest["max_verify_tokens"]:
                    raise SpecexportError(f"--medusa-trees: {name!r} has {tree.size - 1} nodes; this build verifies at "
                                          f"most max_verify_tokens - 1 = {manifest['max_verify_tokens'] - 1}")
                configs.append(Config("medusa", p, None, int(tree.depths.max()), tree=name))   # depth as written
        if "eagle" in cfg.methods:
            configs += [Config("eagle", p, None, _eagle_depth(name, manifest), tree=name) for name in cfg.eagle_trees]
        if p in draft_built:
            configs += [Config("draft", p, p, g) for g in cfg.gammas]
            configs += [Config("draft", p, p, max(cfg.gammas), stop) for stop in cfg.draft_stops if stop > 0]
            for name in cfg.trees:
                if name not in DRAFT_TREES:
                    raise SpecexportError(f"--trees: {name!r} is not a known tree; known: {', '.join(DRAFT_TREES)}")
                depth = int(from_rank_paths(DRAFT_TREES[name])[0].depths.max())
                configs.append(Config("draft", p, p, depth, tree=name))
    if "fp32" in draft_built:
        for p in precisions:
            if p != "fp32":
                configs.append(Config("draft", p, "fp32", cfg.gammas[0]))
    if "fp32" in precisions:
        for d in draft_built:
            if d != "fp32":
                configs += [Config("draft", "fp32", d, g) for g in cfg.gammas]
    return configs


def _eagle_depth(name: str, manifest: dict) -> int:
    """The depth an EAGLE row's tree reaches (its γ column): auto's measured, dynamic's default, a static tree's."""
    from specexport.runtime.pipeline import DRAFT_TREES
    from specexport.runtime.proposers import DynamicTree
    from specexport.runtime.tree import from_rank_paths

    if name == "auto":
        auto = manifest["heads"]["eagle"].get("auto_tree")
        if not auto:
            raise SpecexportError("--eagle-trees: 'auto' needs the tree the build measured; this build has none")
        return int(auto["depth"])
    if name.startswith("dynamic"):
        from specexport.runtime.pipeline import dynamic_tree_settings

        return DynamicTree(**dynamic_tree_settings(name)).depth
    if name not in DRAFT_TREES:
        raise SpecexportError(f"--eagle-trees: {name!r} is not a known tree; known: auto, dynamic, "
                              f"dynamic:TOP_K/DEPTH/TOTAL_TOKENS, {', '.join(DRAFT_TREES)}")
    return int(from_rank_paths(DRAFT_TREES[name])[0].depths.max())


def _reference_outputs(cfg, pipes, prompt_ids: dict) -> list[list[int]]:
    """Our fp32 vanilla output per prompt: what every peer row's "same tokens" is checked against."""
    import specexport

    pipe = pipes.get("fp32") or specexport.load(cfg.output_dir, precision="fp32")
    try:
        return [pipe.generate(prompt_ids=prompt_ids[p], max_new_tokens=cfg.max_new_tokens, method="vanilla").token_ids
                for p in cfg.prompts]
    finally:
        if pipe is not pipes.get("fp32"):
            pipe.close()


def _open_peers(manifest, precisions, cfg, log):
    if not cfg.peers:
        return [], [{"peer": "all", "skipped": "peers not requested"}]
    if cfg.temperature > 0:
        return [], [{"peer": "all", "skipped": "peers run greedy; this bench samples"}]
    from specexport.report.peers import PeerProcess, peer_specs

    specs, skipped = peer_specs(manifest, precisions, work_dir=Path(cfg.out or cfg.output_dir / "bench") / "peers",
                                log=log)
    peers = []
    for spec in specs:
        try:
            peers.append(PeerProcess(spec))
        except RuntimeError as err:
            skipped.append({"peer": f"{spec.family} {spec.precision}", "skipped": str(err)})
    log(f"peers: {', '.join(n for p in peers for n in p.names) or 'none'} (each family in its own process)")
    return peers, skipped


def _isolated_costs(pipe, dp, max_t: int, clock, reps: int = 20) -> dict:
    """Median seconds of one forward at a context of 64 tokens (fewer when max_seq_len is small),
    target for T = 1..max_t, draft T = 1: for the γ prediction beyond the sizes the runs made."""
    if dp is not None:
        pipe.use_draft_precision(dp)
    ctx = (3 + np.arange(max(1, min(64, pipe.capacity - max_t)))) % pipe.target.vocab_size
    target = {t: [] for t in range(1, max_t + 1)}
    draft = []
    for _ in range(reps):
        for t in target:
            target[t].append(_time_forward(pipe.target, ctx, t, clock))
        if dp is not None:
            draft.append(_time_forward(pipe.draft, ctx, 1, clock))
    return {"target": {t: statistics.median(v) for t, v in target.items()},
            "draft": {1: statistics.median(draft)} if draft else {}}


def _time_forward(backend, ctx, t: int, clock) -> float:
    backend.reset()
    backend.forward(ctx, phase="prefill")
    backend.commit(len(ctx))
    start = clock()
    backend.forward(ctx[:t])
    return clock() - start


def _row(c: Config, runs, costs) -> dict:
    method, tp, dp, g, stop = c.method, c.precision, c.draft_precision, c.gamma, c.draft_stop
    st = runs[c]
    vanilla = runs.get(Config(VANILLA, tp, None, 0))
    cost = costs[(tp, c.proposer)]
    c1 = cost["target"].get(1)          # one target session per precision: vanilla's T = 1 forwards are these
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
        **acc.acceptance_figures(st, g, bool(stop) or method == "lookup" or c.tree is not None),
        "speedup_vs_vanilla": speedup, "speedup_ci95": interval, "ideal_speedup": ideal,
        "efficiency": speedup / ideal if speedup and ideal else None, **where,
        "speedup_vs_fp32_vanilla": tps / fp32_tps if tps and fp32_tps else None,
        "speedup_vs_fp32_ci95": acc.speedup_interval(st, fp32) if fp32_tps else None,
        "accuracy_only": accuracy_only(tp, dp),
    }
    return {**row, **dict.fromkeys(SPEED_KEYS)} if row["accuracy_only"] else row


def _gamma_choice(rows, costs, isolated, max_gamma: int) -> dict:
    """Per (target, draft) precision: the γ the measured acceptance (at the largest fixed γ run) and
    step costs predict best; step costs from the runs, sizes they did not make from the isolated timing."""
    choice = {}
    for r in rows:
        if r["method"] != "draft" or r["draft_stop"] or not r["acceptance_conditional"] or r["accuracy_only"]:
            continue
        key = (r["precision"], r["draft_precision"])
        if key in choice and choice[key]["measured_at_gamma"] >= r["gamma"]:
            continue
        cost, iso = costs[key], isolated[key]
        c_target = {**iso["target"], **cost["target"]}
        c_draft = cost["draft"].get(1, iso["draft"].get(1))
        top = min(max_gamma, max(c_target) - 1)
        g, s = choose_gamma(r["acceptance_conditional"], c_draft=c_draft, c_target=c_target, max_gamma=top)
        choice[key] = {"gamma": g, "predicted_speedup": s, "measured_at_gamma": r["gamma"],
                       "measured_tokens": r["delivered_tokens"],
                       "predicted_by_gamma": {str(k): predicted_speedup(extend(r["acceptance_conditional"], k),
                                                                         c_draft=c_draft, c_target=c_target)
                                              for k in range(1, top + 1)}}
    return choice


def method_choices(rows) -> dict:
    """`--method auto` per (target precision, draft precision or "-"): the row with the best measured
    speedup among those that precision pair can run (draft-free rows and rows with that draft);
    vanilla when none of them beat vanilla."""
    choices = {}
    timed = [r for r in rows if not r.get("accuracy_only")]        # accuracy-only rows measured no speed
    pairs = {(r["precision"], r["draft_precision"] or "-") for r in timed}
    pairs |= {(r["precision"], "-") for r in timed}
    for tp, dp in pairs:
        candidates = [r for r in rows if r["precision"] == tp and r["method"] != VANILLA and r["speedup_vs_vanilla"]
                      and (r["draft_precision"] or "-") in ("-", dp)]
        best = max(candidates, key=lambda r: r["speedup_vs_vanilla"], default=None)
        win = best is not None and best["speedup_vs_vanilla"] > 1.0
        row = best if win else None
        choices[(tp, dp)] = {
            "method": row["method"] if row else VANILLA, "gamma": row["gamma"] if row else 0,
            "tree": row["tree"] if row else None, "draft_stop": row["draft_stop"] if row else 0.0,
            "draft_precision": row["draft_precision"] if row else None,
            "speedup": best["speedup_vs_vanilla"] if best else None,
            "speedup_ci95": best["speedup_ci95"] if best else None,
            "best_measured": f"{best['method']} γ {best['gamma']}" + (f" tree {best['tree']}" if best["tree"] else "")
            if best else None,
            "measured_tokens": sum(r["delivered_tokens"] for r in rows if r["precision"] == tp)}
    return choices


def _acceptance_drop(rows) -> list:
    """Acceptance of each quantized combination against fp32/fp32 at the same γ."""
    ref = {r["gamma"]: r["acceptance_rate"] for r in rows
           if r["method"] == "draft" and r["precision"] == "fp32" and r["draft_precision"] == "fp32" and not r["draft_stop"]
           and not r["tree"]}
    out = []
    for r in rows:
        if r["method"] == "draft" and (r["precision"], r["draft_precision"]) != ("fp32", "fp32") and r["gamma"] in ref \
                and not r["draft_stop"] and not r["tree"]:
            out.append({"target": r["precision"], "draft": r["draft_precision"], "gamma": r["gamma"],
                        "acceptance": r["acceptance_rate"], "fp32_acceptance": ref[r["gamma"]],
                        "drop": ref[r["gamma"]] - r["acceptance_rate"],
                        "tokens_per_pass": r["mean_accepted_tokens"], "accuracy_only": r["accuracy_only"]})
    return out


def _peer_row(peer, name: str, runs, reference: list, manifest: dict) -> dict:
    """A peer's decode-time tokens/s, and how often its whole output equals our fp32 vanilla output."""
    eos = set(manifest["special_tokens"]["eos_token_ids"] or [])
    same = [_same_output(g.tokens, reference[i], eos) for i, g in runs]
    gens = [g for _, g in runs]
    tokens = sum(max(len(g.tokens) - 1, 0) for g in gens)
    seconds = sum(g.total_s - g.ttft_s for g in gens)
    return {"peer": name, "precision": peer.spec.precision, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "ttft_ms": statistics.median(g.ttft_s * 1e3 for g in gens) if gens else None,
            "same_tokens_as_fp32_vanilla": sum(same) / len(same) if same else None, "runs": len(gens)}


def _same_output(got: list[int], ref: list[int] | None, eos: set) -> bool:
    """Whole outputs equal (a trailing EOS aside, which some peers drop); an empty output never is."""
    if not got or ref is None:
        return False
    strip = lambda ids: ids[:-1] if ids and ids[-1] in eos else ids      # noqa: E731
    return strip(list(got)) == strip(list(ref))


def _memory(manifest, pipes, peers) -> dict:
    weights = {f"{role}/{p}": e["size_bytes"] for role, m in (*manifest["models"].items(),
                                                              *manifest.get("heads", {}).items())
               for p, e in m["precisions"].items()}
    kv = {f"{tp}/{dp}": p.target.kv_bytes + d.kv_bytes for tp, p in pipes.items() for dp, d in p.drafts.items()}
    kv.update({f"{tp}/-": p.target.kv_bytes for tp, p in pipes.items()})
    return {"weights_bytes": weights, "kv_buffer_bytes": kv,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_rss_note": "the bench process: every configuration's sessions; peers are apart",
            "peers_peak_rss_bytes": {f"{p.spec.family} {p.spec.precision}": p.peak_rss_bytes for p in peers}}


def _ms(costs: dict) -> dict:
    return {role: {str(t): v * 1e3 for t, v in table.items()} for role, table in costs.items()}


def _write_report(report: dict, out_dir: Path, plots: bool, log) -> None:
    from specexport.report.render import plot_speedups, render_markdown

    report["plots"] = plot_speedups(report, out_dir, log) if plots else []
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    write_json_atomic(out_dir / "report.json", report)
    record_report_files(out_dir, REPORT_FILES)


def quick_bench(output_dir: Path, *, max_verify_tokens: int, log=print) -> dict:
    """The short report `specexport build` ends with: every built CPU precision, vanilla and γ = 1..6,
    one round of the default prompts, 32 tokens; no peers, no plots. Its report goes to bench/quick/,
    so a full `specexport bench` report in bench/ survives a rebuild; its γ choice is stored unless a
    fuller bench stored one for the same graphs."""
    gammas = tuple(range(1, min(6, max_verify_tokens - 1) + 1))
    built = read_manifest(Path(output_dir))["models"]["target"]["precisions"]
    # a latency report: GPU precisions (accuracy only on this CPU path, and slow to emulate) are left to
    # `specexport bench --precisions ...`
    cfg = BenchConfig(output_dir=Path(output_dir), prompts=DEFAULT_PROMPTS, gammas=gammas, max_new_tokens=32,
                      rounds=1, peers=False, plots=False, out=Path(output_dir) / "bench" / "quick",
                      precisions=tuple(p for p in built if p not in GPU_PRECISIONS))
    return run_bench(cfg, log=log)


def short_table(report: dict) -> list[tuple]:
    """(target, draft, method, γ, tok/s, acceptance, speedup) rows: vanilla and the best γ per precision
    (accuracy-only rows: the most tokens per pass; their tok/s and speedup are None)."""
    best = {}
    score = lambda r: (r["mean_accepted_tokens"] if r["accuracy_only"] else r["speedup_vs_vanilla"]) or 0  # noqa: E731
    for r in report["rows"]:
        key = (r["precision"], r["draft_precision"], r["method"])
        if key not in best or score(r) > score(best[key]):
            best[key] = r
    return [(r["precision"], r["draft_precision"] or "-", r["method"], r["gamma"] or "-", r["tokens_per_s"],
             r["acceptance_rate"], r["speedup_vs_vanilla"]) for r in best.values()]
