"""TensorRT engines: built from the in-place engine graph (trt/graph.py), checked after the build.

    engine_stage(folder, ...)                           what `specexport build` runs for backends: [tensorrt]
      1. engine.onnx = the precision's model.onnx with attention rewritten and KV updated in place
         (trt_graph.write_engine_graph; option `attention`: "native" TRT_Attention, or "plugin" tree attention)
      2. the same rewrite of the fp32 graph, checked on CPU against the fp32 graph (reference ops in ORT)
      3. model.plan = build_engine(engine.onnx): two optimisation profiles from the tensor table, strongly
         typed (precision is the graph's), written atomically
      4. self-check on the GPU: the engine (runtime/backends/trt.py) against the fp32 graph in ONNX Runtime
         on golden cases (prefill, decode steps, a tree), then greedy prompt lookup == greedy vanilla on it
      -> the manifest entry, or ParityError

UNVERIFIED: TensorRT cannot be installed on the machines this was written on. Every TensorRT call is
written against TensorRT 11's Python API as its sources state it (NVIDIA/TensorRT 11.1: python/src/infer/
pyCore.cpp, python/src/parsers/pyOnnx.cpp, include/NvInfer.h) and exercised here only with a fake
`tensorrt` module (tests/test_trt_engine.py); what feeds it (the engine graph, the profiles, the
self-check's drivers) is tested on CPU. Functions that call TensorRT say UNVERIFIED.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specexport import _tensorrt
from specexport._optional import loaded, require
from specexport.errors import ParityError, SpecexportError
from specexport.io_spec import ModelIO
from specexport.runtime.backends.trt import ENGINE_FILE      # the engine's file name beside engine.onnx

PREFILL_OPT = 64            # the prefill profile's optimum chunk (the runtime prefills in chunks of PREFILL_CHUNK)
VERIFY_OPT = 5              # the decode/verify profile's optimum: a γ = 4 chain
PROFILE_NAMES = ("prefill", "decode_verify")      # the engine's profile indices 0 and 1

# The self-check's gate against the fp32 graph in ONNX Runtime: relative logit error (max|Δ| / max|logit|
# over every compared row; None: not gated) and top-1 agreement. TensorRT computes fp32 with TF32 unless
# told otherwise (BuilderFlag.TF32 is on by default), hence fp32's 1e-2. UNVERIFIED: no engine has run.
ENGINE_GATES = {
    "fp32": {"max_rel_error": 1e-2, "min_top1": 0.98},
    "fp16": {"max_rel_error": 5e-2, "min_top1": 0.95},
    "fp8": {"max_rel_error": None, "min_top1": 0.5},
    "int8_sq": {"max_rel_error": None, "min_top1": 0.5},
}


def kv_capacity_for(max_seq_len: int, min_tokens: int = 1) -> int:
    """Rows of the engine's KV caches: max_seq_len, plus room for the padding rows of a call padded to
    min_tokens (ModelBuffers.run pads a call and writes them past the committed rows)."""
    return int(max_seq_len) + max(1, int(min_tokens)) - 1


# -- optimisation profiles ---------------------------------------------------------------------------

def profiles(io: ModelIO, *, max_seq_len: int, prefill_tokens: int, verify_tokens: int,
             kv_capacity: int | None = None) -> dict[str, dict]:
    """{"prefill": {input: (min, opt, max)}, "decode_verify": {...}} for every graph input, from the tensor
    table's axes: tokens T, rows R <= T, total = P + T.

    kv_capacity given (the engine graph): the caches are [1, Hkv, kv_capacity, D] at every shape and
    total runs 1..kv_capacity. Example: kv_capacity 128, verify_tokens 16 -> decode_verify
    attention_mask (1, 1, 1) .. (1, 16, 128), past_key.0 (1, Hkv, 128, D) at min, opt and max.
    kv_capacity None (the plain-run plugin graph trt.onnx): the caches' capacity axis is the past P,
    0 at the first call, and total = P + T <= max_seq_len."""
    def sizes(t: int, total: int, r: int, capacity: int) -> dict:
        return {"batch": 1, "tokens": t, "rows": r, "capacity": capacity, "total": total}

    out = {}
    for name, top, opt_t, opt_r in (("prefill", prefill_tokens, min(PREFILL_OPT, prefill_tokens), 1),
                                    ("decode_verify", verify_tokens, min(VERIFY_OPT, verify_tokens),
                                     min(VERIFY_OPT, verify_tokens))):
        if kv_capacity is None:
            if top > max_seq_len:
                raise SpecexportError(f"{name} profile: {top} tokens exceed max_seq_len {max_seq_len}")
            lo, opt, hi = sizes(1, 1, 1, 0), sizes(opt_t, max_seq_len // 2 + opt_t, opt_r, max_seq_len // 2), \
                sizes(top, max_seq_len, top, max_seq_len - 1)
        else:
            if top > kv_capacity:
                raise SpecexportError(f"{name} profile: {top} tokens exceed the KV capacity {kv_capacity}")
            c = kv_capacity
            lo, opt, hi = sizes(1, 1, 1, c), sizes(opt_t, max(opt_t, c // 2), opt_r, c), sizes(top, c, top, c)
        out[name] = {t.name: (t.shape(**lo), t.shape(**opt), t.shape(**hi)) for t in io.inputs}
    return out


# -- building ----------------------------------------------------------------------------------------

def build_engine(graph: Path, dest: Path, io: ModelIO, *, max_seq_len: int, prefill_tokens: int, verify_tokens: int,
                 kv_capacity: int | None = None, attention: str = "plugin", workspace_gib: float = 4.0) -> dict:
    """Build `dest` (a serialized engine) from `graph`; returns its manifest entry. UNVERIFIED.

    graph: the engine graph (trt_graph.py; pass its kv_capacity) or the plain-run plugin graph trt.onnx
    (kv_capacity None). attention: "plugin" registers the tree-attention plugin before parsing (the
    graph has plugin nodes), "native" does not. Order of the calls (TensorRT 11, pyCore.cpp/pyOnnx.cpp):
    Logger -> Builder -> create_network(0) (every network is strongly typed in 11: no precision flags)
    -> OnnxParser(network, logger).parse_from_file -> create_builder_config -> set_memory_pool_limit
    -> one create_optimization_profile / set_shape... / add_optimization_profile per profile (prefill is
    index 0, decode_verify 1) -> build_serialized_network -> the bytes to `dest`.partial, renamed."""
    from specexport.plugins import trt_plugin

    graph, dest = Path(graph), Path(dest)
    trt = _tensorrt.require_tensorrt(f"engine {dest.name}")
    if attention not in ("native", "plugin"):
        raise SpecexportError(f"attention: expected native or plugin, got {attention!r}")
    shapes = profiles(io, max_seq_len=max_seq_len, prefill_tokens=prefill_tokens, verify_tokens=verify_tokens,
                      kv_capacity=kv_capacity)
    plugin = trt_plugin.register() if attention == "plugin" else None      # before the parser meets its nodes
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SpecexportError(f"{graph}: TensorRT's ONNX parser refused it: {errors[:500]}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    for ranges in shapes.values():                   # dict order: PROFILE_NAMES
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in ranges.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SpecexportError(f"{graph}: TensorRT could not build an engine (its log above says why)")
    _write_atomically(dest, serialized)
    return {"file": dest.name, "made_from": graph.name, "attention": attention, "kv_capacity": kv_capacity,
            "tensorrt": trt.__version__, "cuda": _cuda_version(), "arch": _tensorrt.gpu_arch(),
            "plugin": _plugin_record(plugin), "strongly_typed": True,
            "profiles": {k: {n: [list(s) for s in v] for n, v in r.items()} for k, r in shapes.items()},
            "build_seconds": round(time.perf_counter() - start, 2)}


def _write_atomically(dest: Path, data) -> None:
    """`data` (bytes, or TensorRT's IHostMemory: a buffer, written without a copy) under `dest`.partial,
    then renamed: never a half-written engine under the final name."""
    partial = dest.with_name(dest.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(data)
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)


def _plugin_record(plugin_id: str | None) -> dict | None:
    if plugin_id is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton = version("triton")
    except PackageNotFoundError:
        triton = None
    return {"id": plugin_id, "kernel": "specexport.plugins.tree_attention (Triton, ahead of time)", "triton": triton}


def _cuda_version() -> str | None:
    torch = loaded("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    return torch.version.cuda


# -- the build stage ---------------------------------------------------------------------------------

def engine_stage(folder: Path, *, io: ModelIO, precision: str, fp32_graph: Path, max_seq_len: int,
                 max_verify_tokens: int, attention: str = "native", min_tokens: int = 1,
                 parity_tolerance: float = 1e-4, gate: dict | None = None, prompts=None, seeds=(0, 1),
                 device: str = "cuda", workspace_gib: float = 4.0, log=None) -> dict:
    """Build and check the TensorRT engine of one precision's graph; returns its manifest entry. UNVERIFIED.

    folder: the precision's stage folder, holding its model.onnx (+ weights); engine.onnx and model.plan
        are written there (entry["files"] names them: add them to the stage's files).
    io: the model's tensor table; precision: "fp32", "fp16", "fp8", "int8_sq" (picks the gate).
    fp32_graph: the model's fp32 model.onnx: the rewrite check's source and the self-check's reference.
    max_seq_len, max_verify_tokens: the build's; the prefill profile runs to max(64, max_verify_tokens)
        tokens (the runtime's PREFILL_CHUNK), decode/verify to max_verify_tokens.
    attention: "native" (TRT_Attention, no plugin) or "plugin" (the tree-attention plugin).
    min_tokens: the stage's min_tokens (the runtime pads smaller calls): the caches get that much room.
    parity_tolerance: the rewrite check's (fp32 on CPU, exact up to float rounding).
    gate: {"max_rel_error": float | None, "min_top1": float} against fp32 (default ENGINE_GATES[precision]).
    prompts: token-id lists for the speculative check (default: each golden case's prompt, repeated once
        so prompt lookup finds matches); seeds: the golden cases (validate.parity_case).
    device: "cuda" / "cuda:N" (a fake tensorrt in tests drives "cpu"); log: a callable for progress lines.
    Raises SpecexportError naming TensorRT in one line where it is absent (before writing anything), and
    ParityError when the rewrite check or the self-check fails."""
    from specexport._tensorrt import require_engines
    from specexport.trt.graph import ENGINE_GRAPH, KV_UPDATE_OP, write_engine_graph

    folder = Path(folder)
    require_engines(f"{precision} engine")
    log = log or (lambda message: None)
    gate = dict(ENGINE_GATES.get(precision, ENGINE_GATES["fp16"]) if gate is None else gate)
    kv_capacity = kv_capacity_for(max_seq_len, min_tokens)
    prefill_tokens = max(PREFILL_OPT, max_verify_tokens)
    start = time.perf_counter()
    log(f"write the {precision} engine graph ({attention} attention, KV capacity {kv_capacity})")
    write_engine_graph(folder / "model.onnx", folder / ENGINE_GRAPH, head_dim=io.head_dim, kv_capacity=kv_capacity,
                       attention=attention)
    rewrite = check_rewrite(fp32_graph, io, kv_capacity=kv_capacity, attention=attention, max_seq_len=max_seq_len,
                            max_verify_tokens=max_verify_tokens)
    if not rewrite <= parity_tolerance:
        raise ParityError(f"{precision} engine graph: the in-place rewrite of the fp32 graph disagrees with it on "
                          f"CPU: relative {rewrite:.2e} > parity_tolerance {parity_tolerance:.1e}")
    log(f"build the {precision} TensorRT engine")
    entry = build_engine(folder / ENGINE_GRAPH, folder / ENGINE_FILE, io, max_seq_len=max_seq_len,
                         prefill_tokens=prefill_tokens, verify_tokens=max_verify_tokens, kv_capacity=kv_capacity,
                         attention=attention, workspace_gib=workspace_gib)
    log(f"self-check the {precision} engine against fp32 in ONNX Runtime")
    check = selfcheck(folder, io=io, fp32_graph=fp32_graph, max_seq_len=max_seq_len,
                      max_verify_tokens=max_verify_tokens, attention=attention, min_tokens=min_tokens, gate=gate,
                      prompts=prompts, seeds=seeds, device=device)
    failures = check.pop("failures")
    if failures:
        raise ParityError(f"{precision} engine: self-check failed: {'; '.join(failures)}")
    return {**entry, "graph": ENGINE_GRAPH, "made_from": "model.onnx", "files": [ENGINE_GRAPH, ENGINE_FILE],
            "kv_update": f"{KV_UPDATE_OP} (in place)", "min_tokens": int(min_tokens),
            "rewrite_check_fp32_max_rel_error": rewrite, "selfcheck": check,
            "stage_seconds": round(time.perf_counter() - start, 2)}


def check_rewrite(fp32_graph: Path, io: ModelIO, *, kv_capacity: int, attention: str, max_seq_len: int,
                  max_verify_tokens: int, seed: int = 0) -> float:
    """The engine rewrite of the fp32 graph, run on CPU with the reference ops, against the fp32 graph in
    ONNX Runtime on the parity gate's phases: the max relative logit error (float rounding: ~1e-7)."""
    from specexport.trt.graph import cpu_session, engine_graph, engine_graph_logits
    from specexport.export.validate import compare, onnx_logits, parity_case

    onnx = require("onnx")
    case = parity_case(io, max_seq_len=max_seq_len, max_verify_tokens=max_verify_tokens, seed=seed)
    rewritten = engine_graph(onnx.load(str(fp32_graph)), head_dim=io.head_dim, kv_capacity=kv_capacity,
                             attention=attention)
    got = engine_graph_logits(cpu_session(rewritten), io, case, kv_capacity=kv_capacity)
    return compare(onnx_logits(fp32_graph, io, case), got).max_rel_error


def selfcheck(folder: Path, *, io: ModelIO, fp32_graph: Path, max_seq_len: int, max_verify_tokens: int,
              attention: str, min_tokens: int, gate: dict, prompts=None, seeds=(0, 1), device: str = "cuda",
              max_new_tokens: int = 24) -> dict:
    """The engine in `folder` through the TensorRT backend: its logits against the fp32 graph in ONNX
    Runtime on golden cases; a tree commit that moves KV rows on the device against the same tokens run
    as a chain (tree_commit_error); greedy speculative (prompt lookup, 2 branches: chains and tries)
    against greedy vanilla on the engine, token for token.
    Returns the measurements and "failures" (empty when it passed). UNVERIFIED (the backend is)."""
    from specexport.quant.quality import runtime_session
    from specexport.export.validate import compare, onnx_logits, parity_case
    from specexport.runtime.backends.trt import open_trt_backend
    from specexport.runtime.loop import DecodeStats, decode
    from specexport.runtime.proposers.lookup import PromptLookup
    from specexport.runtime.sampling import SamplingParams

    reference = runtime_session(fp32_graph)
    cases = [parity_case(io, max_seq_len=max_seq_len, max_verify_tokens=max_verify_tokens, seed=s) for s in seeds]
    failures, agree, worst, per_phase = [], [], 0.0, {}
    backend = open_trt_backend(folder, io=io, capacity=max_seq_len, max_tokens=max(PREFILL_OPT, max_verify_tokens),
                               engine=ENGINE_FILE, attention=attention, min_tokens=min_tokens, device=device)
    with backend:
        for case in cases:
            ref = onnx_logits(fp32_graph, io, case, session=reference)
            got = backend_logits(backend, case)
            report = compare(ref, got)
            worst = max(worst, report.max_rel_error)
            for k, v in report.per_phase.items():
                per_phase[k] = max(per_phase.get(k, 0.0), v)
            agree += [ref[k].argmax(-1) == got[k].argmax(-1) for k in ref]
        top1 = float(np.mean(np.concatenate(agree)))
        if gate.get("max_rel_error") is not None and not worst <= gate["max_rel_error"]:
            failures.append(f"logits against fp32: relative {worst:.2e} > {gate['max_rel_error']:.1e} "
                            f"({', '.join(f'{k} {v:.1e}' for k, v in per_phase.items())})")
        if not top1 >= gate["min_top1"]:
            failures.append(f"top-1 agreement with fp32 {top1:.3f} < {gate['min_top1']}")
        moved = tree_commit_error(backend, cases[0]) if max_verify_tokens >= 4 else None
        if moved is not None and not moved <= TREE_COMMIT_TOLERANCE:
            failures.append(f"tree commit: the next token's logits after committing a tree path (KV rows moved on "
                            f"the device) differ from the same tokens run as a chain by {moved:.2e} relative "
                            f"(> {TREE_COMMIT_TOLERANCE:.0e})")
        greedy, lookup = SamplingParams(), PromptLookup(min(4, max_verify_tokens - 1), branches=2,
                                                        max_nodes=max_verify_tokens - 1)
        if prompts is None:
            prompts = [np.concatenate([c.seq[:c.n_prompt]] * 2) for c in cases]
        runs = []
        for prompt in prompts:
            prompt = np.asarray(prompt, np.int64)
            n_new = max(1, min(max_new_tokens, max_seq_len - len(prompt) - 1))
            tokens, stats = {}, {}
            for name, proposer in (("vanilla", None), ("lookup", lookup)):
                stats[name] = DecodeStats()
                tokens[name] = np.concatenate(list(decode(backend, proposer, prompt, max_new_tokens=n_new,
                                                          params=greedy, rng=np.random.default_rng(0),
                                                          stats=stats[name]))).tolist()
            runs.append({"prompt_tokens": len(prompt), "new_tokens": n_new, "proposed": stats["lookup"].proposed,
                         "accepted": stats["lookup"].accepted, "equal": tokens["vanilla"] == tokens["lookup"]})
            if tokens["vanilla"] != tokens["lookup"]:
                at = next(i for i, (a, b) in enumerate(zip(tokens["vanilla"], tokens["lookup"])) if a != b)
                failures.append(f"greedy prompt lookup differs from greedy vanilla on the engine at new token {at} "
                                f"(prompt of {len(prompt)} tokens)")
    return {"reference": "fp32 graph in ONNX Runtime (CPU)", "cases": len(cases), "max_rel_error": worst,
            "per_phase": per_phase, "top1_agreement": top1, "gate": gate, "tree_commit_rel_error": moved,
            "speculative": runs, "failures": failures}


TREE_COMMIT_TOLERANCE = 1e-2      # one engine against itself: only kernel choices by T differ


def tree_commit_error(backend, case) -> float:
    """Relative logit difference, on one backend, between (a) a tree of 4 nodes committed along the path
    0 -> 2 -> 3 (not a prefix of the tree's rows: the commit moves KV rows, Backend._move_rows) and then
    one more token, and (b) the same tokens run as a plain chain. A broken row move shows as a large
    difference whatever the precision (both sides run on the same engine).

    Example: prompt p (n tokens), tree tokens [a, b, c, d] with parents [-1, 0, 0, 2]: (a) commits a, c, d
    at positions n, n+1, n+2; (b) runs p + [a, c, d] as a chain; both then feed token e at n + 3."""
    from specexport.export.validate import ancestor_mask

    n, vocab = case.n_prompt, backend.vocab_size
    parents = np.array([-1, 0, 0, 2])
    mask = ancestor_mask(parents)
    path = np.flatnonzero(mask[-1])                                  # [0, 2, 3]
    tree = (case.seq[:4] + 1) % vocab
    nxt = np.array([(int(case.seq[0]) + 2) % vocab])
    backend.reset()
    backend.forward(case.seq[:n])
    backend.commit(n)
    backend.forward(tree, depths=mask.sum(1) - 1, tree_mask=mask)
    backend.commit(path)
    moved = np.array(backend.forward(nxt).logits[0])
    backend.reset()
    chain = np.concatenate([case.seq[:n], tree[path]])
    backend.forward(chain)
    backend.commit(len(chain))
    straight = np.array(backend.forward(nxt).logits[0])
    backend.reset()
    return float(np.abs(moved - straight).max() / max(np.abs(straight).max(), 1e-30))


def backend_logits(backend, case) -> dict:
    """The parity gate's phases (validate.onnx_logits) through a runtime Backend (base.py): a prefill asking
    for its last row only, the prompt with every row, decode steps committed one at a time, a tree at
    positions context + depth under its ancestor mask. {phase: logits [rows, V]} (copies)."""
    from specexport.export.validate import ancestor_mask

    n, seq = case.n_prompt, case.seq
    backend.reset()
    out = {"prefill_last": np.array(backend.forward(seq[:n], phase="prefill").logits[-1:])}
    backend.rollback(0)
    out["prefill"] = np.array(backend.forward(seq[:n]).logits)
    backend.commit(n)
    rows = []
    for s in range(n, case.context):
        rows.append(np.array(backend.forward(seq[s:s + 1]).logits[0]))
        backend.commit(1)
    out["decode"] = np.stack(rows)
    if len(case.parents):
        mask = ancestor_mask(case.parents)
        out["tree"] = np.array(backend.forward(seq[case.context:], depths=mask.sum(1) - 1, tree_mask=mask).logits)
    backend.reset()
    return out
