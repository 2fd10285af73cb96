"""How much a draft-free round proposes when what a verify pass costs by its rows is known: the pass
curve c(M) `specexport bench` measured on this CPU (stored with the build, gamma.py's "pass_curve").

A round that verifies its first n proposed nodes emits E(n) tokens in expectation (E(0) = 1: the
target's own token) and costs c(n + 1); the round's speed against vanilla is E(n) c(1) / c(n + 1), so
the budget is the n that maximizes E(n) / c(n + 1). Where c(M) is flat (AMX: a 16-row pass for little
more than a step) the whole tree is worth verifying; where it is steep (AVX2: 5x a step at 16 rows)
only the likely nodes are. Pure numpy; the proposers (suffix, lookup) call it per round.

    costs = relative_costs({1: 37.4, 2: 41.7, 4: 52.4, 8: 69.8, 16: 117.8}, width=16)
    n = best_nodes(1 + np.cumsum([0.0, 0.9, 0.8, 0.3, 0.1]), costs)    # -> 2 (E(2) 2.7 / c(3) 1.26)
"""
from __future__ import annotations

import numpy as np


def relative_costs(curve_ms: dict, width: int) -> np.ndarray:
    """[width + 1] float: index T = c(T) / c(1) for T = 1..width (index 0 unused, 0.0), interpolated
    linearly between the measured M (keys: ints or their strings) and beyond the last by its last slope."""
    pts = sorted((int(m), float(v)) for m, v in curve_ms.items())
    if not pts or pts[0][0] != 1 or any(v <= 0 for _, v in pts):
        raise ValueError(f"pass curve: expected positive times with M = 1 among them, got {curve_ms!r}")
    ms, vs = np.array([m for m, _ in pts], float), np.array([v for _, v in pts], float)
    t = np.arange(1, width + 1, dtype=float)
    out = np.interp(t, ms, vs)
    if len(ms) > 1:                                   # past the last measured M: its last slope
        slope = (vs[-1] - vs[-2]) / (ms[-1] - ms[-2])
        out = np.where(t > ms[-1], vs[-1] + slope * (t - ms[-1]), out)
    return np.concatenate([[0.0], out / vs[0]])


def best_nodes(expected: np.ndarray, costs: np.ndarray) -> int:
    """The n (0..len(expected) - 1, and at most len(costs) - 2) maximizing expected[n] / costs[n + 1]:
    expected[n] the tokens a round emits verifying its first n nodes (expected[0] = 1), costs as
    relative_costs gives them. Ties go to the smaller tree."""
    n = min(len(expected), len(costs) - 1)
    return int(np.argmax(np.asarray(expected[:n], float) / costs[1:n + 1]))


class DepthAcceptance:
    """Per depth d (1-based) of a chain's proposals, the share of rounds that reached d whose token at d
    was accepted, counted over this generation's rounds: what a proposer without probabilities of its own
    (prompt lookup) expects of its next chain. Each depth's rate is shrunk toward the one above it by
    `prior` pseudo-rounds (depth 1 toward `rate`): a depth few rounds reached takes its parent's rate, not
    a fixed guess (a copy that holds at depth 3 mostly holds at 9)."""

    def __init__(self, depth: int, *, rate: float = 0.5, prior: float = 2.0):
        self.rate, self.prior = rate, prior
        self.reached = np.zeros(depth)
        self.accepted = np.zeros(depth)

    def observe(self, proposed: int, accepted: int) -> None:
        """A round proposed a chain of `proposed` tokens and `accepted` of them were accepted."""
        accepted = min(accepted, proposed)
        reached = min(proposed, accepted + 1)           # depths whose token was judged
        self.reached[:reached] += 1
        self.accepted[:accepted] += 1

    def rates(self, depth: int) -> np.ndarray:
        """[depth]: each depth's acceptance rate, shrunk toward the depth above's."""
        out, above = np.empty(depth), self.rate
        for d in range(depth):
            above = out[d] = (self.accepted[d] + self.prior * above) / (self.reached[d] + self.prior)
        return out

    def expected(self, depth: int) -> np.ndarray:
        """[depth + 1]: tokens a round emits in expectation proposing a chain of n = 0..depth tokens."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.rates(depth)))])
