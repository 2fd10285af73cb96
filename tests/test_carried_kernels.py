"""The engine folder carries the kernel library its graphs call (plugins/cpu/carry.py, builder/stages/kernels.py):
the build copies the library it ran (and, with the cross tools, an AArch64 one) into kernels-<sha8>/<arch>/,
listed in the manifest; a load with no compiler, no headers and an empty cache runs on it with the build's
answer; a tampered file, another architecture or another kernel version is not loaded, and the line says why.
Each load runs in a fresh process: the library is loaded once per process."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from test_gguf_exact import _own_cache, lean_builds, quantized_gguf  # noqa: F401, E402  (fixtures; after the skips)

PROMPT = [1, 40, 41, 42]
ELF_MACHINE = {b"\x3e\x00": "x86_64", b"\xb7\x00": "aarch64"}      # e_machine, little-endian, at offset 18
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"


@pytest.fixture(scope="module")
def engine(quantized_gguf, tmp_path_factory, write_yaml, run_build):  # noqa: F811
    return lean_builds(quantized_gguf, tmp_path_factory, write_yaml, run_build, "carried", {"engine": {}}) / "engine"


def bare_env(tmp: Path) -> dict:
    """No compiler on PATH (nor CXX), an empty kernels cache, no ONNX Runtime headers to find."""
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "SPECEXPORT_ORT_INCLUDE", "SPECEXPORT_KERNELS")}
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").unlink(missing_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    return {**env, "PATH": str(bin_dir), "SPECEXPORT_KERNELS_CACHE": str(tmp / "empty-cache"),
            "SPECEXPORT_ORT_INCLUDE": str(tmp / "no-headers")}


LOAD = """
import json, sys, specexport
p = specexport.load(sys.argv[1])
out = p.generate(prompt_ids={prompt}, max_new_tokens=16, method="vanilla")
print(json.dumps({{"ids": out.token_ids, "note": p.kernel_note}}))
""".format(prompt=PROMPT)


def load(engine: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD, str(engine)], capture_output=True, text=True, env=env,
                          timeout=600)


def build_answer(engine: Path) -> list[int]:
    import specexport

    with specexport.load(engine) as p:
        return p.generate(prompt_ids=PROMPT, max_new_tokens=16, method="vanilla").token_ids


def copy_of(engine: Path, tmp: Path) -> Path:
    dest = tmp / "deployed"
    shutil.copytree(engine, dest)
    return dest


def test_the_engine_carries_the_library_the_build_ran(engine):
    from specexport.manifest import read_manifest, sha256_file
    from specexport.plugins import cpu

    m = read_manifest(engine)
    k = m["kernels"]
    here = cpu.carry.machine()
    lib = engine / k["dir"] / k["libraries"][here]["file"]
    assert k["dir"].startswith("kernels-") and lib.is_file()
    assert sha256_file(lib) == sha256_file(cpu.status().library) == k["libraries"][here]["sha256"]
    assert k["libraries"][here]["kernel_version"] == cpu.capi.VERSION == cpu.Kernels(lib).c.sx_version()
    assert k["libraries"][here]["ort_api"] == cpu.headers.API_VERSION
    assert set(cpu.expected_paths()) <= set(k["libraries"][here]["paths"]) | {"tiers"}
    assert ELF_MACHINE[lib.read_bytes()[18:20]] == here
    if shutil.which(CROSS):                    # an Arm board's library beside it
        arm = engine / k["dir"] / k["libraries"]["aarch64"]["file"]
        assert ELF_MACHINE[arm.read_bytes()[18:20]] == "aarch64"
        assert k["libraries"]["aarch64"]["paths"] == ["ref", "neon", "i8mm"]
    else:
        assert "aarch64" in k["not_carried"]
    listed = set(k["files"])
    assert listed == {v["file"] for v in k["libraries"].values()}


def test_a_load_with_no_compiler_and_an_empty_cache_runs_on_the_carried_library(engine, tmp_path):
    """The deploy machine: a copy of the engine, read-only, no compiler, no headers, an empty cache: the
    engine's library runs, the build's answer comes back, the tier table goes to the cache."""
    deployed = copy_of(engine, tmp_path)
    before = sorted(p.relative_to(deployed) for p in deployed.rglob("*"))
    for p in [deployed, *deployed.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    try:
        env = bare_env(tmp_path)
        r = load(deployed, env)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["ids"] == build_answer(engine)
        assert "library: the engine's, kernels-" in got["note"], got["note"]
        assert sorted(p.relative_to(deployed) for p in deployed.rglob("*")) == before
        assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").glob("*/*.so"))
    finally:
        for p in [deployed, *deployed.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)


def test_a_tampered_library_is_never_loaded(engine, tmp_path):
    """One byte changed, the size kept: refused naming the file; with no compiler the load stops with that
    line; with one, the kernels are compiled here and the note says why the engine's were not used."""
    deployed = copy_of(engine, tmp_path)
    k = json.loads((deployed / "manifest.json").read_text())["kernels"]
    from specexport.plugins import cpu

    lib = deployed / k["dir"] / k["libraries"][cpu.carry.machine()]["file"]
    data = bytearray(lib.read_bytes())
    data[-1] ^= 0xFF
    lib.write_bytes(bytes(data))
    r = load(deployed, bare_env(tmp_path))
    assert r.returncode != 0
    assert f"{lib}: its sha256 differs from the manifest's; not loaded" in r.stderr, r.stderr[-2000:]
    assert "no C++ compiler found" in r.stderr
    r = load(deployed, {k: v for k, v in os.environ.items()})
    assert r.returncode == 0, r.stderr[-2000:]
    note = json.loads(r.stdout.strip().splitlines()[-1])["note"]
    assert "library: compiled here" in note and "its sha256 differs from the manifest's" in note, note


