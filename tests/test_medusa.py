"""Medusa heads: the published formats, the exported graph against the published math, and the
Medusa tree through the loop.

- Formats: Medusa-1 (.safetensors and .pt), "version 2" heads without a projection, Medusa-2 full
  models (`medusa_head.` keys), with a config whose medusa_num_heads disagrees with the keys.
- The heads graph in ONNX Runtime against Medusa's own head structure in PyTorch.
- Tabular toy target (V = 6) with tabular heads: sampled output G-tested against the exact
  distribution at T = 1 and with top-k / top-p; the planted bugs must fail; greedy equals plain greedy.
- An exported tiny Llama with random heads built from each layout: greedy equal to vanilla on 20
  prompts x 100 tokens, and sampled output G-tested against the exported target's exact distribution.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from fakes import counts_of, goodness_of_fit
from specexport.errors import SpecexportError
from specexport.heads.medusa import export_heads, heads_parity, load_medusa, save_medusa_1
from specexport.io_spec import HeadsIO
from specexport.runtime import loop
from specexport.runtime.proposers import MedusaTree
from specexport.runtime.sampling import SamplingParams, warp
from test_proposers import (ALPHA, T1, TEETH_P, V, accept_tree_stale_bonus, accept_tree_without_renormalising,
                            fits, greedy_against_plain, run)

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]


def random_heads(rng, H, V, N, L=1, *, own=True, scale=0.1):
    blocks = [[(rng.normal(0, scale, (H, H)).astype(np.float32), rng.normal(0, scale, H).astype(np.float32))
               for _ in range(L)] for _ in range(N)]
    projections = [rng.normal(0, 1, (V, H)).astype(np.float32) if own else None for _ in range(N)]
    return blocks, projections


def state_dict(blocks, projections, prefix=""):
    out = {}
    for h, head in enumerate(blocks):
        for j, (w, b) in enumerate(head):
            out[f"{prefix}{h}.{j}.linear.weight"], out[f"{prefix}{h}.{j}.linear.bias"] = w, b
        if projections[h] is not None:
            out[f"{prefix}{h}.{len(head)}.weight"] = projections[h]
    return out


# -- formats -------------------------------------------------------------------------------------------
def test_every_published_layout_loads_with_heads_counted_from_the_keys(tmp_path):
    import torch
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    H, Vh, N = 8, 20, 3
    blocks, projections = random_heads(rng, H, Vh, N, L=2)
    save_medusa_1(tmp_path / "m1", blocks, projections)
    (tmp_path / "pt").mkdir()
    torch.save({k: torch.from_numpy(v) for k, v in state_dict(blocks, projections).items()},
               tmp_path / "pt" / "medusa_lm_head.pt")
    (tmp_path / "pt" / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 2}))
    save_medusa_1(tmp_path / "v2", blocks, [None] * N)
    (tmp_path / "m2").mkdir()
    base = {"model.embed_tokens.weight": rng.normal(size=(Vh, H)).astype(np.float32),
            "lm_head.weight": rng.normal(size=(Vh, H)).astype(np.float32)}
    save_file({**base, **state_dict(blocks, projections, prefix="medusa_head.")}, str(tmp_path / "m2" / "model.safetensors"))

    for name, fmt, lm_head in [("m1", "medusa-1", "own"), ("pt", "medusa-1", "own"), ("v2", "medusa-1", "target"),
                               ("m2", "medusa-2", "own")]:
        w = load_medusa(tmp_path / name, hidden_size=H, vocab_size=Vh)
        assert (w.format, w.num_heads, w.num_layers, w.lm_head) == (fmt, N, 2, lm_head), name
        for got, want in zip(w.blocks, blocks):
            for (gw, gb), (ww, wb) in zip(got, want):
                np.testing.assert_array_equal(gw, ww)
                np.testing.assert_array_equal(gb, wb)
        if lm_head == "own":
            np.testing.assert_array_equal(w.projections[2], projections[2])
    assert load_medusa(tmp_path / "pt", hidden_size=H, vocab_size=Vh).config_num_heads == 5    # recorded, not used


def test_loader_errors_name_the_file_and_the_key(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    (tmp_path / "none").mkdir()
    with pytest.raises(SpecexportError, match="holds no Medusa heads.*medusa_lm_head.safetensors"):
        load_medusa(tmp_path / "none", hidden_size=8, vocab_size=20)
    blocks, projections = random_heads(rng, 8, 20, 2)
    save_medusa_1(tmp_path / "ok", blocks, projections)
    with pytest.raises(SpecexportError, match=r"medusa_lm_head.safetensors: 0.1.weight has shape \[20, 8\], expected \[30, 8\]"):
        load_medusa(tmp_path / "ok", hidden_size=8, vocab_size=30)
    for name, tensors, pattern in [
        ("gap", {k: v for k, v in state_dict(blocks, projections).items() if not k.startswith("0.")},
         r"head indices \[1\] are not 0..N-1"),
        ("mixed", {k: v for k, v in state_dict(blocks, projections).items() if k != "1.1.weight"},
         "heads differ in their layers"),
        ("alien", {**state_dict(blocks, projections), "extra.weight": np.zeros(3, np.float32)}, "unexpected key 'extra.weight'"),
    ]:
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "medusa_lm_head.safetensors"))
        with pytest.raises(SpecexportError, match=pattern):
            load_medusa(tmp_path / name, hidden_size=8, vocab_size=20)


@pytest.mark.parametrize("own", [True, False], ids=["own projections", "target lm_head"])
def test_heads_graph_matches_the_published_math(tmp_path, own):
    rng = np.random.default_rng(2)
    H, Vh, N, K = 16, 40, 3, 5
    save_medusa_1(tmp_path / "heads", *random_heads(rng, H, Vh, N, L=2, own=own))
    w = load_medusa(tmp_path / "heads", hidden_size=H, vocab_size=Vh)
    lm_head = None if own else rng.normal(size=(Vh, H)).astype(np.float32)
    io = HeadsIO(hidden_size=H, num_heads=N, top_k=K)
    export_heads(w, lm_head, io, onnx_path=tmp_path / "model.onnx")
    report = heads_parity(w, lm_head, io, onnx_path=tmp_path / "model.onnx",
                          hidden=rng.normal(size=(9, H)).astype(np.float32))
    assert report["max_rel_error"] < 1e-5 and report["rows"] == 9
    # and the parity check has teeth: other weights fail it
    other = load_medusa(tmp_path / "heads", hidden_size=H, vocab_size=Vh)
    other.blocks[1][0][0][:] += 0.5
    bad = heads_parity(other, lm_head, io, onnx_path=tmp_path / "model.onnx",
                       hidden=rng.normal(size=(9, H)).astype(np.float32))
    assert bad["max_rel_error"] > 1e-3


# -- the Medusa tree through the loop, tabular -------------------------------------------------------
class TabularHeads:
    """N heads keyed by the (previous token, token) the tabular backend reports as its hidden state:
    each head ranks the vocabulary in a fixed random order per context (deterministic, often wrong)."""

    def __init__(self, num_heads=3, top_k=3, seed=0):
        self.num_heads, self.top_k = num_heads, top_k
        scores = np.random.default_rng(seed).standard_normal((num_heads, V, V, V))
        self.order = np.argsort(-scores, axis=-1)[..., :top_k]              # [N, V, V, K]
        self.calls = 0

    def __call__(self, hidden):
        self.calls += 1
        a, b = int(hidden[0]), int(hidden[1])
        return self.order[:, a, b]                                             # [N, K]


# top-k 3 was a case too: the warps are shared with every proposer and G-tested in test_accept_stats (suite time)
MEDUSA_CASES = [("T1", T1), ("top-p 0.8", SamplingParams(1.0, top_p=0.8))]


@pytest.mark.parametrize("name,params", MEDUSA_CASES, ids=[c[0] for c in MEDUSA_CASES])
def test_medusa_tree_sampling_is_lossless(name, params):
    heads = TabularHeads()
    tokens, proposed, accepted = run(MedusaTree(heads, TREE), params, 20_000, seed=len(name) + 40)
    for view, fit in fits(tokens, params).items():
        assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, f"{name}, {view}: {fit}"
    assert 0 < accepted < proposed and heads.calls > 0


@pytest.mark.parametrize("variant", ["siblings without renormalising", "stale bonus after rejected siblings"])
def test_teeth_medusa_tree(variant, monkeypatch):
    bug = accept_tree_without_renormalising if variant.startswith("siblings") else accept_tree_stale_bonus
    monkeypatch.setattr(loop, "accept_tree", bug)
    tokens, _, _ = run(MedusaTree(TabularHeads(), TREE), T1, 4_000, seed=12)
    worst = min(fits(tokens, T1).values(), key=lambda f: f.pvalue)
    assert worst.pvalue < TEETH_P, f"planted bug ({variant}) not detected: {worst}"


def test_medusa_greedy_equals_plain_greedy_and_reads_the_last_committed_state():
    heads = TabularHeads(num_heads=3, top_k=3, seed=5)
    proposer = MedusaTree(heads, TREE)
    seen = []
    original = proposer.features
    proposer.features = lambda hidden, start: (seen.append(hidden[-1].copy()), original(hidden, start))
    accepted = greedy_against_plain(proposer, seed=9,
                                    after_chunk=lambda seq: seen and np.testing.assert_array_equal(
                                        seen[-1], [seq[-3] if len(seq) > 2 else 0, seq[-2]]))
    assert accepted > 0


def test_medusa_tree_checks_its_heads():
    with pytest.raises(ValueError, match="depth 4 needs 4 heads; these Medusa heads are 3"):
        MedusaTree(TabularHeads(3, 3), [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    with pytest.raises(ValueError, match="rank 3 needs top_k > 3"):
        MedusaTree(TabularHeads(3, 3), [(0,), (3,)])


def test_auto_tree_worked_example():
    from specexport.heads.medusa_tree import choose_tree, greedy_tree

    acc = np.array([[0.6, 0.2], [0.5, 0.1]])
    paths, probs = greedy_tree(acc, 4)
    assert paths == [(0,), (0, 0), (1,), (1, 0)] and np.allclose(probs, [0.6, 0.3, 0.2, 0.1])
    # verify passes: T = 1, 2 cost 1; T = 3 costs 2; heads free -> 1 node: 1.6; 2 nodes: 1.9 / 2 ...
    costs = {1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0, 5: 2.0}
    choice = choose_tree(acc, costs, 0.0, max_nodes=4)
    assert choice["nodes"] == 1 and choice["paths"] == [[0]] and np.isclose(choice["predicted_speedup"], 1.6)
    choice = choose_tree(acc, {t: 1.0 for t in range(1, 6)}, 0.0, max_nodes=4)       # free verification: all of it
    assert choice["nodes"] == 4 and np.isclose(choice["expected_tokens"], 2.2)


# -- exported models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def medusa_builds(tiny_root, tiny_checkpoints, write_yaml, run_build):
    """Two builds with random heads: the 2-layer Llama with Medusa-1 heads (own projections, 4 heads),
    and the 1-layer Llama with version-2 heads (reusing its lm_head, 3 heads x 2 blocks)."""
    from transformers import AutoConfig

    out = {}
    for name, ckpt, N, L, own in [("m1", "llama", 4, 1, True), ("v2", "llama-draft", 3, 2, False)]:
        cfg = AutoConfig.from_pretrained(tiny_checkpoints[ckpt])
        heads = tiny_root / "medusa" / name
        # scale 1: heads whose blocks matter, so the parity check compares something
        save_medusa_1(heads, *random_heads(np.random.default_rng(3), cfg.hidden_size, cfg.vocab_size, N, L,
                                           own=own, scale=1.0))
        yaml = write_yaml(tiny_root / "yaml" / f"medusa-{name}.yaml", name=f"medusa-{name}",
                          target={"path": tiny_checkpoints[ckpt]}, medusa={"path": heads, "top_k": 4},
                          max_seq_len=128, output=tiny_root / "build" / f"medusa-{name}")
        assert run_build(yaml) == 0
        out[name] = tiny_root / "build" / f"medusa-{name}"
    return out


def test_builds_record_the_heads_and_their_check(medusa_builds):
    from specexport.manifest import listed_files, read_manifest

    for name, (N, L, lm_head) in {"m1": (4, 1, "own"), "v2": (3, 2, "target")}.items():
        m = read_manifest(medusa_builds[name])
        h = m["heads"]["medusa"]
        assert (h["num_heads"], h["num_layers"], h["lm_head"], h["top_k"], h["format"]) == (N, L, lm_head, 4, "medusa-1")
        stage = h["precisions"]["fp32"]
        assert stage["parity_max_rel_error"] <= stage["parity_tolerance"]
        auto = h["auto_tree"]
        assert np.asarray(auto["accuracy"]).shape == (N, 4) and 1 <= auto["nodes"] == len(auto["paths"]) <= 15
        assert set(auto["verify_cost_ms"]) == {str(t) for t in range(1, 17)}
        assert auto["predicted_speedup"] == max(auto["predicted_by_nodes"].values())
        assert all(f in listed_files(m) for f in stage["files"])
        assert (medusa_builds[name] / stage["dir"] / "model.onnx").is_file()


VANILLA: dict = {}


@pytest.mark.parametrize("name,tree", [("m1", "medium"), ("m1", "small"), ("v2", "medium"), ("m1", None),
                                       ("m1", [[0], [1], [0, 0], [0, 0, 0]])], ids=["m1-medium", "m1-small",
                                                                                  "v2-medium", "m1-auto", "m1-paths"])
def test_medusa_greedy_equals_vanilla_on_exported_models(medusa_builds, name, tree):
    import specexport

    with specexport.load(medusa_builds[name]) as pipe:
        assert "medusa" in pipe.methods
        rng = np.random.default_rng(4)
        accepted = 0
        for i in range(20):
            prompt = rng.integers(3, pipe.target.vocab_size, size=int(rng.integers(2, 20))).tolist()
            if (name, i) not in VANILLA:                 # the same 20 prompts for every tree of a build
                VANILLA[name, i] = pipe.generate(prompt_ids=prompt, max_new_tokens=100, method="vanilla").token_ids
            out = pipe.generate(prompt_ids=prompt, max_new_tokens=100, method="medusa", tree=tree)
            assert out.token_ids == VANILLA[name, i]
            assert out.stats.forwards.get(("medusa", 1), 0) == out.stats.target_passes - out.stats.rounds.count((0, 0))
            accepted += out.stats.accepted
        assert accepted > 0


def test_seeded_sampled_medusa_emits_vanillas_text(medusa_builds):
    """runtime/sampling.Coins: the q-free rule draws each emitted token with its position's coin, so
    Medusa's sampled text equals vanilla's for the same seed (tests/test_seeded_sampling.py). These
    random heads are rarely right unless the target is sharp: temperature 0.1."""
    import specexport

    with specexport.load(medusa_builds["m1"]) as pipe:
        rng, accepted = np.random.default_rng(4), 0
        for seed in range(10):
            prompt = rng.integers(3, pipe.target.vocab_size, size=int(rng.integers(2, 20))).tolist()
            kw = dict(prompt_ids=prompt, max_new_tokens=100, temperature=0.1, seed=seed)
            out = pipe.generate(method="medusa", **kw)
            assert out.token_ids == pipe.generate(method="vanilla", **kw).token_ids, seed
            accepted += out.stats.accepted
        assert accepted > 0


def test_sampled_medusa_matches_the_exported_targets_exact_distribution(medusa_builds):
    """Tokens 1 and 2 after a fixed prompt, at temperature 1 with top-k 4 (16 cells): the second comes
    from the Medusa round's verdict. Exact: p(t1) p(t2 | t1) from the target graph itself."""
    import specexport

    params = SamplingParams(1.0, top_k=4)
    with specexport.load(medusa_builds["m1"]) as pipe:
        prompt = [5, 17, 42, 9]
        target = pipe.target

        def next_probs(ids):
            target.reset()
            out = target.forward(np.asarray(ids))
            return warp(out.logits[-1].astype(np.float64), params)

        p1 = next_probs(prompt)
        support = np.flatnonzero(p1)
        exact = np.zeros((pipe.target.vocab_size,) * 2)
        for t in support:
            exact[t] = p1[t] * next_probs(prompt + [int(t)])
        rng_seeds = np.random.default_rng(6).integers(0, 2**31, 3000)
        pairs, proposed, accepted = [], 0, 0
        for seed in rng_seeds:
            out = pipe.generate(prompt_ids=prompt, max_new_tokens=3, method="medusa", tree="small", temperature=1.0,
                                top_k=4, seed=int(seed))
            pairs.append(out.token_ids[:2])
            proposed, accepted = proposed + out.stats.proposed, accepted + out.stats.accepted
    cells = np.flatnonzero(exact.ravel() > 0)
    counts = counts_of(np.asarray(pairs), exact.shape).ravel()
    fit = goodness_of_fit(counts[cells], exact.ravel()[cells])
    assert counts.sum() == counts[cells].sum(), "a token outside the top-k support was emitted"
    assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, str(fit)
    assert proposed > 0


