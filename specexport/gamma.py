"""The γ choice for `--gamma auto`, stored in the manifest by `specexport bench`.

    manifest["gamma_auto"]["<target precision>/<draft precision>"] = {
        "gamma": 4,                        # 0: speculation predicted to lose, decode vanilla
        "predicted_speedup": 1.71,
        "measured_tokens": 4608,           # tokens behind the acceptance figures it was chosen from
        "stages": {"target": "target/fp32-1a2b3c4d", "draft": "draft/fp32-5e6f7a8b"},
        "measured": "2026-12-01T10:00:00+00:00", "command": "specexport bench ..."}

A choice belongs to the exact graphs it was measured on (`stages`): a rebuild that reuses both keeps
it, one that rebuilds either drops it. A choice measured on fewer tokens (the short bench a build
ends with) never replaces one measured on more.

`--method auto` is stored the same way, per target precision and the draft precision it may use
("-" when the build has no draft), with the graphs of every model the bench ran (Medusa heads too):

    manifest["method_auto"]["fp32/fp32"] = {"method": "draft", "gamma": 4, "tree": None,
        "draft_precision": "fp32", "speedup": 1.71, "speedup_ci95": [1.6, 1.8], "measured_tokens": 4608,
        "threads": {"threads": None, "spin": True},    # the target's setting its rows ran with (the fastest for
                                                       #   vanilla): what specexport.load opens by default
        "stages": {"target": ..., "draft": ..., "medusa": ...}, "measured": ..., "command": ...}
    method "vanilla": every configuration measured lost (or was not shown to win) against vanilla.

The target pass by its rows (what a verify pass of M tokens costs on the CPU the bench ran on), per target
precision, from which the runtime sizes draft-free rounds (runtime/budget.py) where the CPU and the target's
thread count are the same; each bench replaces it:

    manifest["pass_curve"]["fp32/-"] = {"ms": {"1": 37.4, "2": 41.7, "4": 52.4, "8": 69.8, "16": 117.8},
        "cpu": "ab5ff248f8d7", "threads": 2, "measured_tokens": 0,     # cpu: plugins/cpu/tiers.py's cpu_id
        "stages": {"target": ...}, "measured": ..., "command": ...}
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from specexport.errors import SpecexportError
from specexport.locking import output_lock, work_dir
from specexport.manifest import MANIFEST_NAME, read_manifest, write_json_atomic


def gamma_key(target_precision: str, draft_precision: str) -> str:
    return f"{target_precision}/{draft_precision}"


def stages_of(manifest: dict, target_precision: str, draft_precision: str) -> dict | None:
    """{"target": dir, "draft": dir} of the graphs a choice would be measured on (None: not built)."""
    try:
        return {"target": manifest["models"]["target"]["precisions"][target_precision]["dir"],
                "draft": manifest["models"]["draft"]["precisions"][draft_precision]["dir"]}
    except KeyError:
        return None


def method_stages(manifest: dict, target_precision: str, draft_precision: str) -> dict | None:
    """The graphs a `--method auto` choice is measured on: the target's, the draft's of that
    precision ("-": none) and the Medusa heads' when built."""
    try:
        stages = {"target": manifest["models"]["target"]["precisions"][target_precision]["dir"]}
        if draft_precision != "-":
            stages["draft"] = manifest["models"]["draft"]["precisions"][draft_precision]["dir"]
    except KeyError:
        return None
    for kind, heads in manifest.get("heads", {}).items():
        stages[kind] = heads["precisions"]["fp32"]["dir"]
    return stages


def target_stage(manifest: dict, target_precision: str, draft_precision: str) -> dict | None:
    """The graph a pass curve is measured on: the target's of that precision."""
    try:
        return {"target": manifest["models"]["target"]["precisions"][target_precision]["dir"]}
    except KeyError:
        return None


SECTIONS = {"gamma_auto": stages_of, "method_auto": method_stages, "pass_curve": target_stage}
WHAT = {"gamma_auto": "γ", "method_auto": "method", "pass_curve": "pass curve"}


def lookup(manifest: dict, target_precision: str, draft_precision: str, *, section: str = "gamma_auto") -> dict | None:
    """The stored choice for these precisions when it was measured on the graphs of this manifest."""
    entry = manifest.get(section, {}).get(gamma_key(target_precision, draft_precision))
    if entry is None or entry.get("stages") != SECTIONS[section](manifest, target_precision, draft_precision):
        return None
    return entry


def carried_gamma_choices(previous: dict, manifest: dict) -> dict:
    """The previous manifest's choices (γ and method, by section) that still describe the graphs of
    `manifest`."""
    carried = {}
    for section, stages in SECTIONS.items():
        for key, entry in (previous.get(section) or {}).items():
            tp, _, dp = key.partition("/")
            if isinstance(entry, dict) and entry.get("stages") and entry["stages"] == stages(manifest, tp, dp):
                carried.setdefault(section, {})[key] = entry
    return carried


def store_gamma_choices(output_dir: Path, choices: dict, *, build_id: str, command: str,
                        section: str = "gamma_auto") -> list[str]:
    """Merge `choices` {(tp, dp): {..., "measured_tokens"}} into the manifest's `section` (gamma_auto:
    {"gamma", "predicted_speedup", ...}; method_auto: {"method", ...}; pass_curve: {"ms", "cpu", "threads"}
    with dp "-"), under the output folder's lock.
    Returns one line per choice that was not stored, and why."""
    skipped = []
    what = WHAT[section]
    try:
        with output_lock(output_dir, purpose=f"specexport bench (storing the {what} choice)", wait_s=30):
            manifest = read_manifest(output_dir)
            if manifest["build_id"] != build_id:
                return [f"{gamma_key(*k)}: not stored, the build was replaced while the bench ran" for k in choices]
            stored = manifest.setdefault(section, {})
            for (tp, dp), c in choices.items():
                key, old = gamma_key(tp, dp), lookup(manifest, tp, dp, section=section)
                if old is not None and old.get("measured_tokens", 0) > c["measured_tokens"]:
                    shown = f"γ {old['gamma']}" if section == "gamma_auto" else old["method"]
                    skipped.append(f"{key}: kept the stored {what} choice ({shown}, measured on "
                                   f"{old['measured_tokens']} tokens; this bench measured {c['measured_tokens']})")
                    continue
                stored[key] = {**c, "stages": SECTIONS[section](manifest, tp, dp), "command": command,
                               "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            write_json_atomic(Path(output_dir) / MANIFEST_NAME, manifest, tmp_dir=work_dir(output_dir))
    except SpecexportError as err:
        return [f"{what} choices not stored: {err}"]
    return skipped
