"""EAGLE heads through the build and the runtime, on exported tiny targets.

- The head graph against the published head in PyTorch (export/eagle_graph.head_parity), with teeth:
  a mask that shows a draft level every cached row, and another head's weights, both fail it.
- Builds: an EAGLE-1 head (pytorch_model.bin, fc bias) on the 2-layer llama; EAGLE-3 heads
  (model.safetensors, a reduced draft vocabulary with d2t) on a 4-layer target, whose default layers
  (2, N//2, N-3) coincide as (1, 2, 2), then with explicit eagle_aux_hidden_state_layer_ids rebuilt
  into the same folder (the target graph reused). The manifests record the head, its check, tree: auto.
- Greedy through the pipeline equals vanilla token for token, for the auto, dynamic and static trees;
  sampled output matches the exported target's exact distribution (G-test).

The heads are made so that the target accepts some of their proposals (random heads on a random
target are accepted almost never, which would leave the commit path untested): EAGLE-1's fc passes
the target's feature through and the layer adds little, so it proposes what the target predicted at
the row's own position; EAGLE-3's fc passes layer 1's input and its lm_head is the target's embedding
of its draft vocabulary, so it proposes the token two places back. Random tiny targets decode into
loops of period 1-3 where both are often right.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fakes import counts_of, goodness_of_fit  # noqa: E402
from specexport.errors import SpecexportError  # noqa: E402
from specexport.runtime.sampling import SamplingParams, warp  # noqa: E402
from test_proposers import ALPHA  # noqa: E402


def _layer(prefix, cfg, width_in, g, noise):
    H, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter = cfg.get("head_dim") or H // heads, cfg["intermediate_size"]
    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {f"{prefix}self_attn.q_proj.weight": r(heads * hd, width_in) * 0.3,
            f"{prefix}self_attn.k_proj.weight": r(kv * hd, width_in) * 0.3,
            f"{prefix}self_attn.v_proj.weight": r(kv * hd, width_in) * 0.3,
            f"{prefix}self_attn.o_proj.weight": r(H, heads * hd) * noise,
            f"{prefix}mlp.gate_proj.weight": r(inter, H) * 0.3, f"{prefix}mlp.up_proj.weight": r(inter, H) * 0.3,
            f"{prefix}mlp.down_proj.weight": r(H, inter) * noise,
            f"{prefix}post_attention_layernorm.weight": torch.ones(H)}


def head_config(target_cfg, **extra):
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
            "vocab_size", "head_dim")
    return {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "num_hidden_layers": 1,
            "rope_theta": 10000.0, **{k: target_cfg[k] for k in keys if k in target_cfg}, **extra}


def write_eagle1(folder, target, *, noise=0.02, seed=0):
    """EAGLE-1 (pytorch_model.bin, fc with bias) that proposes the target's own prediction at its row."""
    cfg = json.loads((target / "config.json").read_text())
    H, g = cfg["hidden_size"], torch.Generator().manual_seed(seed)
    fc = torch.cat([torch.zeros(H, H), torch.eye(H)], 1)
    folder.mkdir(parents=True)
    torch.save({"fc.weight": fc, "fc.bias": torch.zeros(H), **_layer("layers.0.", cfg, H, g, noise)},
               folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(head_config(cfg, bias=True)))


