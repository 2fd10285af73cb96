"""The shipped demo pair builds, and its greedy speculative output equals vanilla greedy."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import specexport
from specexport.cli import main

DEMO = Path(__file__).parents[1] / "examples"


@pytest.fixture(scope="module")
def demo_build(tmp_path_factory):
    import yaml

    work = tmp_path_factory.mktemp("demo")
    cfg = yaml.safe_load((DEMO / "demo.yaml").read_text())
    for role in ("target", "draft"):
        cfg[role]["path"] = str((DEMO / cfg[role]["path"]).resolve())
    cfg["output"] = str(work / "build")
    (work / "demo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["build", str(work / "demo.yaml")]) == 0
    return work / "build"


def test_demo_weights_are_small_and_fp16():
    files = list((DEMO / "demo" / "models").rglob("*.safetensors"))
    assert {f.parent.name for f in files} == {"target", "draft"}
    assert sum(f.stat().st_size for f in files) <= 25 * 2**20
    for f in files:
        assert json.loads((f.parent / "config.json").read_text())["dtype"] == "float16"


def test_demo_greedy_speculative_equals_vanilla(demo_build):
    pipe = specexport.load(demo_build)
    prompts = [json.loads(line) for line in open(DEMO / "demo" / "prompts" / "code.jsonl")][:4]
    accepted = 0
    for p in prompts:
        vanilla = pipe.generate(p, max_new_tokens=64, method="vanilla")
        for gamma in (2, 4):
            spec = pipe.generate(p, max_new_tokens=64, method="draft", gamma=gamma)
            assert spec.token_ids == vanilla.token_ids
            accepted += spec.stats.accepted
    assert accepted > 0
