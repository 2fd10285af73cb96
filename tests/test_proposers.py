"""Proposers through the whole loop: prompt lookup (chains and tries of several matches) on the
tabular toy target (V = 6, exact continuation probabilities), plus the proposer's own worked examples.

- Sampling at temperature 1 and with top-k / top-p: the emitted tokens are G-tested against the
  target's exact distribution (the q-free tree rule makes deterministic proposals lossless).
- Teeth (ANCHORS.md): siblings tried without renormalising p', the stale bonus after a rejected
  sibling at the last level (EAGLE PR #47), and a compaction that keeps a rejected row must each fail
  the same G-test at p < 1e-6.
- Greedy: token for token equal to plain greedy; KV invariants after every round.
"""
from __future__ import annotations

import numpy as np
import pytest

from fakes import (TabularBackend, counts_of, decode_many, exact_continuation_probs, goodness_of_fit, greedy_reference,
                   make_table)
from specexport.runtime import loop
from specexport.runtime.accept import Verdict
from specexport.runtime.budget import relative_costs
from specexport.runtime.loop import DecodeStats, decode
from specexport.runtime.proposers import Limits, PromptLookup
from specexport.runtime.proposers.lookup import continuations, trie
from specexport.runtime.sampling import SamplingParams, sample

ALPHA = 1e-4 / 20
TEETH_P = 1e-6
V = 6
TARGET = make_table(np.random.default_rng(3), V, sharpness=1.5)
PROMPT = [3, 1, 4, 3, 1, 5, 3]            # repeats, so the last tokens have earlier occurrences
T1 = SamplingParams(temperature=1.0)


# -- worked examples --------------------------------------------------------------------------------
def test_continuations_worked_examples():
    ctx = np.array([5, 7, 1, 2, 9, 5, 7])
    assert [c.tolist() for c in continuations(ctx, depth=3, ngram_max=2)] == [[1, 2, 9]]
    ctx = np.array([1, 2, 1, 3, 1, 4, 1])
    # ngram_max 1: every match counts 1, so the nearest wins: [1] occurred at 4, 2 and 0 -> [4, 1], [3, 1], [2, 1]
    assert [c.tolist() for c in continuations(ctx, depth=2, ngram_max=1, branches=3)] == [[4, 1], [3, 1], [2, 1]]
    # a longer match is worth an occurrence twice as far back: [.., 9, 1] at p = 2 (L 1, 1 - log2 3) against
    # [4, 1] at p = 5 (L 2, 2 - log2 6): equal scores, the nearer first; one token further back the longer wins
    ctx = np.array([4, 1, 2, 9, 1, 4, 1])
    assert [c.tolist() for c in continuations(ctx, depth=2, ngram_max=2, branches=2)] == [[4, 1], [2, 9]]
    ctx = np.array([4, 1, 2, 9, 1, 8, 4, 1])
    assert [c.tolist() for c in continuations(ctx, depth=2, ngram_max=2, branches=2)] == [[2, 9], [8, 4]]
    assert continuations(np.array([1, 2, 3]), depth=3, ngram_max=2) == []
    # ngram_min: only matches at least that long are candidates
    assert [c.tolist() for c in continuations(ctx, depth=2, ngram_max=2, ngram_min=2, branches=2)] == [[2, 9]]
    # an occurrence overlapping the end continues periodically: the text is looping
    assert [c.tolist() for c in continuations(np.array([7, 7]), depth=4, ngram_max=3)] == [[7, 7, 7, 7]]
    assert [c.tolist() for c in continuations(np.array([1, 2, 3, 1, 2]), depth=4, ngram_max=2)] == [[3, 1, 2, 3]]