def write_eagle3(folder, target, *, layers=None, draft_vocab=200, noise=0.02, seed=1):
    """EAGLE-3 (model.safetensors, reduced draft vocabulary) that proposes the token two places back."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((target / "config.json").read_text())
    H, V, g = cfg["hidden_size"], cfg["vocab_size"], torch.Generator().manual_seed(seed)
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    ids = np.sort(np.random.default_rng(seed).choice(V, draft_vocab, replace=False))
    t = {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1), **_layer("midlayer.", cfg, 2 * H, g, noise),
         "midlayer.hidden_norm.weight": torch.ones(H), "midlayer.input_layernorm.weight": torch.ones(H),
         "norm.weight": torch.ones(H), "lm_head.weight": embed[torch.from_numpy(ids)].clone(),
         "d2t": torch.from_numpy(ids - np.arange(draft_vocab)), "t2d": torch.from_numpy(np.isin(np.arange(V), ids))}
    folder.mkdir(parents=True)
    save_file(t, str(folder / "model.safetensors"))
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}} if layers else {}
    (folder / "config.json").write_text(json.dumps(head_config(cfg, draft_vocab_size=draft_vocab, **extra)))


# -- the head graph ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_eagle3(tmp_path_factory):
    """An exported EAGLE-3 head with random weights everywhere (attention matters), on random features."""
    from test_eagle import export_eagle3

    return export_eagle3(tmp_path_factory.mktemp("eagle-graph"))


def test_head_graph_matches_the_published_head_and_the_check_has_teeth(random_eagle3, monkeypatch):
    from specexport.heads.eagle import load_eagle
    from specexport.heads.eagle_graph import head_parity
    from specexport.io_spec import EagleIO

    w, embed, io, path = random_eagle3
    rng = np.random.default_rng(1)
    tokens, feats = rng.integers(0, len(embed), 12), rng.normal(size=(11, io.feature_width)).astype(np.float32)
    good = head_parity(w, embed, None, io=io, onnx_path=path, tokens=tokens, features=feats)
    assert good["max_rel_error"] < 1e-5 and set(good["per_phase"]) == {"prefill", "catch_up", "tree"}
    other = load_eagle(w.path, hidden_size=w.config["hidden_size"], vocab_size=len(embed), num_layers=12)
    other.tensors["midlayer.self_attn.v_proj.weight"] *= 1.5
    assert head_parity(other, embed, None, io=io, onnx_path=path, tokens=tokens, features=feats)["max_rel_error"] > 1e-3
    feeds = EagleIO.feeds

    def every_row_visible(self, tokens, **kw):
        if kw.get("mask") is not None:
            kw["mask"] = np.ones_like(kw["mask"])
        return feeds(self, tokens, **kw)

    monkeypatch.setattr(EagleIO, "feeds", every_row_visible)
    bad = head_parity(w, embed, None, io=io, onnx_path=path, tokens=tokens, features=feats)
    assert bad["per_phase"]["tree"] > 1e-3 and bad["per_phase"]["catch_up"] < 1e-5


# -- builds ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle_builds(tiny_root, tiny_checkpoints, tokenizer, write_yaml, run_build):
    from specexport.builder.stages import eagle as eagle_stage
    from specexport.export.tiny import make_tiny_checkpoint

    patch = pytest.MonkeyPatch()
    patch.setattr(eagle_stage, "AUTO_PROMPTS", 2)          # tree: auto's decoding, shortened (suite time)
    patch.setattr(eagle_stage, "AUTO_CANDIDATES", ((1, 3, 3), (2, 4, 7), (4, 5, 15)))
    root = tiny_root / "eagle"
    deep = make_tiny_checkpoint(root / "ckpt4", "llama", num_layers=4, seed=2, tokenizer=tokenizer)
    out = {}
    (root / "prompts.jsonl").write_text('"def f(x):"\n"import os"\n"class A:"\n')
    try:
        for name, target, write in [("e1", tiny_checkpoints["llama"], lambda f, t: write_eagle1(f, t)),
                                    ("e3", deep, lambda f, t: write_eagle3(f, t))]:
            write(root / "heads" / name, target)
            prompts = {"prompts": root / "prompts.jsonl"} if name == "e1" else {}       # tree: auto decodes these
            yaml = write_yaml(root / f"{name}.yaml", name=name, target={"path": target},
                              eagle={"path": root / "heads" / name, "top_k": 6, **prompts}, max_seq_len=128,
                              output=root / "build" / name)
            assert run_build(yaml) == 0
            out[name] = root / "build" / name
        # explicit layer ids (a repeated one again), rebuilt into a copy of e3: the target graph is reused
        write_eagle3(root / "heads" / "e3x", deep, layers=[1, 1, 2], seed=3)
        shutil.copytree(out["e3"], root / "build" / "e3x")
        yaml = write_yaml(root / "e3x.yaml", name="e3x", target={"path": deep},
                          eagle={"path": root / "heads" / "e3x", "top_k": 6}, max_seq_len=128, output=root / "build" / "e3x")
        assert run_build(yaml) == 0
        out["e3x"] = root / "build" / "e3x"
    finally:
        patch.undo()
    return out


def test_builds_record_the_head_its_check_and_the_auto_tree(eagle_builds):
    from specexport.manifest import listed_files, read_manifest
    from specexport.plugins import cpu

    expected = {"e1": (1, [], None, []), "e3": (3, [1, 2, 2], 200, [1, 2]), "e3x": (3, [1, 1, 2], 200, [1, 2])}
    for name, (version, layers, vocab, target_layers) in expected.items():
        m = read_manifest(eagle_builds[name])
        e = m["heads"]["eagle"]
        assert (e["version"], e["aux_layers"], e["draft_vocab"], e["top_k"]) == (version, layers, vocab, 6), name
        assert m["models"]["target"]["io"]["aux_hidden_layers"] == target_layers
        assert (e["target_ids"] is None) == (version == 1) and (vocab is None or len(e["target_ids"]) == vocab)
        stage = e["precisions"]["fp32"]
        assert stage["parity_max_rel_error"] <= stage["parity_tolerance"] and stage["parity_rows"] > 10
        # a target on the CPU kernels (gguf, where they load, the heads' size allowing) runs its head on our
        # attention, and the build checks that graph too; fp32 targets (these) never compile the kernels
        gguf = "gguf" in m["models"]["target"]["precisions"]
        ours = gguf and cpu.status().available and e["io"]["head_dim"] % 8 == 0
        assert not ours
        assert ("tree, our attention" in stage["parity_per_phase"]) == ours, (name, stage["parity_per_phase"])
        auto = e["auto_tree"]
        assert len(auto["candidates"]) == 3 and auto["predicted_speedup"] == max(c["predicted_speedup"]
                                                                                for c in auto["candidates"])
        assert ("eagle.prompts" in auto["text"]) == (name == "e1") and auto["prompts"] == 2
        assert all(f in listed_files(m) for f in stage["files"])
    old = read_manifest(eagle_builds["e3"])["models"]["target"]["precisions"]["fp32"]["dir"]
    assert read_manifest(eagle_builds["e3x"])["models"]["target"]["precisions"]["fp32"]["dir"] == old


VANILLA: dict = {}


@pytest.mark.parametrize("name,tree", [("e1", None), ("e1", "small"), ("e3", None), ("e3", {"top_k": 3, "depth": 4}),
                                       ("e3x", "dynamic")], ids=["e1-auto", "e1-static", "e3-auto", "e3-dynamic",
                                                                 "e3x-defaults"])
def test_eagle_greedy_equals_vanilla_on_exported_targets(eagle_builds, name, tree):
    import specexport

    with specexport.load(eagle_builds[name]) as pipe:
        assert "eagle" in pipe.methods
        rng = np.random.default_rng(5)
        accepted = deep = 0
        for i in range(12):
            prompt = rng.integers(3, pipe.target.vocab_size, size=int(rng.integers(1, 16))).tolist()
            if (name, i) not in VANILLA:
                VANILLA[name, i] = pipe.generate(prompt_ids=prompt, max_new_tokens=80, method="vanilla").token_ids
            out = pipe.generate(prompt_ids=prompt, max_new_tokens=80, method="eagle", tree=tree)
            assert out.token_ids == VANILLA[name, i], i
            accepted += out.stats.accepted
            deep += int(out.stats.accepted_at[1:].sum())
        assert accepted > 0, accepted
        if tree is not None:        # tree: auto may rightly pick a chain these heads rarely extend past depth 1
            assert deep > 0, deep   # paths of depth 2 and more were committed


@pytest.mark.parametrize("name", ["e1", "e3"])
def test_seeded_sampled_eagle_emits_vanillas_text(eagle_builds, name):
    """runtime/sampling.Coins: EAGLE's tree verified with the q-free rule emits vanilla's text for the
    same seed at temperature 0.7 (tests/test_seeded_sampling.py)."""
    import specexport

    with specexport.load(eagle_builds[name]) as pipe:
        rng, accepted = np.random.default_rng(7), 0
        for seed in range(6):
            prompt = rng.integers(3, pipe.target.vocab_size, size=8).tolist()
            kw = dict(prompt_ids=prompt, max_new_tokens=50, temperature=0.7, seed=seed)
            out = pipe.generate(method="eagle", tree="dynamic", **kw)
            assert out.token_ids == pipe.generate(method="vanilla", **kw).token_ids, seed
            accepted += out.stats.accepted
        assert accepted > 0


def test_sampled_eagle_matches_the_exported_targets_exact_distribution(eagle_builds):
    """Tokens 1 and 2 after a fixed prompt at temperature 1, top-k 4: the second comes from an EAGLE
    round's verdict. Exact: p(t1) p(t2 | t1) from the target graph."""
    import specexport

    params = SamplingParams(1.0, top_k=4)
    with specexport.load(eagle_builds["e1"]) as pipe:
        prompt = [5, 17, 42, 9, 5, 17]
        target = pipe.target

        def next_probs(ids):
            target.reset()
            return warp(target.forward(np.asarray(ids)).logits[-1].astype(np.float64), params)

        p1 = next_probs(prompt)
        exact = np.zeros((target.vocab_size,) * 2)
        for t in np.flatnonzero(p1):
            exact[t] = p1[t] * next_probs(prompt + [int(t)])
        pairs, proposed, accepted = [], 0, 0
        for seed in np.random.default_rng(6).integers(0, 2**31, 3000):
            out = pipe.generate(prompt_ids=prompt, max_new_tokens=3, method="eagle", tree={"top_k": 3, "depth": 2},
                                temperature=1.0, top_k=4, seed=int(seed))
            pairs.append(out.token_ids[:2])
            proposed, accepted = proposed + out.stats.proposed, accepted + out.stats.accepted
    cells = np.flatnonzero(exact.ravel() > 0)
    counts = counts_of(np.asarray(pairs), exact.shape).ravel()
    fit = goodness_of_fit(counts[cells], exact.ravel()[cells])
    assert counts.sum() == counts[cells].sum(), "a token outside the top-k support was emitted"
    assert fit.pvalue > ALPHA and fit.tv < fit.tv_bound, str(fit)
    assert 0 < accepted < proposed


