"""KernelsStage: the compiled CPU kernel library the build ran, carried in the engine folder
(`kernels-<sha256[:8]>/<arch>/libspecexport_cpu.so`; plugins/cpu/carry.py), and, where a cross compiler is
installed, the same library built for the other architecture (AArch64 for Arm boards), so a deploy machine
loads it with no compiler, no headers and no network. Runs after the graph stages; writes nothing when no
graph of the build calls our kernels. Content-addressed like the tokenizer copy: an unchanged set of
libraries keeps its folder."""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass

from specexport.builder.stage import Stage
from specexport.errors import KernelsUnavailable
from specexport.manifest import files_intact, sha256_file


@dataclass(frozen=True)
class KernelsStage(Stage):
    forceable = False

    def previous(self, ctx) -> dict | None:
        return ctx.previous.get("kernels") or {}

    def reusable(self, ctx, entry: dict) -> bool:
        return False                  # decided inside run(), which keeps an unchanged folder

    def current(self, ctx, entry: dict) -> bool:
        return not entry or files_intact(ctx.out, _listed(entry))

    def run(self, ctx) -> dict:
        from specexport.plugins import cpu

        if not any(cpu.on_ours(r.entry) for r in ctx.results.values() if r.stage.precision is not None):
            return {}
        st = cpu.status()
        if not st.available:
            return {}
        with ctx.reporter.stage("carry the CPU kernels"):
            libs = {cpu.carry.machine(): (st.library, st.built)}
            missing = {}
            for arch in sorted(set(cpu.toolchain.CROSS) - set(libs)):
                try:
                    lib = cpu.build(arch=arch)
                except KernelsUnavailable as err:
                    missing[arch] = str(err).splitlines()[0]
                    continue
                libs[arch] = (lib, cpu.compiled(lib, arch))
            digest = hashlib.sha256(b"".join(sha256_file(p).encode() for p, _ in libs.values())).hexdigest()
            old = ctx.previous.get("kernels") or {}
            if old.get("digest") == digest and files_intact(ctx.out, _listed(old)):
                return {**old, "not_carried": missing}
            records = {}

            def write(partial):
                for arch, (lib, built) in libs.items():
                    (partial / arch).mkdir()
                    shutil.copy2(lib, partial / arch / cpu.carry.NAME)
                    records[arch] = cpu.carry.record(partial / arch / cpu.carry.NAME, arch, **built)

            dest = ctx.folders.addressed("kernels", digest, write)
        for arch, why in missing.items():
            ctx.reporter.note(f"[dim]- kernels: no {arch} library carried ({why})[/]")
        files = {r["file"]: {"sha256": r["sha256"], "size": r["size"]} for r in records.values()}
        return {"dir": dest.name, "digest": digest, "libraries": records, "files": files, "not_carried": missing}

    def place(self, manifest: dict, entry: dict) -> None:
        if entry:
            manifest["kernels"] = entry

    def describe(self, entry: dict) -> str:
        return entry.get("dir", "no kernels carried")


def _listed(entry: dict) -> dict:
    return {f"{entry['dir']}/{name}": meta for name, meta in (entry.get("files") or {}).items()}

