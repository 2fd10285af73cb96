"""Drafts over a subset of the target's vocabulary (runtime/backends/vocab.py) are lossless.

Tabular toy models as in test_loop_stats (V = 6, exact continuation probabilities): the draft's
"graph" computes logits only for SUBSET, which leaves out tokens 1 and 4 although the target produces
them; they must still come out at their exact probability (through the rejection residual). Greedy
equals plain greedy. Teeth: ids mapped twice, and a residual renormalised over the subset only, must
fail the same G-tests at p < 1e-6.
"""
from __future__ import annotations

import numpy as np
import pytest

from fakes import (TabularBackend, counts_of, decode_many, exact_continuation_probs, goodness_of_fit, greedy_reference,
                   make_table, perturb_table)
from specexport.errors import SpecexportError
from specexport.runtime import loop
from specexport.runtime.accept import Verdict
from specexport.runtime.backends.base import StepOutput
from specexport.runtime.backends.vocab import ReducedVocab
from specexport.runtime.proposers import DraftChain, DraftTree, Proposal
from specexport.runtime.sampling import SamplingParams, sample

V = 6
SUBSET = np.array([0, 2, 3, 5])                 # 1 and 4 left out
TARGET = make_table(np.random.default_rng(0), V, sharpness=1.5)
DRAFT = perturb_table(np.random.default_rng(1), TARGET, noise=1.0)
ALPHA = 1e-4 / 8
TEETH_P = 1e-6
RUNS = 20_000
TEETH_RUNS = 4_000       # each planted bug gives p < 1e-300 at 3,000 runs already


class SubsetGraph:
    """The tabular draft as a reduced-vocabulary graph would be exported: logits for SUBSET only."""

    def __init__(self, inner, ids):
        self.inner, self.ids, self.vocab_size = inner, np.asarray(ids), len(ids)

    def forward(self, tokens, **kw):
        out = self.inner.forward(tokens, **kw)
        return StepOutput(out.logits[:, self.ids], out.hidden)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class MapsTwice(DraftChain):
    """Planted bug: the proposed ids, already target ids, are mapped again as if they were draft ids
    (ids[t] where t < Vd), while q stays the distribution the original tokens were drawn from."""

    def propose(self, *args, **kwargs):
        proposal = super().propose(*args, **kwargs)
        tokens = proposal.tokens.copy()
        again = tokens[1:] < len(SUBSET)
        tokens[1:][again] = SUBSET[tokens[1:][again]]
        return Proposal(proposal.tree, tokens, proposal.q)


def pair(capacity=64, max_tokens=8):
    target = TabularBackend(TARGET, capacity=capacity, max_tokens=max_tokens)
    draft = ReducedVocab(SubsetGraph(TabularBackend(DRAFT, capacity=capacity, max_tokens=max_tokens), SUBSET),
                         SUBSET, V)
    return target, draft


def fits(tokens, prompt, params) -> dict:
    k = tokens.shape[1]
    exact = exact_continuation_probs(TARGET, prompt, k, params)
    return {"first 3": goodness_of_fit(counts_of(tokens[:, :3], (V,) * 3), exact.sum(tuple(range(3, k)))),
            f"all {k}": goodness_of_fit(counts_of(tokens, (V,) * k), exact)}


CASES = [("T1-g4", [5, 0, 4], SamplingParams(temperature=1.0), 4),
         ("topk3-g3", [1, 4], SamplingParams(temperature=1.0, top_k=3), 3)]


@pytest.mark.parametrize("name,prompt,params,gamma", CASES, ids=[c[0] for c in CASES])
def test_reduced_vocabulary_draft_chain_is_lossless(name, prompt, params, gamma):
    target, draft = pair()
    tokens, proposed, accepted = decode_many(target, DraftChain(draft, gamma), prompt, params, RUNS, max_new=6,
                                             seed=CASES.index((name, prompt, params, gamma)))
    for view, fit in fits(tokens, prompt, params).items():
        assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"{name}, {view}: {fit}"
    assert 0 < accepted < proposed
    assert np.isin(tokens, [1, 4]).any(), "tokens outside the draft's vocabulary never came out"


def test_reduced_vocabulary_draft_tree_is_lossless():
    target, draft = pair()
    params, prompt = SamplingParams(temperature=1.0), [3, 1]
    tokens, proposed, accepted = decode_many(target, DraftTree(draft, [(0,), (1,), (0, 0), (0, 1)]), prompt, params,
                                             12_000, max_new=6, seed=11)
    for view, fit in fits(tokens, prompt, params).items():
        assert fit.pvalue > ALPHA, f"draft tree, {view}: {fit}"
    assert 0 < accepted < proposed


def test_the_draft_proposes_only_its_vocabulary_and_greedy_is_unchanged():
    target, draft = pair()
    seen = []

    class Watching(DraftChain):
        def propose(self, *a, **k):
            proposal = super().propose(*a, **k)
            seen.extend(proposal.tokens[1:].tolist())
            return proposal

    for prompt in ([2], [5, 0, 4], [1, 4], [3]):
        out = np.concatenate(list(loop.decode(target, Watching(draft, 3), np.asarray(prompt), max_new_tokens=30,
                                              params=SamplingParams(), rng=np.random.default_rng(0),
                                              stats=loop.DecodeStats())))
        assert out.tolist() == greedy_reference(TARGET, prompt, 30).tolist()
    assert seen and set(seen) <= set(SUBSET.tolist())


