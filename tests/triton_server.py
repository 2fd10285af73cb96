"""A real `tritonserver` for the tests, on a CPU machine without Docker.

Where it comes from, in order: $SPECEXPORT_TRITONSERVER (a folder with bin/tritonserver and
backends/python/), a `tritonserver` on PATH (NVIDIA's container layout, backends in
/opt/tritonserver/backends), or the binary bundled in the `nvidia-pytriton` wheel on PyPI, fetched
with `pip download --no-deps` and unpacked into a cache (the wheel's Python package is not
installed: it pins numpy < 2). The wheel's Python-backend stub is built against NumPy 1.x, whose C
ABI NumPy 2 changed (with numpy 2 in the stub's interpreter every BYTES input arrives garbled), so the
stub runs in a venv of this interpreter with --system-site-packages and numpy < 2; Triton's Python
stub finds its interpreter through PATH, as PyTriton arranges it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PYTRITON = "nvidia-pytriton==0.7.0"          # Triton 2.51
CACHE = Path(os.environ.get("SPECEXPORT_CACHE", Path.home() / ".cache" / "specexport")) / "tritonserver-0.7.0"


class Unavailable(RuntimeError):
    """No tritonserver could be found or fetched here (the message says why)."""


def tritonserver() -> tuple[list[str], dict]:
    """(the command's first words, its environment) to start a tritonserver with a Python backend."""
    given = os.environ.get("SPECEXPORT_TRITONSERVER")
    if given:
        root = Path(given)
    elif shutil.which("tritonserver"):
        binary = Path(shutil.which("tritonserver"))
        backends = Path("/opt/tritonserver/backends")
        return [str(binary), f"--backend-directory={backends}"], dict(os.environ)
    else:
        root = _unpacked_wheel() / "pytriton" / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    stub = root / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        source = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / stub.name
        if not source.exists():
            raise Unavailable(f"{root}: no Python-backend stub for Python {sys.version_info[:2]}")
        shutil.copy2(source, stub)
    env = dict(os.environ)
    lib_dirs = [str(libs), str(Path(sys.base_prefix) / "lib")]      # the bundled libs, and this Python's libpython
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = f"{_numpy1_venv() / 'bin'}:{env['PATH']}"
    return [str(root / "bin" / "tritonserver"), f"--backend-directory={root / 'backends'}"], env


def _unpacked_wheel() -> Path:
    done = CACHE / "wheel"
    if (done / "pytriton" / "tritonserver" / "bin" / "tritonserver").exists():
        return done
    download = CACHE / "download"
    download.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(download), PYTRITON],
                         capture_output=True, text=True)
    wheels = sorted(download.glob("nvidia_pytriton-*.whl"))
    if run.returncode or not wheels:
        raise Unavailable(f"could not fetch {PYTRITON} from the package index: {run.stderr.strip()[-300:]}")
    partial = CACHE / "wheel.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(partial)
    for f in (partial / "pytriton" / "tritonserver").rglob("*"):
        if f.is_file() and (f.parent.name in ("bin",) or f.name.endswith("_stub")):
            f.chmod(0o755)
    shutil.rmtree(done, ignore_errors=True)
    partial.rename(done)
    return done


def _numpy1_venv() -> Path:
    venv = CACHE / f"venv-py{sys.version_info.major}{sys.version_info.minor}"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import numpy, specexport; "
                                           "assert numpy.__version__ < '2'"], capture_output=True).returncode == 0:
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    run = subprocess.run([str(python), "-m", "pip", "install", "-q", "numpy<2"], capture_output=True, text=True)
    if run.returncode:
        raise Unavailable(f"could not install numpy<2 for the Python-backend stub: {run.stderr.strip()[-300:]}")
    return venv
