"""The arithmetic of speculative speedup, from measured per-position acceptance and step costs.

With conditional acceptance a_i = P(proposal i accepted | proposals 1..i-1 accepted), a round with γ
proposals emits E(γ) = 1 + Σ_{k=1..γ} Π_{i≤k} a_i tokens (the bonus/recovered token included);
for i.i.d. acceptance α this is (1 - α^(γ+1)) / (1 - α). One round costs γ draft steps plus one
verification of γ + 1 tokens, so against vanilla decoding (one target step per token)

    speedup(γ) = E(γ) · c_target(1) / (γ · c_draft + c_target(γ + 1)).

Worked example: a = [0.8, 0.8], c_draft = 0.1, c_target(1) = 1, c_target(3) = 1.2:
E = 1 + 0.8 + 0.64 = 2.44, speedup = 2.44 / (0.2 + 1.2) = 1.743.

With an adaptive draft length (draft_stop) rounds differ in length, so the ideal is taken from the
counts instead: tokens emitted x c_target(1) / Σ over rounds (j · c_draft + c_target(j + 1)).
"""
from __future__ import annotations

import numpy as np


def expected_tokens(acceptance) -> float:
    """E(γ) for conditional per-position acceptance [γ]."""
    return 1.0 + float(np.cumprod(np.asarray(acceptance, dtype=float)).sum()) if len(acceptance) else 1.0


def predicted_speedup(acceptance, *, c_draft: float, c_target) -> float:
    """acceptance [γ]; c_target: mapping or list with c_target[T] for T = 1..γ+1 (index T)."""
    gamma = len(acceptance)
    return expected_tokens(acceptance) * c_target[1] / (gamma * c_draft + c_target[gamma + 1])


def extend(acceptance, gamma: int) -> np.ndarray:
    """Per-position acceptance for γ positions, repeating the last measured value beyond the data."""
    a = np.asarray(acceptance, dtype=float)
    if len(a) == 0:
        return np.zeros(gamma)
    return np.concatenate([a[:gamma], np.full(max(0, gamma - len(a)), a[-1])])


def choose_gamma(acceptance, *, c_draft: float, c_target, max_gamma: int) -> tuple[int, float]:
    """(γ, predicted speedup) maximizing the prediction over γ = 1..max_gamma; γ = 0 (vanilla, 1.0)
    when no γ beats vanilla. c_target must cover T = 1..max_gamma+1."""
    best = (0, 1.0)
    for g in range(1, max_gamma + 1):
        s = predicted_speedup(extend(acceptance, g), c_draft=c_draft, c_target=c_target)
        if s > best[1]:
            best = (g, s)
    return best


def speedup_from_counts(tokens: int, rounds_by_length: dict[int, int], *, c_draft: float, c_target) -> float:
    """Ideal speedup of decoding that emitted `tokens` in rounds of j proposals each, with
    rounds_by_length {j: rounds} (j = 0: a plain target step): vanilla cost / speculative cost."""
    cost = sum(n * (j * c_draft + c_target[j + 1]) for j, n in rounds_by_length.items())
    return tokens * c_target[1] / cost if cost else 1.0
