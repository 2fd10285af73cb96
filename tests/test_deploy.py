"""Deploying as a user would (issue: an engine runs where it is deployed): a fresh venv with the base install
(`pip install <this checkout>`, no extras: no torch, under 300 MB), a built engine copied to another folder and
made read-only, no compiler on PATH, no ONNX Runtime headers, an empty cache: `specexport generate --chat`
answers on our kernels (the engine's library) with the build machine's text."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_carried_kernels import bare_env, copy_of, engine  # noqa: F401  (the fixture)
from test_gguf_exact import _own_cache, quantized_gguf  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
MAX_VENV_MB = 300


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("deploy") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(ROOT)], capture_output=True, text=True, timeout=900)
    if r.returncode:
        pytest.fail(f"pip install {ROOT} (the base install) failed:\n{r.stderr[-2000:]}")
    return venv


def size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20


def generate(specexport: str, engine_dir: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([specexport, "generate", str(engine_dir), "Say hello.", "--chat", "--method", "vanilla",
                           "--max-new-tokens", "12"], capture_output=True, text=True, env=env, timeout=600)


def test_the_base_install_is_torch_free_and_small(runtime_venv):
    python = str(runtime_venv / "bin" / "python")
    r = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('jinja2') is not None)"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["None", "True"], r.stdout
    mb = size_mb(runtime_venv)
    print(f"runtime venv: {mb:.0f} MB")
    assert mb < MAX_VENV_MB, f"the runtime install is {mb:.0f} MB (goal: under {MAX_VENV_MB})"


def test_a_copied_engine_answers_on_the_carried_kernels_with_no_compiler(runtime_venv, engine, tmp_path):  # noqa: F811
    want = generate(str(Path(sys.executable).parent / "specexport"), engine, dict(os.environ))
    assert want.returncode == 0, want.stderr[-2000:]
    deployed = copy_of(engine, tmp_path)
    for p in [deployed, *deployed.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    try:
        env = bare_env(tmp_path)
        env["PATH"] = str(runtime_venv / "bin")            # the runtime venv's commands only: no g++, no apt
        start = time.perf_counter()
        got = generate(str(runtime_venv / "bin" / "specexport"), deployed, env)
        seconds = time.perf_counter() - start
    finally:
        for p in [deployed, *deployed.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
    print(f"deployed generate --chat: {seconds:.1f} s")
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == want.stdout and got.stdout.startswith("> Say hello.")
    assert "library: the engine's, kernels-" in got.stderr, got.stderr
    assert "compiled here" not in got.stderr
