"""The export cache ($SPECEXPORT_EXPORT_CACHE, builder/export_cache.py): a graph exported once is taken from the
cache by a build that exports the same model again, byte for byte the same, and decodes the same; a changed
weight or config is a new entry; a damaged entry is exported again and replaced; off, nothing is written."""
from __future__ import annotations

import json

import pytest
import torch

import specexport
from specexport.builder import export_cache
from specexport.cli import main
from specexport.export.tiny import make_tiny_checkpoint
from specexport.manifest import read_manifest

PROMPT = [1, 5, 9, 13]


@pytest.fixture
def exports(monkeypatch, tmp_path):
    """A fresh cache folder, and the list of the real torch.onnx.export calls made (each counted, each run)."""
    monkeypatch.setenv(export_cache.ENV, str(tmp_path / "cache"))
    calls, real = [], torch.onnx.export

    def counted(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", counted)
    return calls


def _build(write_yaml, folder, ckpt, capsys, precisions=("fp32", "int8")) -> tuple[dict, str]:
    path = write_yaml(folder / "model.yaml", name="cached", target={"path": ckpt}, max_seq_len=64,
                      precisions=list(precisions), quality_gates={"int8": {"min_top1": 0.5, "max_kl": 1.0}},
                      output=folder / "out")
    capsys.readouterr()
    assert main(["build", str(path), "--no-bench"]) == 0
    return read_manifest(folder / "out"), capsys.readouterr().err


def _graph_bytes(out, manifest) -> dict:
    entry = manifest["models"]["target"]["precisions"]["fp32"]
    return {f: (out / entry["dir"] / f).read_bytes() for f in ("model.onnx", "model.onnx.data")}


def _greedy(out) -> list[int]:
    with specexport.load(out, precision="int8") as pipe:
        return pipe.generate(prompt_ids=PROMPT, max_new_tokens=8, method="vanilla").token_ids


def test_a_model_exported_again_takes_the_same_graph_from_the_cache(exports, tiny_checkpoints, tokenizer, tmp_path,
                                                                    write_yaml, capsys):
    first, err = _build(write_yaml, tmp_path / "a", tiny_checkpoints["llama-draft"], capsys)
    assert len(exports) == 2 and "export cache" not in err          # the fp32 graph and the weightless one
    second, err = _build(write_yaml, tmp_path / "b", tiny_checkpoints["llama-draft"], capsys)
    assert len(exports) == 2, exports                                # nothing exported again
    assert "target fp32: the graph from the export cache" in err
    assert "target: the weightless graph from the export cache" in err
    assert _graph_bytes(tmp_path / "a" / "out", first) == _graph_bytes(tmp_path / "b" / "out", second)
    assert _greedy(tmp_path / "a" / "out") == _greedy(tmp_path / "b" / "out")
    # another weight, same config: a new fp32 graph; the weightless graph is the config's alone
    other = make_tiny_checkpoint(tmp_path / "other", "llama", seed=1, num_layers=1, tokenizer=tokenizer)
    _, err = _build(write_yaml, tmp_path / "c", other, capsys)
    assert len(exports) == 3 and "target fp32: the graph from the export cache" not in err
    assert "target: the weightless graph from the export cache" in err


def test_a_damaged_entry_is_exported_again_and_replaced(exports, tiny_checkpoints, tmp_path, write_yaml, capsys):
    _build(write_yaml, tmp_path / "a", tiny_checkpoints["llama-draft"], capsys, precisions=["fp32"])
    cache = export_cache.folder()
    entry = next(p for p in cache.iterdir() if p.name.startswith("fp32-"))
    data = entry / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    manifest, err = _build(write_yaml, tmp_path / "b", tiny_checkpoints["llama-draft"], capsys, precisions=["fp32"])
    assert len(exports) == 2 and "target fp32: the graph from the export cache" not in err
    assert export_cache._verified(entry) is not None                 # replaced by the fresh export, whole
    assert manifest["models"]["target"]["precisions"]["fp32"]["parity_max_rel_error"] < 1e-4
    # an entry that cannot be cleared (its index unreadable, a file not ours in it): the build still succeeds,
    # the graph is not kept, and the foreign file stays
    (entry / export_cache.INDEX).write_text("not json")
    (entry / "mine.txt").write_text("a user's file")
    _, err = _build(write_yaml, tmp_path / "c", tiny_checkpoints["llama-draft"], capsys, precisions=["fp32"])
    assert len(exports) == 3 and (entry / "mine.txt").read_text() == "a user's file"
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []           # no temporary folder left


def test_the_key_is_the_content_not_the_folder(tiny_checkpoints, monkeypatch, tmp_path):
    from specexport.builder.plan import plan_build
    from specexport.config import load_config
    from specexport.export.to_onnx import load_hf_model

    monkeypatch.setenv(export_cache.ENV, str(tmp_path / "cache"))
    path = tmp_path / "model.yaml"
    path.write_text(json.dumps({"name": "k", "target": {"path": str(tiny_checkpoints["llama-draft"])},
                                "max_seq_len": 64, "output": str(tmp_path / "out")}))
    mp = plan_build(load_config(path)).target
    model = load_hf_model(tiny_checkpoints["llama-draft"])
    key = export_cache.graph_key("fp32", mp, model.config, name="model.onnx", weights=model)
    model.config._name_or_path = "/somewhere/else"
    assert export_cache.graph_key("fp32", mp, model.config, name="model.onnx", weights=model) == key
    assert export_cache.graph_key("fp32", mp, model.config, name="other.onnx", weights=model) != key
    eps = model.config.rms_norm_eps
    model.config.rms_norm_eps = eps * 2
    assert export_cache.graph_key("fp32", mp, model.config, name="model.onnx", weights=model) != key
    model.config.rms_norm_eps = eps
    assert export_cache.graph_key("fp32", mp, model.config, name="model.onnx", weights=model) == key
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1e-3
    assert export_cache.graph_key("fp32", mp, model.config, name="model.onnx", weights=model) != key
    monkeypatch.delenv(export_cache.ENV)
    assert export_cache.graph_key("fp32", mp, model.config, name="model.onnx", weights=model) is None
    assert export_cache.fetch(None, tmp_path / "model.onnx") is None
    export_cache.store(None, tmp_path, ["model.onnx"])
    assert not (tmp_path / "cache").exists()
