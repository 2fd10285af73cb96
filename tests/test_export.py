"""Export side: adapters, exported graphs against the Hugging Face models, the manifest, reruns, inspect.

Every graph check runs the exported model.onnx in ONNX Runtime, feeding back the K/V the graph itself
produced, and compares against the unmodified HF model on the equivalent full token sequence:
    rel error = max|graph - HF| / max|HF| <= 1e-4
"""
from __future__ import annotations

import json
import os
import re
import shutil
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from specexport.cli import main
from specexport.config import load_config
from specexport.errors import SpecexportError
from specexport.export.arch import arch_spec_from_hf, check_supported
from specexport.export.registry import adapters
from specexport.export.tiny import TINY_CONFIGS, make_tiny_checkpoint
from specexport.export.validate import ancestor_mask, random_tree
from specexport.io_spec import ModelIO
from specexport.manifest import SCHEMA_VERSION, read_manifest, sha256_file, stage_dir
from close import assert_close

TOL = 1e-4
# (architecture, role) of every exported graph: the llama build also has a draft.
GRAPHS = [(mt, "target") for mt in TINY_CONFIGS] + [("llama", "draft")]
GRAPH_IDS = [f"{mt}-{role}" for mt, role in GRAPHS]


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


_SESSIONS: dict[Path, ort.InferenceSession] = {}


def _session(path: Path) -> ort.InferenceSession:
    """One session per graph file; one thread each (tiny models; idle spinning pools would slow the suite)."""
    if path not in _SESSIONS:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        _SESSIONS[path] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return _SESSIONS[path]


