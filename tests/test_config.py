"""model.yaml validation: every mistake is one clear line naming the key, before any export work.

Each case is checked twice: through the API (load_config + plan_build raise SpecexportError) and
through the CLI (`specexport build` returns 1 and prints one `error:` line naming the key).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from specexport.cli import main
from specexport.config import load_config
from specexport.errors import SpecexportError
from specexport.builder.plan import plan_build
from specexport.export.tiny import make_tiny_checkpoint, train_tokenizer


@pytest.fixture
def check_error(capsys):
    """check_error(yaml_path, match, key): API raises a one-line error matching `match`; CLI exits 1 with it."""

    def check(path: Path, match: str, key: str) -> str:
        with pytest.raises(SpecexportError, match=match) as info:
            plan_build(load_config(path))
        message = str(info.value)
        assert "\n" not in message, f"error is not one line: {message!r}"
        assert key in message, f"error does not name {key!r}: {message!r}"

        capsys.readouterr()
        assert main(["build", str(path)]) == 1
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, f"expected one error line on stderr, got: {err!r}"
        assert key in lines[0] and re.search(match, lines[0]), lines[0]
        assert "Traceback" not in err
        return lines[0]

    return check


@pytest.fixture
def good(tiny_checkpoints, tmp_path) -> dict:
    """A valid config's fields (target only), building into tmp_path/out."""
    return dict(name="demo", target={"path": tiny_checkpoints["llama"]}, max_seq_len=64, output=tmp_path / "out")


@pytest.fixture
def broken_checkpoint(tiny_checkpoints, tmp_path):
    """broken_checkpoint(edit) -> copy of the llama checkpoint after edit(folder) ran on it."""

    def make(edit) -> Path:
        folder = tmp_path / "broken"
        shutil.copytree(tiny_checkpoints["llama"], folder)
        edit(folder)
        return folder

    return make


@pytest.fixture(scope="module")
def other_tokenizer(tokenizer):
    tok = train_tokenizer(vocab_size=320)
    assert len(tok) != len(tokenizer)
    return tok


# -- the config itself --------------------------------------------------------------------------

def test_valid_config_loads_and_resolves_paths_against_the_yaml_folder(tiny_checkpoints, tmp_path, monkeypatch,
                                                                      write_yaml):
    yaml_dir = tmp_path / "project" / "cfg"
    rel = os.path.relpath(tiny_checkpoints["llama"], yaml_dir)
    path = write_yaml(yaml_dir / "model.yaml", name="demo", target={"path": rel}, max_seq_len=64)
    monkeypatch.chdir(tmp_path)          # not the YAML's folder: relative paths must not depend on the cwd
    cfg = load_config(path)
    assert cfg.target.path == tiny_checkpoints["llama"].resolve()
    assert cfg.output == yaml_dir.resolve() / "engines" / "demo"
    assert cfg.draft is None and cfg.precisions == ("fp32",) and cfg.backends == ("onnxruntime",)
    assert plan_build(cfg).target.arch.model_type == "llama"


def test_yaml_syntax_error_names_the_line(tmp_path, check_error):
    path = tmp_path / "model.yaml"
    path.write_text("name: demo\ntarget: {path: models/t}\nmax_seq_len: 128: 4\n")
    line = check_error(path, r"YAML syntax error at line 3", key="model.yaml")
    assert "mapping values are not allowed" in line