@pytest.mark.parametrize("change", ["another architecture", "another kernel version"])
def test_a_library_this_machine_cannot_use_is_not_loaded_and_the_fallback_is_said(engine, tmp_path, change):
    from specexport.plugins import cpu

    deployed = copy_of(engine, tmp_path)
    manifest = json.loads((deployed / "manifest.json").read_text())
    libs = manifest["kernels"]["libraries"]
    here = cpu.carry.machine()
    if change == "another architecture":
        libs["riscv64"] = libs.pop(here)
        want = f"the engine carries kernels for {', '.join(sorted(libs))}, not {here}"
    else:
        libs[here]["kernel_version"] = cpu.capi.VERSION + 1
        want = f"the engine's library has kernel version {cpu.capi.VERSION + 1}, this specexport's is {cpu.capi.VERSION}"
    (deployed / "manifest.json").write_text(json.dumps(manifest))
    r = load(deployed, dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    note = json.loads(r.stdout.strip().splitlines()[-1])["note"]
    assert "library: compiled here" in note and want in note, note
    r = load(deployed, bare_env(tmp_path))
    assert r.returncode != 0 and want in r.stderr, r.stderr[-2000:]


def test_the_aarch64_library_loads_and_passes_its_self_check_on_an_arm_cpu(engine, tmp_path):
    """The carried AArch64 library, dlopen'ed by a small AArch64 program under qemu-user (whose CPU has
    dotprod and i8mm): its kernel version is this package's, its paths are NEON's and i8mm's, and its
    self-check passes them (none refused)."""
    from machine import kernels_missing

    if not (shutil.which(CROSS) and shutil.which(QEMU)):
        kernels_missing(f"the AArch64 library needs {CROSS} and {QEMU} (apt-get install g++-aarch64-linux-gnu qemu-user)")
    k = json.loads((engine / "manifest.json").read_text())["kernels"]
    lib = engine / k["dir"] / k["libraries"]["aarch64"]["file"]
    src = tmp_path / "open.c"
    src.write_text('#include <dlfcn.h>\n#include <stdio.h>\nint main(int c, char **v) {\n'
                   '  void *h = dlopen(v[1], RTLD_NOW); if (!h) { puts(dlerror()); return 1; }\n'
                   '  int (*ver)(void) = dlsym(h, "sx_version"); const char *(*s)(void) = dlsym(h, "sx_paths");\n'
                   '  const char *(*r)(void) = dlsym(h, "sx_refused");\n'
                   '  printf("%d %s [%s]\\n", ver(), s(), r()); return 0; }\n')
    subprocess.run([CROSS.replace("g++", "gcc"), str(src), "-o", str(tmp_path / "open"), "-ldl"], check=True)
    r = subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(tmp_path / "open"), str(lib)],
                       capture_output=True, text=True, timeout=300)
    from specexport.plugins import cpu

    assert r.stdout.split() == [str(cpu.capi.VERSION), "ref,neon,i8mm", "[]"], (r.stdout, r.stderr)


@pytest.mark.parametrize("command", [["inspect"], ["bench", "--max-new-tokens", "4", "--rounds", "1"]])
def test_inspect_and_bench_use_the_carried_library_too(engine, tmp_path, command):
    """Commands that read the kernels before opening a model (inspect's line, the bench's tier measurement)
    take the engine's library as well, with no compiler."""
    deployed = copy_of(engine, tmp_path)
    code = "import sys; from specexport.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, command[0], str(deployed), *command[1:]], capture_output=True,
                       text=True, env={**bare_env(tmp_path), "COLUMNS": "400"}, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    out = " ".join((r.stdout + r.stderr).split())
    if command[0] == "inspect":
        assert "library: the engine's, kernels-" in out, out[-2000:]
        assert "kernels carried for aarch64" in out or not shutil.which(CROSS), out[-2000:]
    else:
        assert "kernel tiers measured for this run" in out, out[-2000:]
