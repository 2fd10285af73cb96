"""ruff over the whole tree with the rule set in pyproject.toml ([tool.ruff]): the suite fails on a lint error,
so CI (which runs the suite) lints too."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_the_tree_is_lint_clean():
    done = ruff("check", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_lint_covers_the_builder_package():
    """The build's package and command are checked (the package was named `build`, which ruff's default
    excludes skip: it is `builder/` now), and built engines are not."""
    files = ruff("check", "--show-files", ".").stdout
    assert "specexport/builder/plan.py" in files and "specexport/cli/build.py" in files
    assert "engines/" not in files