def test_a_loop_that_just_began_beats_an_older_longer_match():
    """The case a user saw (issue 33): [.., 473, 465, 465] once went on with 466s; now the text has started a
    run of 465s. The longest match (the older [473, 465, 465]) proposed 466 466 466 466 and the round
    accepted nothing; the run that just began wins now, until an older match is long enough to outweigh
    its distance."""
    old = [473, 465, 465, 466, 466, 466, 466]
    ctx = np.array([1, 2, *old, *range(500, 520), 473, 465, 465])
    assert continuations(ctx, depth=4, ngram_max=16)[0].tolist() == [465, 465, 465, 465]
    # the same text with a long copy of the older passage (8 tokens matched): the copy goes on
    copied = [30, 31, 32, 33, 34, 473, 465, 465]
    ctx = np.array([1, *copied, 466, 466, *range(500, 520), *copied])
    assert continuations(ctx, depth=4, ngram_max=16)[0].tolist() == [466, 466, 500, 501]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("ngram_max", [1, 3])
def test_lookup_on_a_loop_proposes_full_chains(k, ngram_max):
    """A text looping with period k (the repeated-token output a user saw: 1.55 tokens a pass)
    gets γ tokens a round, each the loop's next token, whatever the period and the n-gram size."""
    loop = np.arange(10, 10 + k)
    gamma = 6
    for length in range(k + 1, 4 * k + 2):
        seq = np.resize(loop, length)
        proposal = PromptLookup(gamma, ngram_max=ngram_max).propose(
            np.append(seq, np.zeros(gamma + 1, np.int64)), length, Limits(gamma, 16), None, None, None)
        expected = np.resize(np.roll(loop, -(length % k)), gamma)
        assert proposal.tokens[1:].tolist() == expected.tolist(), (k, length)


def test_trie_worked_example_and_node_budget():
    parents, tokens = trie(7, [np.array([1, 2]), np.array([1, 4]), np.array([3])], max_nodes=10)
    assert parents.tolist() == [-1, 0, 1, 1, 0] and tokens.tolist() == [7, 1, 2, 4, 3]
    parents, tokens = trie(7, [np.array([1, 2]), np.array([1, 4]), np.array([3])], max_nodes=3)
    assert parents.tolist() == [-1, 0, 1, 1] and tokens.tolist() == [7, 1, 2, 4]


def test_lookup_respects_the_round_limits():
    proposer = PromptLookup(5, ngram_max=1, branches=3)
    seq = np.array([1, 2, 1, 3, 1, 4, 1] + [0] * 20)
    prop = proposer.propose(seq, 7, Limits(max_depth=2, max_nodes=3), T1, None, DecodeStats())
    assert prop.tree.size == 4 and prop.tree.depths.max() <= 2 and prop.tokens[0] == 1
    assert proposer.propose(np.array([1, 2, 3, 0]), 3, Limits(4, 8), T1, None, DecodeStats()) is None


# -- through the loop --------------------------------------------------------------------------------
def target_backend(cls=TabularBackend, capacity=64):
    return cls(TARGET, capacity=capacity, max_tokens=8)


def run(proposer, params, runs, *, max_new=6, seed=0, target=None, prompt=PROMPT):
    """tokens [runs, max_new] and the summed proposed / accepted counts, on the tabular target."""
    return decode_many(target or target_backend(), proposer, prompt, params, runs, max_new=max_new, seed=seed)


def fits(tokens, params, prompt=PROMPT):
    k = tokens.shape[1]
    exact = exact_continuation_probs(TARGET, prompt, k, params)
    return {"first 3": goodness_of_fit(counts_of(tokens[:, :3], (V,) * 3), exact.sum(tuple(range(3, k)))),
            "last 3": goodness_of_fit(counts_of(tokens[:, -3:], (V,) * 3), exact.sum(tuple(range(k - 3)))),
            f"all {k}": goodness_of_fit(counts_of(tokens, (V,) * k), exact)}


