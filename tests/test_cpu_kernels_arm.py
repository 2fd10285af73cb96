"""The CPU kernels' ARM paths, cross-compiled with Debian's aarch64 toolchain and run under qemu-user (whose
default CPU has dotprod and i8mm): neon (dotprod: Jetson Orin's Cortex-A78AE) and i8mm (smmla: Graviton 3/4,
AmpereOne, Apple M2+) equal the reference bit for bit, the library's self-check passes them, and the AArch64
reference equals this machine's (portable C++, no fused multiply-adds but the explicit ones)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from machine import kernels_missing
from specexport.plugins import cpu
from specexport.quant.gguf_blocks import SUPPORTED
from tests.test_cpu_kernels import QK, blocks

CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    """tests/cpu/driver.cc and the kernels, compiled for AArch64 with the flags the package uses there."""
    if not (shutil.which(CXX) and shutil.which(QEMU)):
        kernels_missing(f"the ARM tests need {CXX} and {QEMU} (apt-get install g++-aarch64-linux-gnu qemu-user)")
    out = tmp_path_factory.mktemp("arm")
    objs = []
    for src in cpu.sources("aarch64"):
        obj = out / (src + ".o")
        subprocess.run([CXX, *cpu.flags(src), "-c", str(cpu.HERE / src), "-o", str(obj)], check=True)
        objs.append(str(obj))
    driver_src = Path(__file__).parent / "cpu" / "driver.cc"
    subprocess.run([CXX, "-O2", "-std=c++17", "-I", str(cpu.HERE), str(driver_src), *objs, "-static",
                    "-o", str(out / "driver")], check=True)
    return out / "driver"


def _run(driver: Path, *args) -> None:
    subprocess.run([QEMU, str(driver), *map(str, args)], check=True, timeout=300)


def _matmul(driver, tmp, qtype, path, exact, x, w, layout: str = "file") -> np.ndarray:
    (tmp / "in").write_bytes(x.astype(np.float32).tobytes() + w.tobytes())
    M, K = x.shape
    _run(driver, "matmul", cpu.capi.type_id(qtype, layout), cpu.PATHS[path], int(exact), M, K, w.shape[0], tmp / "in",
         tmp / "out")
    return np.frombuffer((tmp / "out").read_bytes(), np.float32).reshape(M, w.shape[0])


def test_the_emulated_cpu_runs_the_neon_and_i8mm_paths(driver):
    out = subprocess.run([QEMU, str(driver), "paths"], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["ref,neon,i8mm"]


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_neon_and_i8mm_equal_the_reference_and_the_reference_is_portable(driver, tmp_path, qtype):
    rng = np.random.default_rng(11)
    k = QK[qtype] * 2
    w, x = blocks(rng, qtype, 13, k), rng.standard_normal((7, k)).astype(np.float32)
    here = cpu.Kernels()
    for exact in (False, True):
        ref = _matmul(driver, tmp_path, qtype, "ref", exact, x, w)
        for path in ("neon", "i8mm"):
            assert np.array_equal(_matmul(driver, tmp_path, qtype, path, exact, x, w), ref), (qtype, path, exact)
        assert np.array_equal(here.matmul(qtype, x, w, path="ref", exact=exact), ref), (qtype, exact)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_the_arm_paths_run_r8_weights_with_the_references_bits(driver, tmp_path, qtype):
    """The r8 layout written on this machine (sx_layout.h: bytes, the same on every architecture) runs on
    AArch64 through its paths' file kernels with the reference's bits (a tail of five rows past the groups)."""
    rng = np.random.default_rng(13)
    k = QK[qtype] * 2
    w, x = blocks(rng, qtype, 21, k), rng.standard_normal((5, k)).astype(np.float32)
    r8 = cpu.Kernels().repack(qtype, w, k)
    ref = _matmul(driver, tmp_path, qtype, "ref", False, x, w)
    for path in ("ref", "neon", "i8mm"):
        assert np.array_equal(_matmul(driver, tmp_path, qtype, path, False, x, r8, "r8"), ref), (qtype, path)


def test_neon_attention_equals_the_reference(driver, tmp_path):
    rng = np.random.default_rng(12)
    D, total = 64, 29
    bias = np.where(rng.random(total) < 0.3, np.finfo(np.float32).min, 0).astype(np.float32)
    parts = [rng.standard_normal(D), rng.standard_normal((total, D)), rng.standard_normal((total, D)), bias]
    (tmp_path / "in").write_bytes(b"".join(np.asarray(p, np.float32).tobytes() for p in parts))
    got = {}
    for path in ("ref", "neon"):
        _run(driver, "attend", cpu.PATHS[path], D, total, 0.125, tmp_path / "in", tmp_path / "out")
        got[path] = np.frombuffer((tmp_path / "out").read_bytes(), np.float32)
    assert np.array_equal(got["neon"], got["ref"])