def residual_over_the_subset(proposal, draft_probs, target_probs, uniforms, draws):
    """accept_chain with a planted bug: the recovered token is drawn from max(p - q, 0) renormalised over
    the draft's vocabulary only, so target tokens outside it can never be recovered."""
    gamma = len(proposal)
    for i in range(gamma):
        x, p, q = proposal[i], target_probs[i], draft_probs[i]
        if uniforms[i] * q[x] < p[x]:
            continue
        residual = np.zeros_like(p)
        residual[SUBSET] = np.maximum(p - q, 0)[SUBSET]                      # BUG
        if residual.sum() <= 0:                                              # all of it was outside
            residual[SUBSET] = p[SUBSET]
        token = sample(residual / residual.sum(), draws[i])
        return Verdict(np.arange(i + 1), np.append(proposal[:i], token).astype(np.int64))
    return Verdict(np.arange(gamma + 1), np.append(proposal, sample(target_probs[gamma], draws[gamma])))


@pytest.mark.parametrize("bug", ["ids mapped twice", "residual over the subset"])
def test_teeth(bug, monkeypatch):
    target, draft = pair()
    chain = (MapsTwice if bug == "ids mapped twice" else DraftChain)(draft, 4)
    if bug == "residual over the subset":
        monkeypatch.setattr(loop, "accept_chain", residual_over_the_subset)
    params, prompt = SamplingParams(temperature=1.0), [5, 0, 4]
    tokens, _, _ = decode_many(target, chain, prompt, params, TEETH_RUNS, max_new=6, seed=5)
    worst = min(fits(tokens, prompt, params).values(), key=lambda f: f.pvalue)
    assert worst.pvalue < TEETH_P, f"planted bug ({bug}) not detected: {worst}"


def test_reduced_vocab_checks_its_ids():
    inner = SubsetGraph(TabularBackend(DRAFT, capacity=8, max_tokens=4), SUBSET)
    with pytest.raises(SpecexportError, match="4 logits"):
        ReducedVocab(inner, SUBSET[:3], V)
    with pytest.raises(SpecexportError, match="distinct target ids"):
        ReducedVocab(inner, np.array([0, 0, 2, 3]), V)
    with pytest.raises(SpecexportError, match="distinct target ids"):
        ReducedVocab(inner, np.array([0, 2, 3, 9]), V)


# -- exported: draft: {vocab: N | file} ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["most frequent", "file"])
def test_reduced_vocabulary_draft_builds_and_decodes_greedily_equal(kind, tiny_checkpoints, write_yaml, run_build,
                                                                     tmp_path):
    import json

    import specexport
    from specexport.manifest import read_manifest

    vocab = 96
    if kind == "file":
        (tmp_path / "ids.json").write_text(json.dumps(list(range(0, 2 * vocab, 2))))   # every other id
        vocab = str(tmp_path / "ids.json")
    cfg = write_yaml(tmp_path / "model.yaml", name="rv", target={"path": tiny_checkpoints["llama"]},
                     draft={"path": tiny_checkpoints["llama-draft"], "vocab": vocab}, max_seq_len=128,
                     precisions=["fp32", "int8"] if kind == "file" else ["fp32"],
                     quality_gates={"int8": {"min_top1": 0.6, "max_kl": 0.05}},
                     output=tmp_path / "out")
    assert run_build(cfg) == 0
    manifest = read_manifest(tmp_path / "out")
    draft, target = manifest["models"]["draft"], manifest["models"]["target"]
    ids = draft["vocab_ids"]
    assert len(ids) == 96 and ids == sorted(set(ids)) and draft["io"]["vocab_size"] == 96
    assert draft["vocab_size"] == target["vocab_size"] == target["io"]["vocab_size"] > 96
    if kind == "file":
        assert ids == list(range(0, 192, 2)) and draft["vocab_source"] == {"file": vocab}
    else:
        assert set(target["special_tokens"]["eos_token_ids"]) <= set(ids)
        assert draft["vocab_source"]["most_frequent"] == 96
    assert draft["precisions"]["fp32"]["parity_max_rel_error"] <= 1e-4        # gated on those columns
    precisions = list(draft["precisions"])
    for precision in precisions:
        with specexport.load(tmp_path / "out", precision=precision) as p:
            assert p.draft.forward(np.array([1, 40])).logits.shape == (2, target["vocab_size"])
            p.draft.reset()
            for prompt in ("def fib(n):", "import os\nclass A:", "x = [1, 2"):
                vanilla = p.generate(prompt, max_new_tokens=60, method="vanilla").token_ids
                for gamma in (2, 4):
                    out = p.generate(prompt, max_new_tokens=60, method="draft", gamma=gamma)
                    assert out.token_ids == vanilla, (precision, prompt, gamma)
