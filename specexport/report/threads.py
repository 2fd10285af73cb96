"""The target's thread settings for a bench: the ones fastest for vanilla decoding on this machine.

Measured here (demo pair, 2-core VM, interleaved processes): ONNX Runtime's default intra-op pool
with spinning decodes vanilla 1.3-1.45x faster than the same pool without spinning or one thread,
and speculative runs gain less from it (1.15-1.3x), so a baseline with spinning off inflates every
speedup (1.9x instead of 1.7x on the demo). The bench therefore tries each candidate for vanilla,
interleaved, and runs every row of that target precision (vanilla and speculative) on one session
with the winner: no speedup comes from a handicapped baseline.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from specexport.errors import SpecexportError


@dataclass(frozen=True)
class ThreadSetting:
    threads: int | None             # intra-op threads; None = the default pool (ort.default_pool)
    spin: bool = True               # idle pool threads spin (ORT's default) or sleep

    @property
    def label(self) -> str:
        from specexport.runtime.backends.ort import default_pool

        count = default_pool() if self.threads is None else str(self.threads)
        return f"threads {count}, spinning {'on' if self.spin else 'off'}" if self.threads != 1 else "threads 1"

    def options(self) -> dict:
        return {"threads": self.threads, "spin": self.spin}


def candidates(cores: int | None = None) -> list[ThreadSetting]:
    """ORT's default pool with and without spinning, then fewer threads (1, 2, 4, ... below the cores)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out = [ThreadSetting(None, True), ThreadSetting(None, False)]
    n = 1
    while n < cores:
        out.append(ThreadSetting(n, True))
        n *= 2
    return out


def fastest_for_vanilla(open_pipeline, precision: str, prompt_of, *, max_new_tokens: int = 32, rounds: int = 2,
                        runs: int = 3, cores: int | None = None, log=print) -> tuple[ThreadSetting, dict]:
    """(winner, {label: median decode tokens/s}) over `candidates()`, each opened in turn, round-robin.
    prompt_of(pipe) -> prompt ids: the bench's first prompt as the bench sends it (a chat model given
    raw text may answer with EOS at once, which times nothing)."""
    speeds: dict[ThreadSetting, list[float]] = {}
    for _ in range(rounds):
        for setting in candidates(cores):
            pipe = open_pipeline(precision=precision, **setting.options())
            try:
                ids = prompt_of(pipe)
                pipe.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method="vanilla")      # warm-up
                for _ in range(runs):
                    out = pipe.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method="vanilla")
                    if len(out.token_ids) > 1:             # one token: no decode time to measure
                        speeds.setdefault(setting, []).append(out.stats.tokens_per_second)
            finally:
                pipe.close()
    if not speeds:
        raise SpecexportError("bench: the first prompt decodes one token and stops (EOS), so the thread settings "
                              "cannot be timed on it: give prompts the model continues (--chat for a chat model)")
    medians = {s: statistics.median(v) for s, v in speeds.items()}
    best = max(medians, key=medians.get)
    log(f"bench: {precision} target: {best.label} is fastest for vanilla "
        f"({', '.join(f'{s.label} {v:.0f}' for s, v in medians.items())} tok/s)")
    return best, {s.label: v for s, v in medians.items()}
