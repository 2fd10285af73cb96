"""Artifacts that are checked and builds that never lose a working output.

- `inspect --verify` names every file whose content differs from the manifest; loading names a
  truncated or missing file in one line; ONNX Runtime and manifest problems are one-line errors.
- A build holds the output folder's lock: a second build fails at once, and a killed holder
  releases it.
- `specexport build` killed (SIGKILL, in a subprocess) at several points leaves the previous build
  loadable and decoding as before (or, for a first build, no manifest), and the next build completes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specexport
from specexport.cli import main
from specexport.manifest import file_problems, listed_files, read_manifest, stage_dir

PROMPT = [1, 5, 9, 13]


@pytest.fixture
def build_copy(built_draft_only, tmp_path):
    """A copy of the cheapest finished build, and its greedy output for PROMPT."""
    _, finished = built_draft_only
    out = tmp_path / "b"
    shutil.copytree(finished, out)
    return out


def _greedy(out: Path, n: int = 8) -> list[int]:
    with specexport.load(out) as pipe:
        return pipe.generate(prompt_ids=PROMPT, max_new_tokens=n, method="vanilla").token_ids


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i:i + 8] = bytes(b ^ 0xFF for b in data[i:i + 8])
    path.write_bytes(bytes(data))


# -- checked artifacts -------------------------------------------------------------------------------
def test_inspect_verify_names_each_file_that_differs(build_copy, capsys):
    out = build_copy
    manifest = read_manifest(out)
    assert main(["inspect", str(out), "--verify"]) == 0
    assert f"verified: {len(listed_files(manifest))} files" in capsys.readouterr().out
    weights = stage_dir(out, manifest, "target", "fp32") / "model.onnx.data"
    size = weights.stat().st_size
    _flip(weights)
    assert weights.stat().st_size == size                    # same size: only the hash can tell
    tokenizer = out / manifest["tokenizer"]["dir"] / "tokenizer_config.json"
    tokenizer.unlink()
    assert main(["inspect", str(out), "--verify"]) == 1
    err = capsys.readouterr().err
    assert f"{weights}: content differs from the build (sha256 mismatch)" in err
    assert f"{tokenizer}: missing" in err
    assert "error: 2 of" in err and "Traceback" not in err


def test_truncated_or_missing_weights_fail_load_with_one_line_naming_the_file(build_copy, capsys):
    out = build_copy
    weights = stage_dir(out, read_manifest(out), "target", "fp32") / "model.onnx.data"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert main(["generate", str(out), "x", "--max-new-tokens", "2"]) == 1
    line = _one_error_line(capsys)
    assert f"{weights}: truncated ({size // 2} bytes, the manifest says {size})" in line and "--verify" in line
    weights.unlink()
    assert main(["generate", str(out), "x", "--max-new-tokens", "2"]) == 1
    assert f"{weights}: missing" in _one_error_line(capsys)


def test_flipped_bytes_are_caught_by_verify_on_load(build_copy, capsys):
    out = build_copy
    weights = stage_dir(out, read_manifest(out), "target", "fp32") / "model.onnx.data"
    _flip(weights)
    with pytest.raises(specexport.errors.SpecexportError, match="sha256 mismatch"):
        specexport.load(out, verify=True)


def test_a_corrupt_graph_is_a_one_line_onnx_runtime_error(build_copy, capsys):
    out = build_copy
    graph = stage_dir(out, read_manifest(out), "target", "fp32") / "model.onnx"
    size = graph.stat().st_size
    graph.write_bytes(os.urandom(size))                      # same size: passes the cheap check
    meta = json.loads((out / "manifest.json").read_text())
    assert main(["generate", str(out), "x", "--max-new-tokens", "2"]) == 1
    line = _one_error_line(capsys)
    assert f"{graph}: ONNX Runtime could not load it" in line and meta["name"]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("max_seq_len"), "max_seq_len: missing key"),
    (lambda m: m["models"]["target"]["precisions"]["fp32"].pop("files"), "models.target.precisions.fp32.files: missing"),
    (lambda m: m["models"]["target"].__setitem__("vocab_size", "many"), "models.target.vocab_size: expected int"),
    (lambda m: m.__setitem__("tokenizer", []), "tokenizer: expected an object"),
    (lambda m: m.__setitem__("schema_version", 1), "schema_version 1 is not supported"),
])
def test_manifest_structure_is_validated_on_load(build_copy, capsys, edit, message):
    path = build_copy / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))
    for argv in (["generate", str(build_copy), "x"], ["bench", str(build_copy), "--no-peers"],
                 ["inspect", str(build_copy)]):
        assert main(argv) == 1
        assert message in _one_error_line(capsys)


@pytest.mark.parametrize("command", [["generate", "{d}", "x"], ["bench", "{d}"], ["inspect", "{d}"],
                                     ["inspect", "{d}", "--verify"]])
def test_a_folder_that_is_not_a_build(tmp_path, capsys, command):
    argv = [a.format(d=tmp_path) for a in command]
    assert main(argv) == 1
    assert "not a finished specexport build" in _one_error_line(capsys)
    assert main([*argv, "-v"]) == 1
    assert "Traceback" in capsys.readouterr().err               # -v adds the traceback


def test_generate_with_unknown_precision_or_method_is_one_line(build_copy, capsys):
    assert main(["generate", str(build_copy), "x", "--precision", "fp8"]) == 1
    assert "precision: 'fp8' was not built" in _one_error_line(capsys)
    assert main(["generate", str(build_copy), "x", "--method", "hydra"]) == 1
    assert "method: 'hydra' is not supported" in _one_error_line(capsys)
    assert main(["generate", str(build_copy), "x", "--method", "eagle"]) == 1
    assert "method: 'eagle' was not built (no EAGLE head in this build)" in _one_error_line(capsys)
    assert main(["generate", str(build_copy), "x", "--method", "medusa"]) == 1
    assert "method: 'medusa' was not built (no Medusa heads in this build)" in _one_error_line(capsys)


# -- one build at a time -----------------------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
from specexport.locking import output_lock
with output_lock(Path(sys.argv[1]), purpose="specexport build"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_build_into_the_same_folder_fails_at_once_and_a_dead_holder_frees_it(
        built_draft_only, tmp_path, capsys):
    yaml_path, finished = built_draft_only
    out = tmp_path / "b"
    shutil.copytree(finished, out)
    cfg = json.loads((out / "manifest.json").read_text())["config"]
    import yaml

    raw = {"name": "locked", "target": {"path": cfg["target"]["path"]}, "max_seq_len": cfg["max_seq_len"],
           "output": str(out)}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(raw))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        assert main(["build", str(path), "--no-bench"]) == 1
        assert time.monotonic() - start < 10
        line = _one_error_line(capsys)
        assert f"output: {out} is in use by another specexport process (specexport build, pid {holder.pid}" in line
    finally:
        holder.send_signal(signal.SIGKILL)                  # dies holding the lock
        holder.wait()
    assert main(["build", str(path), "--no-bench"]) == 0
    assert read_manifest(out)["name"] == "locked"


# -- builds killed at several points -----------------------------------------------------------------
def _kill_build_at(yaml_path: Path, line_number: int, *extra: str) -> list[str]:
    """Run `specexport build` in a subprocess and SIGKILL it when its `line_number`-th progress line
    (the "✓ ..." lines) appears; returns the progress lines seen."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "specexport", "build", str(yaml_path), "--no-bench", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    seen = []
    try:
        for line in proc.stderr:
            if line.startswith("✓"):
                seen.append(line.strip())
                if len(seen) == line_number:
                    proc.send_signal(signal.SIGKILL)
                    break
    finally:
        proc.kill()
        proc.wait()
    return seen


