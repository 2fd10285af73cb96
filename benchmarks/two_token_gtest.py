"""The two-token G-test that check_reduced_vocab.py and check_eagle.py run on a build: sampled output's
first two tokens (x1 from the prefill, x2 from the first speculative round) against the exact joint
p(x1) p(x2 | x1) of the fp32 target graph.

Cells: every (x1, x2) pair with an expected count >= 5, an "other x2" cell per such x1, and one "other"
cell for the rest. The prompt is the one (of the first 8) where the target puts the most mass outside
`in_vocab` (the draft's or head's vocabulary), so the residual path is exercised.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from specexport.quant.quality import runtime_session
from specexport.io_spec import ModelIO
from specexport.manifest import stage_dir


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@dataclass
class TwoTokenTest:
    prompt_index: int
    prompt: list
    p1: np.ndarray                 # [V] exact p(x1)
    cond: dict                     # x1 -> [V] exact p(x2 | x1), for the x1 with a cell
    cells: dict                    # (x1, x2) or (x1, None) -> cell index
    expected: np.ndarray           # [cells] expected counts for `samples` draws (the last cell: "other")

    def cell(self, x, y) -> int:
        return self.cells.get((x, y), self.cells.get((x, None), len(self.expected) - 1))

    def g_test(self, observed: np.ndarray) -> tuple[float, float, int]:
        """(G, p, degrees of freedom) of the observed counts per cell."""
        keep = self.expected > 0
        g, p = sps.power_divergence(observed[keep], self.expected[keep] * observed.sum() / self.expected[keep].sum(),
                                    lambda_="log-likelihood")
        return float(g), float(p), int(keep.sum() - 1)


def collect(test: TwoTokenTest, generate, samples: int, each=None) -> tuple[np.ndarray, int, int]:
    """(observed counts per cell, accepted, proposed) of `samples` draws: generate(s) -> a generation of
    at least 2 tokens whose second token came through speculation (its first round proposed, else this
    stops: the test would be of vanilla sampling); each(x1, x2) sees every draw."""
    observed = np.zeros(len(test.expected))
    accepted = proposed = 0
    for s in range(samples):
        out = generate(s)
        x, y = out.token_ids[:2]
        if out.stats.proposed == 0:
            raise SystemExit(f"sample {s}: no proposal was made, so x2 did not go through speculation")
        observed[test.cell(x, y)] += 1
        if each is not None:
            each(x, y)
        accepted, proposed = accepted + out.stats.accepted, proposed + out.stats.proposed
    return observed, accepted, proposed


def prepare(build, manifest, prompts, in_vocab, samples: int) -> TwoTokenTest:
    io = ModelIO.from_dict(manifest["models"]["target"]["io"])
    session = runtime_session(stage_dir(build, manifest, "target", "fp32") / "model.onnx")

    def next_dist(ids):
        return softmax(session.run(["logits"], io.feeds(np.asarray(ids, np.int64)[None]))[0][0, -1].astype(np.float64))

    first = [next_dist(p) for p in prompts[:8]]
    k = int(np.argmax([d[~in_vocab].sum() for d in first]))
    prompt, p1 = prompts[k], first[k]
    tops = [int(x) for x in np.argsort(-p1) if samples * p1[x] >= 5]
    cond = {x: next_dist([*prompt, x]) for x in tops}
    cells, expected = {}, []
    for x in tops:
        covered = 0.0
        for y in np.argsort(-cond[x]):
            if samples * p1[x] * cond[x][y] < 5:
                break
            cells[(x, int(y))] = len(expected)
            expected.append(p1[x] * cond[x][y])
            covered += expected[-1]
        cells[(x, None)] = len(expected)
        expected.append(p1[x] - covered)
    expected.append(1 - sum(expected))                          # "other"
    return TwoTokenTest(k, prompt, p1, cond, cells, np.maximum(np.array(expected), 0) * samples)