class Graph:
    """An exported model in ONNX Runtime with the committed K/V it produced so far (batch 1 unless told)."""

    def __init__(self, out: Path, role: str):
        manifest = read_manifest(out)
        entry = manifest["models"][role]
        self.io = ModelIO.from_dict(entry["io"])
        self.path = stage_dir(out, manifest, role, "fp32") / "model.onnx"
        assert str(self.path.relative_to(out)) in entry["precisions"]["fp32"]["files"]
        self.session = _session(self.path)
        self.reset()

    def reset(self, batch: int = 1):
        self.past = self.io.empty_caches(batch)          # grown by feeding back each call's caches
        self.past_len = 0

    def run(self, tokens, positions=None, mask=None, *, commit: bool = True, rows=None) -> dict:
        """One call on [B, T] tokens; default positions continue the past, default mask is causal."""
        tokens = np.atleast_2d(np.asarray(tokens, np.int64))
        B, T = tokens.shape
        if positions is None:
            positions = np.arange(self.past_len, self.past_len + T)
        if mask is None:
            mask = np.tril(np.ones((T, T), bool))
        feeds = self.io.feeds(tokens, positions=positions, mask=mask, past=self.past, past_length=self.past_len,
                              rows=rows)
        outs = dict(zip(self.io.output_names, self.session.run(None, feeds)))
        caches = self.io.presents(outs)
        for c, p in zip(caches, self.past):
            assert c.shape == (B, self.io.num_kv_heads, max(p.shape[2], self.past_len + T), self.io.head_dim)
        assert outs["logits"].shape == (B, T if rows is None else len(rows), self.io.vocab_size)
        if commit:
            self.past, self.past_len = caches, self.past_len + T
        return outs


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(checkpoint) -> the HF causal LM in float32 eval mode (loaded once per checkpoint)."""
    cache = {}

    def load(path: Path):
        if path not in cache:
            cache[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return load


def hf_run(model, tokens, **kw):
    with torch.no_grad():
        return model(torch.as_tensor(np.atleast_2d(np.asarray(tokens, np.int64))), **kw)


def checkpoint_of(tiny_checkpoints, model_type: str, role: str) -> Path:
    return tiny_checkpoints["llama-draft" if role == "draft" else model_type]


# -- (1) adapters ---------------------------------------------------------------------------------

def test_every_adapter_has_a_tiny_case():
    registered = set(adapters())
    assert {"llama", "mistral", "qwen2", "qwen3"} <= registered
    assert sorted(registered - set(TINY_CONFIGS)) == [], "adapters without a tiny test checkpoint"
    assert sorted(set(TINY_CONFIGS) - registered) == [], "tiny configs for unregistered model types"


# -- (2) parity per architecture ------------------------------------------------------------------

@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_build_passes_parity_per_architecture(build_arch, model_type):
    manifest = read_manifest(build_arch(model_type))
    roles = ["target", "draft"] if model_type == "llama" else ["target"]
    assert list(manifest["models"]) == roles
    for role in roles:
        model = manifest["models"][role]
        assert model["model_type"] == model_type
        entry = model["precisions"]["fp32"]
        assert 0 <= entry["parity_max_rel_error"] <= TOL
        assert set(entry["parity_per_phase"]) == {"prefill", "prefill_last", "decode", "tree"}
        assert max(entry["parity_per_phase"].values()) == entry["parity_max_rel_error"]
        assert entry["parity_tolerance"] == TOL


# -- (3) dynamic axes -----------------------------------------------------------------------------

# Chunk sizes T per call; together they cover T in {1, 3} at past lengths P in {0, 5, 9}.
SCHEDULES = {"T3-at-P0": [3, 2, 1, 3, 1], "T1-at-P0": [1, 2, 2, 3, 1, 3]}


@pytest.mark.parametrize("schedule", list(SCHEDULES.values()), ids=list(SCHEDULES))
@pytest.mark.parametrize("model_type, role", GRAPHS, ids=GRAPH_IDS)
def test_dynamic_tokens_and_past_match_hf(build_arch, tiny_checkpoints, hf_model, model_type, role, schedule):
    graph = Graph(build_arch(model_type), role)
    model = hf_model(checkpoint_of(tiny_checkpoints, model_type, role))
    seq = np.random.default_rng(len(schedule)).integers(0, graph.io.vocab_size, sum(schedule))
    ref = hf_run(model, seq).logits[0].numpy()                    # [S, V]
    for T in schedule:
        P = graph.past_len
        outs = graph.run(seq[P:P + T])
        err = rel_error(outs["logits"][0], ref[P:P + T])
        assert err <= TOL, f"T={T} P={P}: rel error {err:.2e}"
    assert graph.past_len == len(seq)


def test_schedules_cover_the_required_shapes():
    calls = set()
    for schedule in SCHEDULES.values():
        starts = np.cumsum([0, *schedule[:-1]])
        calls |= {(int(T), int(P)) for T, P in zip(schedule, starts)}
    assert {(T, P) for T in (1, 3) for P in (0, 5, 9)} <= calls


def test_final_hidden_states_match_hf(built_llama, tiny_checkpoints, hf_model):
    graph = Graph(built_llama, "target")
    model = hf_model(tiny_checkpoints["llama"])
    seq = np.random.default_rng(3).integers(0, graph.io.vocab_size, 7)
    with torch.no_grad():
        ref = model.model(torch.as_tensor(seq[None])).last_hidden_state[0].numpy()   # final, post-norm
    first = graph.run(seq[:4])["hidden_states"][0]
    second = graph.run(seq[4:])["hidden_states"][0]
    assert rel_error(np.concatenate([first, second]), ref) <= TOL


def test_batch_of_two_sequences(built_llama, tiny_checkpoints, hf_model):
    graph = Graph(built_llama, "target")
    graph.reset(batch=2)
    model = hf_model(tiny_checkpoints["llama"])
    seq = np.random.default_rng(4).integers(0, graph.io.vocab_size, (2, 6))
    ref = hf_run(model, seq).logits.numpy()                       # [2, 6, V]
    prefill = graph.run(seq[:, :4])["logits"]
    decode = graph.run(seq[:, 4:5])["logits"]
    decode2 = graph.run(seq[:, 5:6])["logits"]
    assert rel_error(np.concatenate([prefill, decode, decode2], axis=1), ref) <= TOL


def test_logits_rows_projects_only_the_rows_asked_for(built_llama):
    """Contract 2: logits_rows picks the rows of the vocabulary projection (the runtime's prefill asks
    for its last row only); hidden states and K/V are those of every row either way."""
    import specexport

    graph = Graph(built_llama, "target")
    seq = np.random.default_rng(5).integers(0, graph.io.vocab_size, (1, 7))
    full = graph.run(seq, commit=False)
    for rows in ([6], [0, 3], [2, 2, 5]):
        part = graph.run(seq, commit=False, rows=rows)
        assert_close(part["logits"][0], full["logits"][0, rows], rel=1e-5,
                     why=f"rows {rows}: the head over some rows vs all, fp32")
        np.testing.assert_array_equal(part["hidden_states"], full["hidden_states"])
    with specexport.load(built_llama) as pipe:
        target = pipe.target
        target.reset()
        prefill = target.forward(seq[0], phase="prefill").logits.copy()
        target.reset()
        decode = target.forward(seq[0]).logits
        assert prefill.shape == (1, graph.io.vocab_size)
        assert_close(prefill[0], decode[-1], rel=1e-5, why="prefill (last row) vs decode phase: other kernels, fp32")


# -- (4) trees ------------------------------------------------------------------------------------

TREES = {
    "fixed": np.array([-1, 0, 0, 1, 1, 2, 3, 5]),                 # branches at 0 and 1, depth up to 4
    "random": random_tree(np.random.default_rng(1), 7),
}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("model_type, role", GRAPHS, ids=GRAPH_IDS)
def test_tree_node_logits_match_hf_on_root_to_node_path(build_arch, tiny_checkpoints, hf_model, model_type, role,
                                                         tree):
    parents = TREES[tree]
    assert any(parents[i] != i - 1 for i in range(1, len(parents))), "a chain would not test the tree mask"
    graph = Graph(build_arch(model_type), role)
    model = hf_model(checkpoint_of(tiny_checkpoints, model_type, role))
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, graph.io.vocab_size, 6)
    nodes = rng.integers(0, graph.io.vocab_size, len(parents))
    graph.run(prefix)                                             # committed prefix, P = 6
    mask = ancestor_mask(parents)
    depth = mask.sum(1) - 1
    logits = graph.run(nodes, positions=len(prefix) + depth, mask=mask, commit=False)["logits"][0]
    for i in range(len(parents)):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        ref = hf_run(model, np.concatenate([prefix, nodes[path[::-1]]])).logits[0, -1].numpy()
        err = rel_error(logits[i], ref)
        assert err <= TOL, f"node {i} (path {path[::-1]}): rel error {err:.2e}"


# -- (5) aux hidden states ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def aux_builds(tiny_root, tokenizer, tiny_checkpoints, write_yaml, run_build):
    """"eagle3" on a 6-layer llama, and an explicit unsorted list on the 2-layer llama."""
    llama6 = make_tiny_checkpoint(tiny_root / "ckpt" / "llama6", "llama", seed=1, num_layers=6, tokenizer=tokenizer)
    builds = {}
    for key, ckpt, aux in (("eagle3", llama6, "eagle3"), ("explicit", tiny_checkpoints["llama"], [1, 0])):
        out = tiny_root / "build" / f"aux-{key}"
        cfg = write_yaml(tiny_root / "yaml" / f"aux-{key}.yaml", name=f"aux-{key}",
                         target={"path": ckpt, "aux_hidden_layers": aux}, max_seq_len=64, output=out)
        assert run_build(cfg) == 0
        builds[key] = (ckpt, out)
    return builds


@pytest.mark.parametrize("key, layers, num_layers", [("eagle3", [2, 3], 6), ("explicit", [0, 1], 2)])
def test_aux_hidden_states_are_the_inputs_of_the_chosen_layers(aux_builds, hf_model, key, layers, num_layers):
    ckpt, out = aux_builds[key]
    manifest = read_manifest(out)
    io_dict = manifest["models"]["target"]["io"]
    assert io_dict["num_layers"] == num_layers
    assert io_dict["aux_hidden_layers"] == layers
    io = ModelIO.from_dict(io_dict)
    H = io.hidden_size
    assert io.spec("aux_hidden_states").axes == ("batch", "tokens", len(layers) * H)
    graph_path = stage_dir(out, manifest, "target", "fp32") / "model.onnx"
    graph_outputs = [o.name for o in onnx.load(str(graph_path), load_external_data=False).graph.output]
    assert graph_outputs == io.output_names and "aux_hidden_states" in graph_outputs

    model = hf_model(ckpt)
    seq = np.random.default_rng(5).integers(0, io.vocab_size, 7)
    captured = {}                       # the definition: what layer i receives as its input
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: captured.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True) for i in layers]
    try:
        hidden = hf_run(model, seq, output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    assert len(hidden) == num_layers + 1
    for i in layers:                    # HF hidden_states[i] (i < N) is the input of layer i
        torch.testing.assert_close(hidden[i], captured[i])
    ref = torch.cat([hidden[i] for i in layers], dim=-1)[0].numpy()            # [S, k*H]

    graph = Graph(out, "target")
    got = np.concatenate([graph.run(seq[:5])["aux_hidden_states"][0],          # prefill P=0
                          graph.run(seq[5:6])["aux_hidden_states"][0],         # decode P=5
                          graph.run(seq[6:7])["aux_hidden_states"][0]])        # decode P=6
    assert got.shape == (len(seq), len(layers) * H)
    for k, i in enumerate(layers):
        err = rel_error(got[:, k * H:(k + 1) * H], ref[:, k * H:(k + 1) * H])
        assert err <= TOL, f"aux slot {k} (input of layer {i}): rel error {err:.2e}"


def test_graph_without_aux_layers_has_no_aux_output(built_llama):
    manifest = read_manifest(built_llama)
    for role in ("target", "draft"):
        assert manifest["models"][role]["io"]["aux_hidden_layers"] == []
        assert "aux_hidden_states" not in Graph(built_llama, role).io.output_names


# -- (6) manifest ---------------------------------------------------------------------------------

def test_manifest_contents(built_llama, tiny_checkpoints, tokenizer):
    out = built_llama
    manifest = read_manifest(out)
    assert manifest["schema_version"] == SCHEMA_VERSION == 4
    assert manifest["name"] == "tiny-llama" and manifest["max_seq_len"] == 128
    for pkg in ("torch", "transformers", "onnx", "onnxruntime"):
        assert manifest["versions"][pkg] == version(pkg)

    expected = {"target": (tiny_checkpoints["llama"], 2), "draft": (tiny_checkpoints["llama-draft"], 1)}
    assert set(manifest["models"]) == set(expected)
    for role, (ckpt, num_layers) in expected.items():
        model = manifest["models"][role]
        assert model["source"] == str(ckpt.resolve())
        assert model["vocab_size"] == len(tokenizer)
        entry = model["precisions"]["fp32"]
        assert re.fullmatch(rf"{role}/fp32-[0-9a-f]{{8}}", entry["dir"])
        assert set(entry["files"]) == {f"{entry['dir']}/model.onnx", f"{entry['dir']}/model.onnx.data"}
        for rel, meta in entry["files"].items():
            assert sha256_file(out / rel) == meta["sha256"], rel
            assert (out / rel).stat().st_size == meta["size"], rel
        assert entry["size_bytes"] == sum(meta["size"] for meta in entry["files"].values())

        io = ModelIO.from_dict(model["io"])
        assert (io.num_layers, io.vocab_size, io.hidden_size, io.num_kv_heads, io.head_dim) == \
            (num_layers, len(tokenizer), 64, 2, 16)
        graph = onnx.load(str(out / entry["dir"] / "model.onnx"), load_external_data=False).graph
        assert [v.name for v in graph.input] == io.input_names
        assert [v.name for v in graph.output] == io.output_names
        assert [t["name"] for t in model["io"]["inputs"]][:3] == ["input_ids", "position_ids", "attention_mask"]
        assert model["special_tokens"]["eos_token_ids"] == [tokenizer.eos_token_id]

    special = manifest["special_tokens"]
    assert special["bos_token_id"] == tokenizer.bos_token_id
    assert special["eos_token_ids"] == [tokenizer.eos_token_id]
    assert "pad_token_id" in special

    tok_dir = out / manifest["tokenizer"]["dir"]
    assert (tok_dir / "tokenizer.json").is_file()
    assert sorted(manifest["tokenizer"]["files"]) == sorted(os.listdir(tok_dir))
    for name, meta in manifest["tokenizer"]["files"].items():
        assert sha256_file(tok_dir / name) == meta["sha256"]
    from tokenizers import Tokenizer

    text = "def dumps(obj, *, indent=None):\n    return obj"
    assert Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text).ids == tokenizer(text)["input_ids"]

    leftovers = [p.name for p in out.rglob("*") if ".partial" in p.name or p.name.startswith(".manifest")]
    assert leftovers == []
    assert sorted(p.name for p in (out / "target").iterdir()) == [Path(manifest["models"]["target"]["precisions"]
                                                                        ["fp32"]["dir"]).name]


# -- (7) reruns -----------------------------------------------------------------------------------

def test_rerun_skips_unchanged_stages_and_force_rebuilds(built_draft_only, tmp_path, write_yaml, run_build):
    yaml_path, finished = built_draft_only
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    cfg = load_config(yaml_path)
    fields = dict(name="rerun", target={"path": cfg.target.path}, max_seq_len=cfg.max_seq_len, output=out)
    path = write_yaml(tmp_path / "model.yaml", **fields)
    def graph():
        manifest = read_manifest(out)
        path = stage_dir(out, manifest, "target", "fp32") / "model.onnx"
        return path, path.stat().st_mtime_ns, manifest

    first, before, _ = graph()
    tokenizer_dir = read_manifest(out)["tokenizer"]["dir"]
    tokenizer_mtime = (out / tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    assert run_build(path) == 0
    assert graph()[:2] == (first, before), "an unchanged stage was rebuilt"
    assert read_manifest(out)["name"] == "rerun"

    assert run_build(path, "--force") == 0
    forced_path, forced, manifest = graph()
    assert forced_path != first and not first.parent.exists(), "--force did not rebuild (or left the old stage)"
    assert sha256_file(forced_path) == manifest["models"]["target"]["precisions"]["fp32"]["files"][
        str(forced_path.relative_to(out))]["sha256"]
    # the tokenizer is rewritten only when its source files changed
    assert manifest["tokenizer"]["dir"] == tokenizer_dir
    assert (out / tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == tokenizer_mtime

    # A changed option that the export depends on is not reused.
    path = write_yaml(tmp_path / "model.yaml", **fields, max_verify_tokens=8)
    assert run_build(path) == 0
    assert graph()[0] not in (first, forced_path)
    assert read_manifest(out)["max_verify_tokens"] == 8


# -- (8) ArchSpec from HF configs -----------------------------------------------------------------

def hf_like(**fields):
    base = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100,
                max_position_embeddings=512)
    base.update(fields)
    return SimpleNamespace(**base)


def test_arch_missing_kv_heads_means_multi_head():
    assert arch_spec_from_hf(hf_like()).num_kv_heads == 4
    assert arch_spec_from_hf(hf_like(num_key_value_heads=None)).num_kv_heads == 4
    assert arch_spec_from_hf(hf_like(num_key_value_heads=2)).num_kv_heads == 2


def test_arch_missing_head_dim_is_hidden_over_heads():
    assert arch_spec_from_hf(hf_like()).head_dim == 16
    assert arch_spec_from_hf(hf_like(head_dim=None)).head_dim == 16
    assert arch_spec_from_hf(hf_like(head_dim=32)).head_dim == 32


@pytest.mark.parametrize("fields, rope_type", [
    ({}, "default"),
    ({"rope_scaling": None}, "default"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "llama3"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "rope_scaling": None}, "yarn"),
], ids=["none", "null", "llama3", "legacy-type-key", "rope_parameters"])
def test_arch_rope_type(fields, rope_type):
    arch = arch_spec_from_hf(hf_like(**fields))
    assert arch.rope_type == rope_type
    check_supported(arch, max_seq_len=64, where="target")


def test_arch_unsupported_rope_type_is_refused():
    arch = arch_spec_from_hf(hf_like(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(SpecexportError, match=r"target: rope type 'dynamic' is not supported; supported: .*llama3"):
        check_supported(arch, max_seq_len=64, where="target")


@pytest.mark.parametrize("fields, window", [
    ({"sliding_window": 4096, "use_sliding_window": False}, None),
    ({"sliding_window": 4096, "use_sliding_window": True}, 4096),
    ({"sliding_window": None, "use_sliding_window": True}, None),
    ({"sliding_window": 4096, "use_sliding_window": True, "layer_types": ["full_attention"] * 2}, None),
    ({"sliding_window": 4096, "use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"]},
     4096),
], ids=["qwen-off", "qwen-on", "no-window", "all-full-layers", "some-sliding-layers"])
def test_arch_qwen_sliding_window(fields, window):
    assert arch_spec_from_hf(hf_like(model_type="qwen2", **fields)).sliding_window == window


def test_arch_sliding_window_smaller_than_max_seq_len_is_refused():
    arch = arch_spec_from_hf(hf_like(model_type="mistral", sliding_window=32))
    check_supported(arch, max_seq_len=32, where="target")
    with pytest.raises(SpecexportError, match=r"max_seq_len: 64 exceeds the sliding window \(32\)"):
        check_supported(arch, max_seq_len=64, where="target")


def test_arch_defaults_for_flags_and_special_tokens():
    arch = arch_spec_from_hf(hf_like())
    assert arch.tie_word_embeddings is True and arch.eos_token_ids == () and arch.bos_token_id is None
    arch = arch_spec_from_hf(hf_like(tie_word_embeddings=False, eos_token_id=[2, 7], bos_token_id=1))
    assert arch.tie_word_embeddings is False and arch.eos_token_ids == (2, 7) and arch.bos_token_id == 1
    assert arch_spec_from_hf(hf_like(eos_token_id=2)).eos_token_ids == (2,)


@pytest.mark.parametrize("model_type, kv_heads, head_dim, tied, rope_type", [
    ("llama", 2, 16, False, "llama3"), ("mistral", 1, 16, True, "default"),
    ("qwen2", 2, 16, True, "default"), ("qwen3", 2, 16, False, "default"),
])
def test_arch_of_the_tiny_checkpoints(tiny_checkpoints, model_type, kv_heads, head_dim, tied, rope_type):
    arch = arch_spec_from_hf(transformers.AutoConfig.from_pretrained(tiny_checkpoints[model_type]))
    assert (arch.model_type, arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings, arch.rope_type) == \
        (model_type, kv_heads, head_dim, tied, rope_type)
    assert arch.sliding_window is None and arch.num_layers == 2 and arch.max_position_embeddings == 512


# -- (9) inspect ----------------------------------------------------------------------------------

def test_inspect_prints_the_models(built_llama, capsys):
    capsys.readouterr()
    assert main(["inspect", str(built_llama)]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama" in out and "target" in out and "draft" in out and "llama" in out

    assert main(["inspect", str(built_llama), "-v"]) == 0
    assert "past_key.1" in capsys.readouterr().out

    assert main(["inspect", str(built_llama), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == read_manifest(built_llama)


def test_inspect_without_manifest_is_a_clear_error(tmp_path, capsys):
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"error: {tmp_path}: no manifest.json" in err and "specexport build" in err
    assert "Traceback" not in err

    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "no such build output folder" in capsys.readouterr().err