def _assert_whole_and_decoding(out: Path, expected: list[int]) -> None:
    manifest = read_manifest(out)
    assert file_problems(out, listed_files(manifest), hashes=True) == []
    assert _greedy(out) == expected


@pytest.fixture
def two_stage_yaml(tiny_checkpoints, tmp_path, write_yaml):
    """A target + draft build with an int8 precision: nine progress lines, several stages to kill in."""
    return write_yaml(tmp_path / "model.yaml", name="killed", target={"path": tiny_checkpoints["llama-draft"]},
                      draft={"path": tiny_checkpoints["llama-draft"]}, max_seq_len=64, precisions=["fp32", "int8"],
                      quality_gates={"int8": {"min_top1": 0.5, "max_kl": 1.0}}, output=tmp_path / "out")


def test_a_build_killed_anywhere_leaves_the_previous_build_decoding(two_stage_yaml, tmp_path, capsys):
    out = tmp_path / "out"
    # a first build killed in its first stage: no manifest at all (nothing that looks valid)
    assert len(_kill_build_at(two_stage_yaml, 1)) == 1
    assert not (out / "manifest.json").exists()
    capsys.readouterr()
    assert main(["build", str(two_stage_yaml), "--no-bench"]) == 0
    n = sum(line.startswith("✓") for line in capsys.readouterr().err.splitlines())     # progress lines
    expected = _greedy(out)
    previous = (out / "manifest.json").read_text()
    for k in sorted({1, n // 2, n - 1, n}):      # the first export, the middle, the last stages
        lines = _kill_build_at(two_stage_yaml, k, "--force")
        assert len(lines) == k, lines
        if k < n:                      # before the last stage ended the manifest cannot have changed
            assert (out / "manifest.json").read_text() == previous, f"killed after {lines[-1]!r}: manifest changed"
        else:                          # killed at the very end: the old manifest or the new, whole one
            assert lines[-1].startswith("✓ copy tokenizer")
        _assert_whole_and_decoding(out, expected)
    assert main(["build", str(two_stage_yaml), "--force", "--no-bench"]) == 0
    manifest = read_manifest(out)
    assert manifest["build_id"] != json.loads(previous)["build_id"]
    _assert_whole_and_decoding(out, expected)
    on_disk = {f"{role}/{p.name}" for role in ("target", "draft") for p in (out / role).iterdir()}
    assert on_disk == {e["dir"] for m in manifest["models"].values() for e in m["precisions"].values()}
    assert [p.name for p in out.iterdir() if p.name.startswith(("tokenizer", ".tokenizer"))] == \
        [manifest["tokenizer"]["dir"]]
    assert not list(out.rglob("*.partial"))
