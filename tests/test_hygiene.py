"""Promises the code makes to users that nothing else checks: every `pip install 'specexport[X]'`
an error message names is an extra that exists, and the runtime imports stay light."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"torch", "transformers", "onnx", "tensorrt", "modelopt"}


def test_every_extra_the_code_names_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for path in [*ROOT.joinpath("specexport").rglob("*.py"), ROOT / "README.md"]:
        for group in re.findall(r"specexport\[([A-Za-z0-9_,{} -]+)\]", path.read_text()):
            named |= {g.strip() for g in group.split(",") if g.strip() and "{" not in g}
    from specexport._optional import _EXTRA

    named |= set(_EXTRA.values())
    assert named, "found no extras named in the code"
    assert named <= extras, f"named in messages but not in pyproject.toml: {sorted(named - extras)}"


def test_the_base_install_renders_chat_templates():
    """`generate --chat` is the runtime's: jinja2 comes with `pip install specexport`, not with an extra."""
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"jinja2\b", d) for d in base), base
    from specexport._optional import _EXTRA

    assert _EXTRA["jinja2"] == "ort"


@pytest.mark.parametrize("module", ["specexport", "specexport.runtime.pipeline", "specexport.runtime.backends.ort",
                                    "specexport.cli", "specexport.report.bench", "specexport.manifest"])
def test_runtime_imports_stay_light(module):
    code = f"import sys, {module}; bad = {HEAVY!r} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_output_that_is_not_a_terminal_is_not_wrapped(monkeypatch):
    """A piped build log keeps each progress line whole (rich wraps at 80 columns otherwise)."""
    from specexport._console import WIDE, console

    monkeypatch.delenv("COLUMNS", raising=False)
    c = console(stderr=True)
    assert c.width == WIDE and c.soft_wrap
    monkeypatch.setenv("COLUMNS", "100")
    assert console().width == 100


@pytest.mark.parametrize("package", ["fastapi", "pydantic", "uvicorn", "prometheus_client"])
def test_serve_names_its_extra_before_it_reads_the_build(package, tmp_path):
    """The base install (no `serve` extra): `specexport serve` says, in one line and before anything loads
    (the build folder here does not exist), which extra brings the package; no traceback."""
    code = (f"import sys; sys.modules[{package!r}] = None\n"      # an import of it now fails, as when absent
            f"from specexport.cli import main; sys.exit(main(['serve', {str(tmp_path / 'absent')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert package in r.stderr and "pip install 'specexport[serve]'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "absent" not in r.stderr
