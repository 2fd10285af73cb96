"""The kernel library an engine folder carries: what the build records of it, and whether a load here may use it.

The build copies the library it ran (and, where a cross compiler is installed, an AArch64 build for Arm
boards) into `<engine>/kernels-<sha8>/<arch>/libspecexport_cpu.so`, listed in the manifest's `kernels` entry
with each file's sha256, the paths it was compiled with, its kernel version (the C API the ctypes signatures
follow: capi.VERSION) and ONNX Runtime's C API version. A load on a machine of that architecture uses it
with no compiler, no headers and no network; anything else compiles as before, and the reason is said.

A library is code: an engine folder is to be trusted as a program is (as TensorRT engines and plugin
libraries are). Nothing is ever downloaded into one; a file whose sha256 differs from the manifest's is
never loaded.
"""
from __future__ import annotations

import platform
from pathlib import Path

from specexport.manifest import sha256_file
from specexport.plugins.cpu.capi import VERSION
from specexport.plugins.cpu.toolchain import machine

NAME = "libspecexport_cpu.so"


def record(lib: Path, arch: str, paths: list[str], left_out: dict, compiler: str) -> dict:
    """The manifest's record of one carried library (`lib`: its copy in the engine folder)."""
    from specexport.plugins.cpu.headers import API_VERSION

    libc = platform.libc_ver() if arch == machine() else ("", "")
    return {"file": f"{arch}/{NAME}", "sha256": sha256_file(lib), "size": lib.stat().st_size, "arch": arch,
            "paths": paths, "left_out": left_out, "kernel_version": VERSION, "ort_api": API_VERSION,
            "compiler": compiler.strip().splitlines()[0] if compiler.strip() else "?",
            **({"libc": " ".join(libc)} if libc[0] else {})}


def pick(engine: Path, kernels: dict) -> tuple[Path | None, str]:
    """The library `engine` carries for this machine (its manifest's `kernels` entry), checked, or None and
    why in one line."""
    libs = kernels.get("libraries") or {}
    arch = machine()
    rec = libs.get(arch)
    if not isinstance(rec, dict):
        return None, f"the engine carries kernels for {', '.join(sorted(libs)) or 'no architecture'}, not {arch}"
    if rec.get("kernel_version") != VERSION:
        return None, (f"the engine's library has kernel version {rec.get('kernel_version')}, this specexport's "
                      f"is {VERSION}")
    path = Path(engine) / str(kernels.get("dir", "")) / str(rec.get("file", ""))
    try:
        inside = path.resolve().is_relative_to(Path(engine).resolve())
    except OSError:
        inside = False
    if not inside or not path.is_file():
        return None, f"{path}: missing (the manifest lists it)"
    if sha256_file(path) != rec.get("sha256"):
        return None, f"{path}: its sha256 differs from the manifest's; not loaded"
    return path, ""
