"""A build, a trainer or an export never removes or replaces what it did not write (issue 22).

The layouts a new user makes: checkpoints beside the model.yaml with `output: .`, an output folder that
already holds the user's files (some named like the build's own), trainer `--out` folders with the
user's files in them. Every user file is compared by sha256 before and after."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specexport import owned
from specexport.cli import main
from specexport.manifest import read_manifest


def _hashes(root) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _fill(root, files: dict) -> dict:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in files.items()}


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def proj(tiny_checkpoints, tmp_path):
    """The README-shaped project: proj/model.yaml beside proj/target and proj/draft (copies)."""
    root = tmp_path / "proj"
    shutil.copytree(tiny_checkpoints["llama-draft"], root / "target")
    shutil.copytree(tiny_checkpoints["llama-draft"], root / "draft")
    return root


def _yaml(write_yaml, root, output, **extra):
    return write_yaml(root / "model.yaml", name="p", target={"path": "target"}, draft={"path": "draft"},
                      max_seq_len=64, output=str(output), **extra)


@pytest.mark.parametrize("output", [".", "target", "target/engines", "..", "draft/out"])
def test_an_output_holding_or_inside_an_input_is_refused_before_anything_is_written(proj, write_yaml, capsys,
                                                                                    output):
    path = _yaml(write_yaml, proj, output)
    before = _hashes(proj.parent)
    assert main(["build", str(path), "--no-bench"]) == 1
    line = _one_error_line(capsys)
    assert "output:" in line and ("contains" in line or "lies inside" in line)
    assert ("target.path" in line or "draft.path" in line) and str(proj) in line
    assert _hashes(proj.parent) == before                       # byte for byte, nothing added
    assert sorted(p.name for p in proj.iterdir()) == ["draft", "model.yaml", "target"]


def test_a_prefilled_output_builds_and_every_user_file_survives(proj, write_yaml, tmp_path, capsys):
    out = tmp_path / "out"
    user = _fill(out, {"target/notes/mine.txt": "a", "target/fp32-old.txt": "b", "target/fp32-deadbeef/keep.txt": "c",
                       "draft/x.txt": "d", "README.md": "e", "tokenizer-1234abcd/vocab.txt": "f",
                       ".manifest.json.tmp1": "g", "target/.fp32-1234abcd.partial/w.bin": "h"})
    path = _yaml(write_yaml, proj, out)
    inputs = _hashes(proj)
    assert main(["build", str(path), "--no-bench"]) == 0
    assert main(["build", str(path), "--no-bench", "--force"]) == 0      # a rebuild removes the first build's
    err = capsys.readouterr().err
    assert "left alone (not written by specexport build):" in err and "target/fp32-deadbeef" in err
    after = _hashes(out)
    assert {rel: after.get(rel) for rel in user} == user
    assert _hashes(proj) == inputs
    manifest = read_manifest(out)
    stages = {e["dir"] for m in manifest["models"].values() for e in m["precisions"].values()}
    ours = {f"{r}/{p.name}" for r in ("target", "draft") for p in (out / r).iterdir() if owned.is_owned(p)}
    assert ours == stages                                     # the first build's stage folders are gone


def test_a_build_from_before_markers_is_cleaned_by_its_manifest_only(built_draft_only, tmp_path):
    yaml_path, finished = built_draft_only
    out = tmp_path / "old"
    shutil.copytree(finished, out)
    for marker in out.rglob(owned.MARKER):                   # as a specexport from before markers wrote it
        marker.unlink()
    shutil.rmtree(out / ".specexport")
    old_dir = read_manifest(out)["models"]["target"]["precisions"]["fp32"]["dir"]
    _fill(out, {f"{old_dir}/mine.txt": "user"})
    raw = json.loads((out / "manifest.json").read_text())["config"]
    import yaml

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"name": "old", "target": {"path": raw["target"]["path"]},
                                    "max_seq_len": raw["max_seq_len"], "output": str(out)}))
    assert main(["build", str(path), "--no-bench", "--force"]) == 0
    assert sorted(p.name for p in (out / old_dir).iterdir()) == ["mine.txt"]     # the graph files went, not it
    assert read_manifest(out)["models"]["target"]["precisions"]["fp32"]["dir"] != old_dir


def test_a_foreign_manifest_json_is_refused(proj, write_yaml, tmp_path, capsys):
    out = tmp_path / "out"
    _fill(out, {"manifest.json": '{"mine": true}'})
    assert main(["build", str(_yaml(write_yaml, proj, out)), "--no-bench"]) == 1
    assert "is not a specexport manifest" in _one_error_line(capsys)
    assert (out / "manifest.json").read_text() == '{"mine": true}'
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def test_a_checkpoint_that_cannot_be_loaded_is_one_line_naming_it(proj, write_yaml, tmp_path, capsys):
    (proj / "target" / "model.safetensors").write_bytes(b"not safetensors")
    assert main(["build", str(_yaml(write_yaml, proj, tmp_path / "out")), "--no-bench"]) == 1
    line = _one_error_line(capsys)
    assert str(proj / "target") in line and "cannot be loaded" in line


# -- a property test: random user files and folders, names like the build's own ------------------------
_parts = st.sampled_from(["target", "draft", "medusa", "eagle", "fp32-1234abcd", ".fp32-1234abcd.partial", "int8-00",
                          "tokenizer-1a2b3c4d", ".tokenizer-1a2b3c4d.partial-x", "bench", "model.onnx", "notes",
                          ".manifest.json.x", "a.txt"])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(files=st.lists(st.lists(_parts, min_size=1, max_size=3).map("/".join), min_size=1, max_size=8, unique=True))
def test_random_user_files_survive_a_rebuild(built_draft_only, tmp_path_factory, files):
    yaml_path, finished = built_draft_only
    out = tmp_path_factory.mktemp("prefilled")
    shutil.copytree(finished, out, dirs_exist_ok=True)       # a previous build to replace, and its stages
    user = {}
    for i, rel in enumerate(files):
        path = out / rel
        if path.exists() or any(p.is_file() for p in path.parents) or (out / rel.split("/")[0]) in (
                out / "manifest.json", out / ".specexport"):
            continue
        user.update(_fill(out, {rel: f"user {i}"}))
    raw = json.loads((out / "manifest.json").read_text())["config"]
    import yaml

    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "target": {"path": raw["target"]["path"]},
                                    "max_seq_len": raw["max_seq_len"], "output": str(out)}))
    assert main(["build", str(path), "--no-bench", "--force"]) == 0
    after = _hashes(out)
    assert {rel: after.get(rel) for rel in user} == user


# -- trainers and export-triton ----------------------------------------------------------------------
TRAIN = ["--steps", "2", "--num-prompts", "6", "--new-tokens", "8", "--prompt-tokens", "8", "--batch-size", "2",
         "--device", "cpu"]


@pytest.mark.parametrize("command, extra, outputs", [
    ("train-heads", ["--heads", "1"], {"config.json", "medusa_lm_head.safetensors", "train_report.json"}),
    ("distill-draft", ["--layers", "1"], {"config.json", "model.safetensors", "distill_report.json"}),
])
def test_trainers_refuse_a_foreign_out_and_force_replaces_only_their_files(tiny_checkpoints, corpus, tmp_path,
                                                                         capsys, command, extra, outputs):
    out = tmp_path / "heads"
    user = _fill(out, {"notes.txt": "mine", "mymodel/config.json": "{}", "mymodel/w.bin": "w"})
    args = [command, str(tiny_checkpoints["llama-draft"]), "--out", str(out), "--corpus", str(corpus), *extra, *TRAIN]
    assert main(args) == 1
    line = _one_error_line(capsys)
    assert f"--out: {out} is not empty and was not written by specexport {command}" in line
    assert _hashes(out) == user and not list(tmp_path.glob(".heads.*"))     # nothing trained, nothing written
    assert main([*args, "--force"]) == 0
    after = _hashes(out)
    assert {k: after[k] for k in user} == user and outputs <= set(after)
    report = json.loads((out / next(o for o in outputs if o.endswith("report.json"))).read_text())
    assert report["config"]["force"] is True and isinstance(report["config"]["steps"], int)   # JSON values
    assert main(args) == 0                                    # an earlier output of the same command: no --force
    after = _hashes(out)
    assert {k: after[k] for k in user} == user
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name or ".old-" in p.name]
    capsys.readouterr()
    other = "distill-draft" if command == "train-heads" else "train-heads"
    assert main([other, str(tiny_checkpoints["llama-draft"]), "--out", str(out), "--corpus", str(corpus), *TRAIN]) == 1
    assert f"was written by specexport {command}" in _one_error_line(capsys)


def test_trainer_out_may_not_hold_its_target(tiny_checkpoints, corpus, tmp_path, capsys):
    target = tmp_path / "t"
    shutil.copytree(tiny_checkpoints["llama-draft"], target)
    before = _hashes(target)
    for out in (target, tmp_path):
        assert main(["train-heads", str(target), "--out", str(out), "--corpus", str(corpus), "--force", *TRAIN]) == 1
        assert "--out:" in _one_error_line(capsys)
    assert _hashes(target) == before


def test_export_triton_force_replaces_only_its_own_model_folder(built_llama, tmp_path, capsys):
    repo = tmp_path / "repo"
    user = _fill(repo, {"tiny-llama/config.pbtxt": "theirs", "tiny-llama/1/model.py": "theirs"})
    assert main(["export-triton", str(built_llama), "--out", str(repo), "--force"]) == 1
    assert "was not written by specexport export-triton" in _one_error_line(capsys)
    assert _hashes(repo) == user
    assert main(["export-triton", str(built_llama), "--out", str(repo), "--name", "mine"]) == 0
    _fill(repo, {"mine/README.txt": "added by the user"})
    assert main(["export-triton", str(built_llama), "--out", str(repo), "--name", "mine", "--force"]) == 0
    assert (repo / "mine" / "README.txt").read_text() == "added by the user"
    assert (repo / "mine" / "config.pbtxt").is_file() and not list(repo.glob(".mine.*"))