def test_eagle_errors_and_cli(eagle_builds, built_draft_only, capsys):
    import specexport
    from specexport.cli import main

    with specexport.load(built_draft_only[1]) as pipe:
        with pytest.raises(SpecexportError, match=r"'eagle' was not built \(no EAGLE head in this build\)"):
            pipe.generate("x", method="eagle")
    with specexport.load(eagle_builds["e1"]) as pipe:
        with pytest.raises(SpecexportError, match="tree: unknown keys \\['width'\\]"):
            pipe.generate("x", method="eagle", tree={"width": 3})
        with pytest.raises(SpecexportError, match="needs each node's top 7; the head graph returns its top 6"):
            pipe.generate("x", method="eagle", tree={"top_k": 7})
        with pytest.raises(SpecexportError, match="tree: 20 nodes; the graph verifies at most"):
            pipe.generate("x", method="eagle", tree={"total_tokens": 20})
        with pytest.raises(SpecexportError, match="expected 'dynamic' or 'dynamic:TOP_K/DEPTH/TOTAL_TOKENS'"):
            pipe.generate("x", method="eagle", tree="dynamic:4,5")
    assert main(["generate", str(eagle_builds["e3"]), "def f(x):", "--method", "eagle", "--max-new-tokens", "12"]) == 0
    assert "[eagle]" in capsys.readouterr().err
    assert main(["generate", str(eagle_builds["e3"]), "def f(x):", "--method", "eagle", "--tree",
                 '{"top_k": 2, "depth": 3, "total_tokens": 5}', "--max-new-tokens", "12"]) == 0
    assert main(["inspect", str(eagle_builds["e3"])]) == 0
    assert "eagle" in capsys.readouterr().out
    assert main(["generate", str(eagle_builds["e3"]), "hi", "--chat"]) == 1
    assert "has no chat template" in capsys.readouterr().err


