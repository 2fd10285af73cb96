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
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

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


def lookup(manifest: dict, target_precision: str, draft_precision: str) -> dict | None:
    """The stored choice for these precisions when it was measured on the graphs of this manifest."""
    entry = manifest.get("gamma_auto", {}).get(gamma_key(target_precision, draft_precision))
    if entry is None or entry.get("stages") != stages_of(manifest, target_precision, draft_precision):
        return None
    return entry


def carried_gamma_choices(previous: dict, manifest: dict) -> dict:
    """The previous manifest's choices that still describe the graphs of `manifest`."""
    carried = {}
    for key, entry in (previous.get("gamma_auto") or {}).items():
        tp, _, dp = key.partition("/")
        if isinstance(entry, dict) and entry.get("stages") and entry["stages"] == stages_of(manifest, tp, dp):
            carried[key] = entry
    return carried


def store_gamma_choices(output_dir: Path, choices: dict, *, build_id: str, command: str) -> list[str]:
    """Merge `choices` {(tp, dp): {"gamma", "predicted_speedup", "measured_tokens"}} into the manifest,
    under the output folder's lock. Returns one line per choice that was not stored, and why."""
    from specexport.errors import SpecexportError
    from specexport.locking import output_lock

    skipped = []
    try:
        with output_lock(output_dir, purpose="specexport bench (storing the γ choice)", wait_s=30):
            manifest = read_manifest(output_dir)
            if manifest["build_id"] != build_id:
                return [f"{gamma_key(*k)}: not stored, the build was replaced while the bench ran" for k in choices]
            stored = manifest.setdefault("gamma_auto", {})
            for (tp, dp), c in choices.items():
                key, old = gamma_key(tp, dp), lookup(manifest, tp, dp)
                if old is not None and old.get("measured_tokens", 0) > c["measured_tokens"]:
                    skipped.append(f"{key}: kept the stored choice (γ {old['gamma']}, measured on "
                                   f"{old['measured_tokens']} tokens; this bench measured {c['measured_tokens']})")
                    continue
                stored[key] = {**c, "stages": stages_of(manifest, tp, dp), "command": command,
                               "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            write_json_atomic(Path(output_dir) / MANIFEST_NAME, manifest)
    except SpecexportError as err:
        return [f"γ choices not stored: {err}"]
    return skipped