# (a chain at T1 was a case too; the chain stays under top-p and T1 under the trie: suite time)
# a pass curve as AVX2 gives it (5x a step at 16 rows): lookup's rounds sized from it (runtime/budget.py)
STEEP = relative_costs({1: 10.0, 2: 12.0, 4: 17.0, 8: 27.0, 16: 50.0}, 16)
LOOKUP_CASES = [("trie of 3, T1", PromptLookup(4, ngram_max=2, branches=3), T1),
                ("trie of 3, top-k 3", PromptLookup(3, ngram_max=1, branches=3), SamplingParams(1.0, top_k=3)),
                ("chain, top-p 0.8", PromptLookup(4, ngram_max=3), SamplingParams(1.0, top_p=0.8)),
                ("chain sized by costs, T1", PromptLookup(6, ngram_max=2, costs=STEEP), T1)]


@pytest.mark.parametrize("name,proposer,params", LOOKUP_CASES, ids=[c[0] for c in LOOKUP_CASES])
def test_prompt_lookup_sampling_is_lossless(name, proposer, params):
    runs = 20_000 if proposer.costs is None else 10_000
    tokens, proposed, accepted = run(proposer, params, runs, seed=len(name))
    for view, fit in fits(tokens, params).items():
        assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"{name}, {view}: {fit}"
    assert 0 < accepted < proposed                  # both verdicts happened


# -- teeth ---------------------------------------------------------------------------------------------
def accept_tree_without_renormalising(tree, node_tokens, target_probs, uniforms):
    """Planted bug: siblings tried in order, child c accepted with p(c) (not p'(c), p renormalised
    without the rejected siblings); when none is accepted, the token comes from p (not p')."""
    node, path, level = 0, [0], 0
    while True:
        p = target_probs[node]
        nxt = None
        for c in tree.children[node]:
            level += 1
            if uniforms[min(level, len(uniforms) - 1)] < p[node_tokens[c]]:
                nxt = c
                break
        if nxt is None:
            y = sample(p, uniforms[0])
            path = np.asarray(path, dtype=np.int64)
            return Verdict(path, np.append(node_tokens[path[1:]], y).astype(np.int64))
        node = nxt
        path.append(node)


def accept_tree_stale_bonus(tree, node_tokens, target_probs, uniforms):
    """Planted bug (EAGLE PR #47): when every child at a node is rejected, the token is drawn from the
    distribution of the last rejected child instead of the node's own."""
    node, path, level = 0, [0], 0
    while True:
        y = sample(target_probs[node], uniforms[level])
        level += 1
        nxt = next((c for c in tree.children[node] if node_tokens[c] == y), None)
        if nxt is None:
            if tree.children[node]:
                y = sample(target_probs[tree.children[node][-1]], uniforms[level - 1])         # BUG
            path = np.asarray(path, dtype=np.int64)
            return Verdict(path, np.append(node_tokens[path[1:]], y).astype(np.int64))
        node = nxt
        path.append(node)


class KeepsARejectedSibling(TabularBackend):
    """Target whose tree compaction keeps the next (rejected) row instead of the last accepted one."""

    def commit(self, keep):
        if not isinstance(keep, (int, np.integer)) and len(keep) > 1 and keep[-1] + 1 < self._pending:
            keep = np.append(keep[:-1], keep[-1] + 1)
        super().commit(keep)


@pytest.mark.parametrize("variant", ["siblings without renormalising", "stale bonus after rejected siblings",
                                     "compaction keeps a rejected row"])
def test_teeth_tree_verification(variant, monkeypatch):
    target = None
    if variant.startswith("siblings"):
        monkeypatch.setattr(loop, "accept_tree", accept_tree_without_renormalising)
    elif variant.startswith("stale"):
        monkeypatch.setattr(loop, "accept_tree", accept_tree_stale_bonus)
    else:
        target = target_backend(KeepsARejectedSibling)
    tokens, _, _ = run(PromptLookup(3, ngram_max=1, branches=3), T1, 4_000, seed=11, target=target)
    worst = min(fits(tokens, T1).values(), key=lambda f: f.pvalue)
    assert worst.pvalue < TEETH_P, f"planted bug ({variant}) not detected: {worst}"


