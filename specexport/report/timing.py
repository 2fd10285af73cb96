"""Timed runs and forward costs: one generation of a configuration (`_run`) on pipelines whose
every time comes from the bench's clock (`_clocked`), the fp32 vanilla outputs the peers are checked
against, the timings of what proposes in a row, and the isolated cost of one forward per size (for the
γ prediction beyond the sizes the runs made). Times are seconds; `_ms` turns cost tables into ms.
"""
from __future__ import annotations

import statistics

import numpy as np

from specexport.report import accounting as acc
from specexport.report.grid import Config
from specexport.runtime.methods import HEAD_METHODS


def clocked(pipe, clock):
    pipe.clock = pipe.target.clock = clock
    return pipe


def encode_prompt(pipe, prompt: str, chat: bool) -> list[int]:
    return pipe.chat_ids(prompt) if chat else pipe.encode(prompt)


def run_config(pipes, c: Config, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
         cache=None):
    """One generation; sampled (temperature > 0) with the same seed for every configuration of a cell.
    cache: a suffix row's SuffixCache (a workload's: it reads and stores through it); without one a
    suffix row uses the request's own text only, and no row ever stores into the pipeline's cache (the
    prompts repeat every round: a shared cache would answer from the previous round)."""
    pipe = pipes[c.precision]
    if c.draft_precision is not None:
        pipe.use_draft_precision(c.draft_precision)
    if cache is not None:
        pipe.suffix_cache = cache
    timed = {"target": pipe.target.timings, "draft": _proposer_timings(pipe, c.proposer)}
    before = {role: {k: len(v) for k, v in t.items()} for role, t in timed.items() if t is not None}
    stats = pipe.generate(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, method=c.method, gamma=max(c.gamma, 1),
                          draft_stop=c.draft_stop, tree=c.tree, temperature=temperature, seed=seed,
                          suffix_share=cache is not None).stats
    # this run's own decode-time forwards, {role: {T: [seconds]}}: a row's ideal is priced with its own
    # forwards (accounting.row_costs), not the mean over every row of the session
    stats.forward_seconds = {role: {k[1]: v[before[role].get(k, 0):] for k, v in timed[role].items()
                                    if k[0] == "decode" and len(v) > before[role].get(k, 0)} for role in before}
    return stats


def reference_outputs(cfg, pipes, prompt_ids: dict, *, precision: str = "fp32") -> list[list[int]]:
    """Our vanilla output per prompt on the target of `precision`: what a peer row's "same tokens" is checked
    against (fp32 for peers on the checkpoints, gguf for llama.cpp on the GGUF file)."""
    import specexport

    pipe = pipes.get(precision) or specexport.load(cfg.output_dir, precision=precision)
    try:
        return [pipe.generate(prompt_ids=prompt_ids[p], max_new_tokens=cfg.max_new_tokens, method="vanilla",
                              suffix_share=False).token_ids for p in cfg.prompts]
    finally:
        if pipe is not pipes.get(precision):
            pipe.close()


def _proposer_timings(pipe, key) -> dict | None:
    """Timings of what proposes in rows whose Config.proposer is `key`: a draft precision, "medusa" or
    "eagle" (their heads), None for rows that make no proposer forwards (vanilla, lookup)."""
    model = pipe.opened_heads.get(key) if key in HEAD_METHODS else pipe.drafts[key] if key else None
    return model.timings if model is not None else None


def step_costs(configs, pipes) -> dict:
    """Per (target precision, Config.proposer): the decode costs of the timed runs' forwards."""
    # "draft" prices every forward that is not the target's: the draft model's, or the Medusa / EAGLE
    # heads' (keyed by Config.proposer; lookup rows make none)
    return {(tp, key): {"target": acc.decode_costs(pipes[tp].target.timings),
                        "draft": acc.decode_costs(_proposer_timings(pipes[tp], key))}
            for tp, key in {(c.precision, c.proposer) for c in configs}}


def isolated_costs(pipe, dp, max_t: int, *, clock, reps: int = 20) -> dict:
    """Median seconds of one forward at a context of 64 tokens (fewer when max_seq_len is small),
    target for T = 1..max_t, draft T = 1: for the γ prediction beyond the sizes the runs made."""
    if dp is not None:
        pipe.use_draft_precision(dp)
    ctx = _context(pipe, max_t)
    target = {t: [] for t in range(1, max_t + 1)}
    draft = []
    for _ in range(reps):
        for t in target:
            target[t].append(_time_forward(pipe.target, ctx, t, clock=clock))
        if dp is not None:
            draft.append(_time_forward(pipe.draft, ctx, 1, clock=clock))
    return {"target": {t: statistics.median(v) for t, v in target.items()},
            "draft": {1: statistics.median(draft)} if draft else {}}


def _context(pipe, rows: int) -> np.ndarray:
    """The timed forwards' context: 64 tokens (fewer when max_seq_len leaves no room for `rows` more)."""
    return (3 + np.arange(max(1, min(64, pipe.capacity - rows)))) % pipe.target.vocab_size


PASS_ROWS = (1, 2, 4, 8, 16)


def pass_curve(pipe, clock, reps: int = 7) -> dict:
    """A target pass by its rows, c(M): median seconds of M-row forwards (M in PASS_ROWS up to the graph's
    max_tokens) after one 64-token prefill, the sizes interleaved per repetition so drift hits them alike;
    nothing committed, so every pass sees the same context. {M: seconds}."""
    backend = pipe.target
    sizes = [m for m in PASS_ROWS if m <= backend.max_tokens]
    ctx = _context(pipe, sizes[-1])
    backend.reset()
    backend.forward(ctx, phase="prefill")
    backend.commit(len(ctx))
    times = {m: [] for m in sizes}
    for _ in range(reps):
        for m in sizes:
            start = clock()
            backend.forward(ctx[:m])
            times[m].append(clock() - start)
    backend.reset()
    return {m: statistics.median(v) for m, v in times.items()}


def _time_forward(backend, ctx, t: int, *, clock) -> float:
    backend.reset()
    backend.forward(ctx, phase="prefill")
    backend.commit(len(ctx))
    start = clock()
    backend.forward(ctx[:t])
    return clock() - start


def to_ms(costs: dict) -> dict:
    return {role: {str(t): v * 1e3 for t, v in table.items()} for role, table in costs.items()}
