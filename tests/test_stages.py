"""The build as a list of stage values: their order and needs, `--only` rebuilding one stage and keeping
the rest, and the errors it gives."""
from __future__ import annotations

import json
import shutil

from specexport.build.plan import plan_build
from specexport.cli import main
from specexport.config import load_config
from specexport.manifest import read_manifest


def _yaml(tmp_path, built_draft_only, **extra):
    import yaml

    raw = json.loads((built_draft_only[1] / "manifest.json").read_text())["config"]
    fields = {"name": "s", "target": {"path": raw["target"]["path"]}, "max_seq_len": raw["max_seq_len"],
              "output": str(tmp_path / "out"), **extra}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


def test_stages_are_values_in_run_order_with_their_needs(built_draft_only, tmp_path, tiny_checkpoints):
    path = _yaml(tmp_path, built_draft_only, draft={"path": str(tiny_checkpoints["llama-draft"]), "vocab": 64},
                 precisions=["fp32", "int8"])
    stages = plan_build(load_config(path)).stages()
    assert [s.name for s in stages] == ["target/fp32", "target/int8", "draft/vocab", "draft/fp32", "draft/int8",
                                        "kernels", "tokenizer"]          # int8: blocks on our kernels, carried
    needs = {s.name: s.needs for s in stages}
    assert needs["kernels"] == ("target/fp32", "target/int8", "draft/fp32", "draft/int8")
    assert needs["target/int8"] == ("target/fp32",) and needs["draft/vocab"] == ("target/fp32",)
    assert needs["draft/fp32"] == ("draft/vocab",) and needs["draft/int8"] == ("draft/fp32",)
    assert all(len(s.fingerprint) == 16 or s.name in ("kernels", "tokenizer") for s in stages)
    assert stages[1].selected_by("target") and stages[1].selected_by("target/int8")
    assert not stages[1].selected_by("target/fp32")


def test_only_rebuilds_one_stage_and_keeps_the_rest(built_draft_only, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(built_draft_only[1], out)
    path = _yaml(tmp_path, built_draft_only)
    before = read_manifest(out)
    assert main(["build", str(path), "--no-bench", "--only", "target/fp32"]) == 0
    after = read_manifest(out)
    assert after["models"]["target"]["precisions"]["fp32"]["dir"] != before["models"]["target"]["precisions"]["fp32"]["dir"]
    assert after["tokenizer"] == before["tokenizer"]
    assert "tokenizer: kept from the current build" in capsys.readouterr().err
    assert main(["build", str(path), "--no-bench", "--only", "draft"]) == 1
    assert "--only: 'draft' names no stage of this build" in capsys.readouterr().err


def test_only_needs_the_other_stages_built(built_draft_only, tmp_path, capsys):
    path = _yaml(tmp_path, built_draft_only, precisions=["fp32", "int8"])
    assert main(["build", str(path), "--no-bench", "--only", "target/int8"]) == 1
    assert "target/fp32 is not in the current build" in capsys.readouterr().err