# -- greedy and bookkeeping ----------------------------------------------------------------------------
def greedy_against_plain(proposer, seed: int, after_chunk=lambda seq: None) -> int:
    """20 random prompts x 100 tokens, greedy, on the tabular target: equal to plain greedy, the target's
    KV exactly the committed text after every round; returns the tokens accepted in all."""
    target = target_backend(capacity=256)
    rng = np.random.default_rng(seed)
    accepted = 0
    for _ in range(20):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 12)))
        stats, seq = DecodeStats(), list(prompt)
        for chunk in decode(target, proposer, prompt, max_new_tokens=100, params=SamplingParams(0.0),
                            rng=np.random.default_rng(0), stats=stats):
            seq += chunk.tolist()
            assert target.length == len(seq) - 1 and target.context().tolist() == seq[:-1]
            after_chunk(seq)
        np.testing.assert_array_equal(seq[len(prompt):], greedy_reference(TARGET, prompt, 100))
        assert stats.emitted == 100 == 1 + sum(k + 1 for _, k in stats.rounds)
        assert stats.accepted_at[0] <= stats.proposed_at[0] == stats.target_passes - stats.rounds.count((0, 0))
        accepted += stats.accepted
    return accepted


@pytest.mark.parametrize("proposer", [PromptLookup(4, ngram_max=3), PromptLookup(5, ngram_max=2, branches=4),
                                      PromptLookup(2, ngram_max=1, branches=2),
                                      PromptLookup(7, ngram_max=2, branches=2, costs=STEEP)],
                         ids=["chain", "trie4", "trie2", "trie2-sized-by-costs"])
def test_prompt_lookup_greedy_equals_plain_greedy_and_keeps_the_kv_exact(proposer):
    assert greedy_against_plain(proposer, seed=5) > 0      # greedy toy text repeats itself: lookups get accepted


# -- on exported graphs (ONNX Runtime) -------------------------------------------------------------------
class RecordingLookup(PromptLookup):
    """PromptLookup that remembers whether it ever proposed a branching tree."""
    branched = False

    def propose(self, *args):
        prop = super().propose(*args)
        self.branched |= prop is not None and not prop.is_chain
        return prop


@pytest.mark.parametrize("branches", [1, 3])
def test_prompt_lookup_on_an_exported_model_equals_vanilla_greedy(built_llama, branches):
    """20 prompts x 100 tokens on the exported tiny Llama in ONNX Runtime (EOS does not stop the raw
    loop); trees (branches 3) exercise the tree mask, depth positions and the compaction of the
    accepted rows in the ORT backend."""
    import specexport

    with specexport.load(built_llama) as pipe:
        proposer = RecordingLookup(4, branches=branches, max_nodes=pipe.max_verify_tokens - 1)
        accepted = exported_against_vanilla(pipe, proposer, np.random.default_rng(branches), repeat=True)
    assert accepted > 0 and proposer.branched == (branches > 1)


def exported_against_vanilla(pipe, proposer, rng, *, repeat: bool = False) -> int:
    """20 prompts x 100 greedy tokens on the pipeline's target in ONNX Runtime, with and without the
    proposer (the raw loop: EOS does not stop it); equal outputs; returns the tokens accepted."""
    accepted = 0
    for _ in range(20):
        prompt = rng.integers(3, pipe.target.vocab_size, size=int(rng.integers(2, 12)))
        if repeat:
            prompt = np.concatenate([prompt, prompt[:3]])           # a repeat, so there is something to look up
        outs = []
        for prop in (None, proposer):
            stats = DecodeStats()
            outs.append(np.concatenate(list(decode(pipe.target, prop, prompt, max_new_tokens=100,
                                                   params=SamplingParams(0.0), rng=np.random.default_rng(0),
                                                   stats=stats))))
        np.testing.assert_array_equal(outs[1], outs[0])
        assert len(outs[0]) == 100
        accepted += stats.accepted
    return accepted