def test_bench_rows_for_eagle(eagle_builds, tmp_path):
    from specexport.report.bench import BenchConfig, run_bench

    report = run_bench(BenchConfig(output_dir=eagle_builds["e3"], prompts=("hello", "a b c"), methods=("vanilla", "eagle"),
                                   eagle_trees=("auto", "small", "dynamic:2/3/5"), gammas=(2,), max_new_tokens=24, rounds=1, threads=1,
                                   peers=False, plots=False, out=tmp_path / "bench"), log=lambda m: None)
    rows = [r for r in report["rows"] if r["method"] == "eagle"]
    assert [r["tree"] for r in rows] == ["auto", "small", "dynamic:2/3/5"] and rows[2]["gamma"] == 3
    assert all(r["ideal_speedup"] and r["mean_accepted_tokens"] >= 1 and r["draft_step_ratio"] for r in rows)
    assert "fp32/eagle" in report["step_costs_ms"] and report["step_costs_ms"]["fp32/eagle"]["draft"]


def test_bench_samples_at_a_temperature(eagle_builds, tmp_path):
    """--temperature 0.7: every row samples (lossless, so vanilla and EAGLE rows are comparable in speed and
    acceptance), nothing greedy-only is stored in the manifest."""
    from specexport.manifest import read_manifest
    from specexport.report.bench import BenchConfig, run_bench

    before = {k: read_manifest(eagle_builds["e1"]).get(k) for k in ("gamma_auto", "method_auto")}
    report = run_bench(BenchConfig(output_dir=eagle_builds["e1"], prompts=("hello", "a b c"), methods=("vanilla", "eagle"),
                                   gammas=(2,), max_new_tokens=24, rounds=1, threads=1, temperature=0.7,
                                   plots=False, out=tmp_path / "bench"), log=lambda m: None)
    assert report["settings"]["temperature"] == 0.7 and not report["settings"]["greedy"]
    assert report["peers"] == [{"peer": "all", "skipped": "peers run greedy; this bench samples"}]
    assert report["gamma_store"][0].startswith("not stored: this bench sampled at temperature 0.7")
    assert {k: read_manifest(eagle_builds["e1"]).get(k) for k in ("gamma_auto", "method_auto")} == before
    eagle = next(r for r in report["rows"] if r["method"] == "eagle")
    assert eagle["speedup_vs_vanilla"] and eagle["mean_accepted_tokens"] >= 1
    assert "sampled at temperature 0.7" in (tmp_path / "bench" / "report.md").read_text()