def test_missing_config_file(tmp_path, capsys):
    assert main(["build", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml: no such config file" in capsys.readouterr().err


@pytest.mark.parametrize("edit, match, key", [
    (lambda f: f.update(max_seq_length=64), r"max_seq_length: unknown key; allowed: .*max_seq_len", "max_seq_length"),
    (lambda f: f["target"].update(quant="int4"), r"target\.quant: unknown key; allowed: aux_hidden_layers, path",
     "target.quant"),
    (lambda f: f.pop("max_seq_len"), r"max_seq_len: missing required key", "max_seq_len"),
    (lambda f: f.pop("name"), r"name: missing required key", "name"),
    (lambda f: f.update(target={"aux_hidden_layers": [1]}), r"target\.path: missing required key", "target.path"),
    (lambda f: f.update(max_seq_len=0), r"max_seq_len: expected a positive integer, got 0", "max_seq_len"),
    (lambda f: f.update(max_seq_len="long"), r"max_seq_len: expected a positive integer, got 'long'", "max_seq_len"),
    (lambda f: f.update(max_verify_tokens=1), r"max_verify_tokens: expected 2\.\.max_seq_len \(64\), got 1",
     "max_verify_tokens"),
    (lambda f: f.update(precisions=["bf16"]), r"precisions: 'bf16' is not supported; supported: fp32, int8, int4, fp16, fp8, int8_sq",
     "precisions"),
    pytest.param(lambda f: f.update(backends=["onnxruntime", "tensorrt"]), r"backends: tensorrt: TensorRT is not "
                 r"installed here \(.*\)\. TensorRT engines need an NVIDIA GPU", "TensorRT",
                 marks=pytest.mark.no_trt),    # what a machine without TensorRT says
    (lambda f: f.update(backends=["tpu"]), r"backends: 'tpu' is not supported; supported: onnxruntime, tensorrt",
     "backends"),
    (lambda f: f.update(tensorrt={"attention": "flash"}), r"tensorrt\.attention: expected one of native, plugin, "
     r"got 'flash'", "tensorrt.attention"),
    (lambda f: f.update(eagle={"path": "nowhere"}), r"eagle\.path: nowhere does not exist or is not a folder",
     "eagle.path"),
    (lambda f: f.update(parity_tolerance=-1), r"parity_tolerance: expected a positive number", "parity_tolerance"),
    (lambda f: f.update(name="a/b"), r"name: expected a folder-safe string", "name"),
    (lambda f: f["target"].update(aux_hidden_layers="all"), r"target\.aux_hidden_layers: expected a list",
     "target.aux_hidden_layers"),
    (lambda f: f["target"].update(aux_hidden_layers=[5]), r"target\.aux_hidden_layers: \[5\] out of range for a "
     r"2-layer model", "target.aux_hidden_layers"),
    # Known bug (reported, not fixed here): non-string paths reach Path() and crash with a TypeError traceback.
    (lambda f: f.update(target={"path": 5}), r"target\.path: ", "target.path"),
    (lambda f: f.update(output=5), r"output: ", "output"),
], ids=["unknown-key", "unknown-model-key", "missing-max_seq_len", "missing-name", "missing-path",
        "zero-max_seq_len", "str-max_seq_len", "max_verify_tokens", "precision", "tensorrt-absent", "backend",
        "tensorrt-attention", "eagle-path",
        "tolerance", "name",
        "aux-type", "aux-range", "path-not-a-string", "output-not-a-string"])
def test_bad_keys_and_values(good, tmp_path, write_yaml, check_error, edit, match, key):
    edit(good)
    check_error(write_yaml(tmp_path / "model.yaml", **good), match, key)


def test_top_level_must_be_a_mapping(tmp_path, check_error):
    path = tmp_path / "model.yaml"
    path.write_text("- name: demo\n")
    check_error(path, r"expected a mapping of keys at the top level", key="model.yaml")


# -- the checkpoints -----------------------------------------------------------------------------

def test_path_that_does_not_exist(good, tmp_path, write_yaml, check_error):
    good["target"] = {"path": "models/nope"}
    check_error(write_yaml(tmp_path / "model.yaml", **good),
                r"target\.path: models/nope does not exist or is not a folder", "target.path")


def test_folder_without_config_json(good, tmp_path, write_yaml, check_error, broken_checkpoint):
    folder = broken_checkpoint(lambda f: (f / "config.json").unlink())
    good["draft"] = {"path": folder}
    check_error(write_yaml(tmp_path / "model.yaml", **good), r"draft\.path: .*broken has no config\.json$",
                "draft.path")


def test_folder_without_weights(good, tmp_path, write_yaml, check_error, broken_checkpoint):
    folder = broken_checkpoint(lambda f: (f / "model.safetensors").unlink())
    good["target"] = {"path": folder}
    check_error(write_yaml(tmp_path / "model.yaml", **good), r"target\.path: .*broken has no weights", "target.path")


def test_folder_without_tokenizer(good, tmp_path, write_yaml, check_error, broken_checkpoint):
    folder = broken_checkpoint(lambda f: (f / "tokenizer.json").unlink())
    good["target"] = {"path": folder}
    check_error(write_yaml(tmp_path / "model.yaml", **good), r"target\.path: .*broken has no tokenizer files",
                "target.path")


def test_unsupported_model_type_lists_the_supported_ones(good, tmp_path, write_yaml, check_error,
                                                         broken_checkpoint):
    def to_bert(folder):
        config = json.loads((folder / "config.json").read_text())
        config["model_type"] = "bert"
        (folder / "config.json").write_text(json.dumps(config))

    good["target"] = {"path": broken_checkpoint(to_bert)}
    line = check_error(write_yaml(tmp_path / "model.yaml", **good),
                       r"model_type 'bert' is not supported; supported: llama, mistral, qwen2, qwen3$", "target.path")
    assert "config.json" in line


def test_draft_with_a_different_vocabulary_size(good, tmp_path, write_yaml, check_error, tokenizer, other_tokenizer):
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", num_layers=1, tokenizer=other_tokenizer)
    good["draft"] = {"path": draft}
    check_error(write_yaml(tmp_path / "model.yaml", **good),
                rf"draft\.path: vocab_size {len(other_tokenizer)} differs from the target's {len(tokenizer)}",
                "draft.path")


def test_draft_with_a_different_tokenizer_of_the_same_vocab_size(good, tmp_path, write_yaml, check_error, tokenizer,
                                                                 other_tokenizer):
    # The model's vocab_size matches the target's, but its tokenizer is another one.
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", num_layers=1, tokenizer=other_tokenizer,
                                 vocab_size=len(tokenizer))
    good["draft"] = {"path": draft}
    check_error(write_yaml(tmp_path / "model.yaml", **good),
                rf"draft\.path: tokenizer differs from the target's \(target {len(tokenizer)} tokens, "
                rf"draft {len(other_tokenizer)} tokens", "draft.path")


def test_max_seq_len_above_max_position_embeddings(good, tmp_path, write_yaml, check_error):
    good["max_seq_len"] = 1000           # the tiny checkpoints have max_position_embeddings 512
    check_error(write_yaml(tmp_path / "model.yaml", **good),
                r"max_seq_len: 1000 exceeds target \(llama\) max_position_embeddings \(512\)", "max_seq_len")


def test_output_that_cannot_be_written(good, tmp_path, write_yaml, check_error):
    (tmp_path / "somefile.txt").write_text("not a folder")
    good["output"] = "somefile.txt/sub"      # root ignores chmod, but nothing can create a folder under a file
    check_error(write_yaml(tmp_path / "model.yaml", **good), r"output: .*somefile\.txt exists and is not a folder",
                "output")


# -- the build command ---------------------------------------------------------------------------

def test_parity_failure_exits_2_and_keeps_the_previous_build(built_draft_only, tmp_path, write_yaml, capsys):
    import specexport

    yaml_path, finished = built_draft_only
    out = tmp_path / "out"
    shutil.copytree(finished, out)           # a finished build is there: the failed rebuild must not touch it
    before = (out / "manifest.json").read_text()
    expected = specexport.load(out).generate(prompt_ids=[1, 5, 9], max_new_tokens=8, method="vanilla").token_ids
    cfg = load_config(yaml_path)
    path = write_yaml(tmp_path / "model.yaml", name="demo", target={"path": cfg.target.path},
                      max_seq_len=cfg.max_seq_len, output=out, parity_tolerance=1.0e-30)
    capsys.readouterr()
    assert main(["build", str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "parity" in lines[0] and "target fp32" in lines[0], err
    assert (out / "manifest.json").read_text() == before
    assert not list(out.rglob("*.partial"))
    manifest = json.loads(before)
    assert sorted(p.name for p in (out / "target").iterdir()) == [manifest["models"]["target"]["precisions"]
                                                                  ["fp32"]["dir"].split("/")[1]]
    got = specexport.load(out).generate(prompt_ids=[1, 5, 9], max_new_tokens=8, method="vanilla").token_ids
    assert got == expected


def test_dry_run_builds_nothing(good, tmp_path, write_yaml, capsys):
    path = write_yaml(tmp_path / "model.yaml", **good)
    capsys.readouterr()
    assert main(["build", str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "plan" in err and "target" in err and "llama" in err
    assert not (good["output"] / "manifest.json").exists()
    assert not good["output"].exists()
