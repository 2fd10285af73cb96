"""A real `tritonserver` for the tests, on a CPU machine without Docker.

Where it comes from, in order: $SPECEXPORT_TRITONSERVER (a folder with bin/tritonserver and
backends/python/), a `tritonserver` on PATH (NVIDIA's container layout, backends in
/opt/tritonserver/backends), or the binary bundled in the `nvidia-pytriton` wheel on PyPI, fetched
with `pip download --no-deps` and unpacked into a cache (the wheel's Python package is not
installed: it pins numpy < 2). The wheel's Python-backend stub is built against NumPy 1.x, whose C
ABI NumPy 2 changed (with numpy 2 in the stub's interpreter every BYTES input arrives garbled), so the
stub runs in a venv of its own with numpy < 2 that also sees the packages of the environment the tests
run in (a .pth file naming its site-packages, after the venv's own: numpy < 2 wins). Not
--system-site-packages: inside a venv that exposes the base interpreter's packages, not the venv's,
and the stub would find neither onnxruntime nor tokenizers. Triton's Python stub finds its
interpreter through PATH, as PyTriton arranges it. The cache's folders are marked when made
(specexport.owned) and only marked ones are ever replaced.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from specexport import owned, pinned
from specexport.errors import SpecexportError

BY = "specexport tests (tritonserver cache)"

PYTRITON = "nvidia-pytriton==0.7.0"          # Triton 2.51
PYTRITON_SHA256 = "21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df"   # its x86-64 wheel
NUMPY1 = "numpy==1.26.4"                      # the Python-backend stub's NumPy (its C ABI is 1.x)
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
    try:       # the binary it runs comes from this wheel: its sha256 is required
        wheel = pinned.pip_download(PYTRITON, PYTRITON_SHA256, download)
    except SpecexportError as err:
        raise Unavailable(f"could not fetch {PYTRITON} from the package index: {err}") from None
    partial = owned.fresh(CACHE, "wheel.partial-", by=BY)
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(partial)
        for f in (partial / "pytriton" / "tritonserver").rglob("*"):
            if f.is_file() and (f.parent.name in ("bin",) or f.name.endswith("_stub")):
                f.chmod(0o755)
        if done.exists() and owned.remove(done):
            raise Unavailable(f"{done} holds files the tests did not write: move it away")
        owned.seal(partial)
        partial.rename(done)
    finally:
        owned.remove(partial)
    return done


def _numpy1_venv() -> Path:
    """A venv with numpy < 2 that also imports this environment's packages (specexport, onnxruntime,
    tokenizers), one per test environment."""
    paths = sysconfig.get_paths()
    site = [paths["purelib"], *([paths["platlib"]] if paths["platlib"] != paths["purelib"] else [])]
    key = hashlib.sha256(os.pathsep.join(site).encode()).hexdigest()[:10]
    venv = CACHE / f"venv-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    python = venv / "bin" / "python"
    check = "import numpy, specexport, onnxruntime, tokenizers; assert numpy.__version__ < '2'"
    if python.exists() and subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        return venv
    if venv.exists() and owned.remove(venv):
        raise Unavailable(f"{venv} holds files the tests did not write: move it away")
    owned.create(venv, by=BY)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)      # into the marked folder
    run = subprocess.run([str(python), "-m", "pip", "install", "-q", "--only-binary=:all:", NUMPY1], capture_output=True,
                         text=True)
    if run.returncode:
        raise Unavailable(f"could not install numpy<2 for the Python-backend stub: {run.stderr.strip()[-300:]}")
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(own_site, "specexport-tests-env.pth").write_text("\n".join(site) + "\n")
    run = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    if run.returncode:
        raise Unavailable(f"the Python-backend stub's venv cannot import what it needs: {run.stderr.strip()[-300:]}")
    return venv
