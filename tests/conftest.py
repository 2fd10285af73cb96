"""Session-scoped tiny checkpoints and builds shared by the export tests.

Everything expensive (tokenizer training, checkpoint writing, ONNX export) happens once per session:
one checkpoint per entry of TINY_CONFIGS plus a 1-layer llama draft, and at most one build per
architecture (`build_arch`), the llama one being `built_llama` (target + draft).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# The tree-attention kernel runs in Triton's interpreter here (no GPU), which must be chosen before
# anything imports triton (torch may, during export).
os.environ.setdefault("TRITON_INTERPRET", "1")
# The compiled CPU kernels in one folder for the session, whichever SPECEXPORT_CACHE a test sets for its GGUF
# conversions: each such test would otherwise compile the library again (~20 s).
os.environ.setdefault("SPECEXPORT_KERNELS_CACHE", str(Path(os.environ.get("SPECEXPORT_CACHE")
                                                           or Path.home() / ".cache" / "specexport") / "kernels"))

import pytest
import yaml

from specexport.cli import main
from specexport.export.tiny import TINY_CONFIGS, make_tiny_checkpoint, train_tokenizer, truncate_checkpoint

MAX_SEQ_LEN = 128


def pytest_configure(config):
    """One export cache for the run (builder/export_cache.py), made by the first process (xdist's controller,
    whose workers inherit it): a model exported again by another test's build takes the graph from it. Fresh
    each run, so every distinct graph is exported for real once per run. In xdist's workers: $SPECEXPORT_THREADS."""
    from specexport.builder.export_cache import ENV
    from specexport.runtime.backends.ort import THREADS_ENV

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))        # set in xdist's workers only
    if workers:   # each worker's ORT sessions its share of the cores (ort.default_threads): two all-core pools
        # on 2 cores wait on each other's busy core (the session-heavy test files ~15% longer, wall and CPU)
        os.environ.setdefault(THREADS_ENV, str(max(1, (os.cpu_count() or 1) // workers)))
    if ENV not in os.environ:
        _EXPORT_CACHE.append(tempfile.mkdtemp(prefix="specexport-test-exports-"))
        os.environ[ENV] = _EXPORT_CACHE[0]


def pytest_unconfigure(config):
    if _EXPORT_CACHE:
        shutil.rmtree(_EXPORT_CACHE.pop(), ignore_errors=True)          # the folder this process made


_EXPORT_CACHE: list = []


def pytest_runtest_setup(item):
    """The machine markers (tests/machine.py): skip a test this machine cannot run or check."""
    from machine import MARKERS

    for mark in item.iter_markers():
        if mark.name in MARKERS:
            skip, why = MARKERS[mark.name]
            if skip():
                pytest.skip(why)


def _write_yaml(path: Path, **fields) -> Path:
    """Write a model.yaml with these top-level fields (Paths become strings)."""
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(plain(fields), sort_keys=False))
    return path


def _run_build(yaml_path: Path, *extra: str) -> int:
    return main(["build", str(yaml_path), *extra])


@pytest.fixture(scope="session")
def write_yaml():
    """write_yaml(path, **top_level_fields) -> path of the written model.yaml."""
    return _write_yaml


@pytest.fixture(scope="session")
def run_build():
    """run_build(yaml_path, *flags) -> exit code of `specexport build` run in-process."""
    return _run_build


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A few Python sources from the standard library (every machine has them): distillation prompts."""
    import inspect
    import json
    import textwrap

    folder = tmp_path_factory.mktemp("corpus")
    for mod in (json, textwrap, inspect):
        (folder / f"{mod.__name__}.py").write_text(inspect.getsource(mod))
    return folder


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoints(tiny_root, tokenizer) -> dict[str, Path]:
    """model_type -> checkpoint folder for every TINY_CONFIGS entry, plus "llama-draft" (1 layer of llama)."""
    ckpts = {}
    for model_type in TINY_CONFIGS:
        ckpts[model_type] = make_tiny_checkpoint(tiny_root / "ckpt" / model_type, model_type, seed=0,
                                                 tokenizer=tokenizer)
    ckpts["llama-draft"] = truncate_checkpoint(ckpts["llama"], tiny_root / "ckpt" / "llama-draft", num_layers=1)
    return ckpts


@pytest.fixture(scope="session")
def built_llama(tiny_root, tiny_checkpoints) -> Path:
    """Output folder of a finished build: target llama (2 layers) + draft llama-draft (1 layer)."""
    out = tiny_root / "build" / "llama"
    cfg = _write_yaml(tiny_root / "yaml" / "llama.yaml", name="tiny-llama",
                     target={"path": tiny_checkpoints["llama"]}, draft={"path": tiny_checkpoints["llama-draft"]},
                     max_seq_len=MAX_SEQ_LEN, output=out)
    assert _run_build(cfg) == 0
    assert (out / "manifest.json").is_file()
    return out


@pytest.fixture(scope="session")
def build_arch(tiny_root, tiny_checkpoints, built_llama):
    """build_arch(model_type) -> output folder; llama is `built_llama`, others are target-only builds."""
    cache = {"llama": built_llama}

    def build(model_type: str) -> Path:
        if model_type not in cache:
            out = tiny_root / "build" / model_type
            cfg = _write_yaml(tiny_root / "yaml" / f"{model_type}.yaml", name=f"tiny-{model_type}",
                             target={"path": tiny_checkpoints[model_type]}, max_seq_len=MAX_SEQ_LEN, output=out)
            assert _run_build(cfg) == 0, f"build of the tiny {model_type} failed"
            cache[model_type] = out
        return cache[model_type]

    return build


@pytest.fixture(scope="session")
def built_draft_only(tiny_root, tiny_checkpoints) -> tuple[Path, Path]:
    """The cheapest finished build (the 1-layer llama as target): (yaml, output folder). Tests copy it."""
    out = tiny_root / "build" / "draft-only"
    cfg = _write_yaml(tiny_root / "yaml" / "draft-only.yaml", name="draft-only",
                     target={"path": tiny_checkpoints["llama-draft"]}, max_seq_len=64, output=out)
    assert _run_build(cfg) == 0
    return cfg, out