def test_lookup_is_available_from_the_cli_and_the_bench(built_draft_only, tmp_path, capsys):
    import json
    import shutil

    from specexport.cli import main

    _, out = built_draft_only
    shutil.copytree(out, tmp_path / "b")
    assert main(["generate", str(tmp_path / "b"), "a b a b a b", "--method", "lookup", "--max-new-tokens", "8"]) == 0
    assert main(["bench", str(tmp_path / "b"), "--methods", "vanilla,lookup", "--gammas", "2,4", "--rounds", "1",
                 "--max-new-tokens", "8", "--no-peers", "--threads", "1"]) == 0
    rows = json.loads((tmp_path / "b" / "bench" / "report.json").read_text())["rows"]
    assert [(r["method"], r["gamma"]) for r in rows] == [("vanilla", 0), ("lookup", 2), ("lookup", 4)]
    assert all(r["ideal_speedup"] and r["speedup_ci95"] for r in rows)
    assert main(["bench", str(tmp_path / "b"), "--methods", "draft", "--no-peers"]) == 1
    assert "has no draft model" in capsys.readouterr().err


# -- draft-model trees (static rank paths) ---------------------------------------------------------------
from fakes import perturb_table  # noqa: E402
from specexport.runtime.proposers import DraftTree  # noqa: E402
from specexport.runtime.tree import from_rank_paths  # noqa: E402

DRAFT_TABLE = perturb_table(np.random.default_rng(4), TARGET, noise=1.0)
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def test_rank_paths_worked_example_and_errors():
    tree, ranks = from_rank_paths([(0,), (1,), (0, 0)])
    assert tree.parents.tolist() == [-1, 0, 0, 1] and ranks.tolist() == [-1, 0, 1, 0]
    tree, ranks = from_rank_paths([[0, 0], [1], [0]])                       # any order in, breadth-first out
    assert tree.parents.tolist() == [-1, 0, 0, 1] and ranks.tolist() == [-1, 0, 1, 0]
    for bad in ([(0, 0)], [(0,), (0,)], [(-1,)], [()], "abc"):
        with pytest.raises(ValueError, match="tree"):
            from_rank_paths(bad)


def draft_tree(paths=TREE, capacity=64):
    return DraftTree(TabularBackend(DRAFT_TABLE, capacity=capacity, max_tokens=16), paths)


@pytest.mark.parametrize("params", [T1, SamplingParams(1.0, top_k=3)], ids=["T1", "top-k 3"])
def test_draft_tree_sampling_is_lossless(params):
    tokens, proposed, accepted = run(draft_tree(), params, 20_000, seed=21)
    for view, fit in fits(tokens, params).items():
        assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"draft tree, {view}: {fit}"
    assert 0 < accepted < proposed


def test_draft_tree_greedy_equals_plain_greedy_and_the_draft_holds_only_committed_text():
    proposer = draft_tree(capacity=256)

    def draft_holds_a_prefix(seq):
        d = proposer.draft
        assert d.length <= len(seq) - 1 and d.context().tolist() == seq[:d.length]

    assert greedy_against_plain(proposer, seed=8, after_chunk=draft_holds_a_prefix) > 0


def test_draft_tree_on_exported_models_equals_vanilla_greedy(built_llama):
    """The draft's level-by-level tree forwards (ancestor masks over scratch rows) and the target's
    tree verification in ONNX Runtime: 20 prompts x 100 tokens equal to vanilla greedy."""
    import specexport

    with specexport.load(built_llama) as pipe:
        assert exported_against_vanilla(pipe, DraftTree(pipe.draft, TREE), np.random.default_rng(2)) > 0