def test_medusa_errors_and_cli(medusa_builds, built_draft_only, capsys):
    import specexport
    from specexport.cli import main

    with specexport.load(built_draft_only[1]) as pipe:
        with pytest.raises(SpecexportError, match="'medusa' was not built \\(no Medusa heads in this build\\)"):
            pipe.generate("x", method="medusa")
    with specexport.load(medusa_builds["m1"]) as pipe:
        with pytest.raises(SpecexportError, match="tree: 'huge' is not a known tree; known: small, medium, large"):
            pipe.generate("x", method="medusa", tree="huge")
        with pytest.raises(SpecexportError, match="rank 5 needs top_k > 5"):
            pipe.generate("x", method="medusa", tree=[[0], [5]])
        with pytest.raises(SpecexportError, match="depth 5 needs 5 heads"):
            pipe.generate("x", method="medusa", tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert main(["generate", str(medusa_builds["m1"]), "hello", "--method", "medusa", "--tree", "small",
                 "--max-new-tokens", "12"]) == 0
    assert "[medusa]" in capsys.readouterr().err
    assert main(["inspect", str(medusa_builds["v2"])]) == 0
    assert "medusa" in capsys.readouterr().out


def test_bench_rows_for_medusa(medusa_builds, tmp_path):
    from specexport.report.bench import BenchConfig, run_bench

    report = run_bench(BenchConfig(output_dir=medusa_builds["m1"], prompts=("hello", "a b c"), methods=("vanilla", "medusa"),
                                   medusa_trees=("small", "medium"), gammas=(2,), max_new_tokens=16, rounds=1, threads=1,
                                   peers=False, plots=False, out=tmp_path / "bench"), log=lambda m: None)
    rows = [r for r in report["rows"] if r["method"] == "medusa"]
    assert [r["tree"] for r in rows] == ["small", "medium"]
    assert all(r["ideal_speedup"] and r["mean_accepted_tokens"] >= 1 for r in rows)


def test_bench_refuses_a_medusa_tree_wider_than_the_graph(medusa_builds, tmp_path):
    from specexport.report.bench import BenchConfig, run_bench

    with pytest.raises(SpecexportError, match=r"--medusa-trees: 'large': tree: \d+ nodes; the graph verifies at most"):
        run_bench(BenchConfig(output_dir=medusa_builds["m1"], prompts=("x",), methods=("vanilla", "medusa"),
                              medusa_trees=("large",), threads=1, peers=False, plots=False, out=tmp_path),
                  log=lambda m: None)
