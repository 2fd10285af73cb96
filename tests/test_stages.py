"""The build as a list of stage values: their order and needs, `--only` rebuilding one stage and keeping
the rest, and the errors it gives."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from specexport.builder.plan import plan_build
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


def test_a_stage_is_fingerprinted_on_its_own_module_and_the_makers_it_imports():
    """A stage's output is reused while its fingerprint holds; the fingerprint hashes hand-kept source lists
    (builder/sources.py). Each stage module, and every module of the makers (export/, quant/, heads/, plugins/,
    trt/, builder/stages/, io_spec) it imports, must be in the lists its fingerprint takes: else an edit there
    would leave an old output in place (builder/stages/gguf.py and plugins/cpu/ once were)."""
    import ast
    import fnmatch

    from specexport.builder import sources

    package = Path(sources.__file__).resolve().parent.parent
    model = (*sources.GRAPH_SOURCES, *sources.ENGINE_SOURCES)         # every model stage's fingerprint holds these
    lists = {"export": model, "engines": model, "gguf": (*model, *sources.QUANTIZER_SOURCES),
             "blocks": (*model, *sources.QUANTIZER_SOURCES), "quantize": (*model, *sources.QUANTIZER_SOURCES),
             "medusa": (*model, *sources.HEADS_SOURCES), "eagle": (*model, *sources.EAGLE_SOURCES),
             "head_blocks": (*model, *sources.HEADS_SOURCES, *sources.EAGLE_SOURCES)}
    makers = ("export/", "quant/", "heads/", "plugins/", "trt/", "builder/stages/", "io_spec.py")

    def file_of(module: str) -> str | None:
        path = package.parent / Path(*module.split("."))
        for f in (path.with_suffix(".py"), path / "__init__.py"):
            if f.is_file():
                return f.relative_to(package).as_posix()
        return None

    missing = []
    for stage, patterns in lists.items():
        own = f"builder/stages/{stage}.py"
        used = {own}
        for node in ast.walk(ast.parse((package / own).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specexport."):
                for alias in node.names:
                    found = file_of(f"{node.module}.{alias.name}") or file_of(node.module)
                    if found and found.startswith(makers):
                        used.add(found)
        missing += [f"{stage}: {f}" for f in sorted(used) if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not missing, "add these to the stage's *_SOURCES in builder/sources.py:\n" + "\n".join(missing)


def test_source_fingerprints_follow_contents_not_names(tmp_path):
    """A stage's code fingerprint (sources.source_hash) keeps through a rename or a move of its modules (the
    package build/ became builder/), and changes with a byte of any of them."""
    from specexport.builder.sources import source_hash

    (tmp_path / "build" / "stages").mkdir(parents=True)
    (tmp_path / "build" / "stages" / "a.py").write_text("A = 1\n")
    (tmp_path / "build" / "plan.py").write_text("B = 2\n")
    before = source_hash(("build/stages/*.py", "build/plan.py"), tmp_path)
    (tmp_path / "build").rename(tmp_path / "builder")
    assert source_hash(("builder/stages/*.py", "builder/plan.py"), tmp_path) == before
    (tmp_path / "builder" / "plan.py").write_text("B = 3\n")
    assert source_hash(("builder/stages/*.py", "builder/plan.py"), tmp_path) != before