def test_draft_trees_through_the_pipeline_and_the_cli(built_llama, capsys):
    import specexport
    from specexport.cli import main
    from specexport.errors import SpecexportError
    from specexport.runtime.methods import DRAFT_TREES

    with specexport.load(built_llama) as pipe:
        ref = pipe.generate(prompt_ids=[5, 9, 11], max_new_tokens=40, method="vanilla").token_ids
        for name in DRAFT_TREES:
            out = pipe.generate(prompt_ids=[5, 9, 11], max_new_tokens=40, method="draft", tree=name)
            assert out.token_ids == ref and out.stats.gamma == int(from_rank_paths(DRAFT_TREES[name])[0].depths.max())
        with pytest.raises(SpecexportError, match="tree: 'bushy' is not a known tree"):
            pipe.generate(prompt_ids=[5], method="draft", tree="bushy")
        with pytest.raises(SpecexportError, match="tree: 16 nodes; the graph verifies at most"):
            pipe.generate(prompt_ids=[5], method="draft", tree=[(i,) for i in range(16)])
        with pytest.raises(SpecexportError, match="has no parent path"):
            pipe.generate(prompt_ids=[5], method="draft", tree=[(0, 0)])
        # sampled children: greedy still equals vanilla; at temperature 1 the proposal carries q
        assert pipe.generate(prompt_ids=[5, 9, 11], max_new_tokens=40, method="draft", tree="wide",
                             sampled_children=True).token_ids == ref
        seen = []
        original = loop.accept_tree_sampled
        loop.accept_tree_sampled = lambda *a, **k: (seen.append(1), original(*a, **k))[1]
        try:
            pipe.generate(prompt_ids=[5, 9, 11], max_new_tokens=20, method="draft", tree="wide", sampled_children=True,
                          temperature=1.0)
        finally:
            loop.accept_tree_sampled = original
        assert seen
        with pytest.raises(SpecexportError, match="sampled_children: only for draft trees"):
            pipe.generate(prompt_ids=[5], method="draft", sampled_children=True)
    draft = ["--method", "draft"]
    assert main(["generate", str(built_llama), "def f(x):", *draft, "--tree", "[[0],[1],[0,0]]", "--max-new-tokens",
                 "6"]) == 0
    assert main(["generate", str(built_llama), "def f(x):", *draft, "--tree", "small", "--sampled-children",
                 "--temperature", "0.8", "--max-new-tokens", "6"]) == 0
    assert main(["generate", str(built_llama), "x", *draft, "--tree", "[[0],", "--max-new-tokens", "6"]) == 1
    assert "--tree: not a JSON list of rank paths" in capsys.readouterr().err


def test_bench_rows_for_draft_trees_and_lookup(built_llama, tmp_path):
    import json
    import shutil

    from specexport.cli import main

    shutil.copytree(built_llama, tmp_path / "b")
    assert main(["bench", str(tmp_path / "b"), "--methods", "vanilla,draft,lookup", "--gammas", "2", "--trees",
                 "small", "--rounds", "1", "--max-new-tokens", "12", "--no-peers", "--threads", "1"]) == 0
    report = json.loads((tmp_path / "b" / "bench" / "report.json").read_text())
    rows = {(r["method"], r["gamma"], r["tree"]): r for r in report["rows"]}
    assert set(rows) == {("vanilla", 0, None), ("lookup", 2, None), ("draft", 2, None), ("draft", 4, "small")}
    tree_row = rows[("draft", 4, "small")]
    assert tree_row["ideal_speedup"] and tree_row["speedup_ci95"] and tree_row["acceptance_conditional"] == []
    assert set(report["gamma_auto"]) == {"fp32/fp32"} and report["gamma_auto"]["fp32/fp32"]["measured_at_gamma"] == 2
    assert "tree small (depth 4)" in (tmp_path / "b" / "bench" / "report.md").read_text()
    assert main(["bench", str(tmp_path / "b"), "--trees", "bushy", "--no-peers", "--threads", "1"]) == 1
