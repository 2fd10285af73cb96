"""The folder a bench report goes to: `<build>/bench` (the build's quick bench: `bench/quick`) or
`--out DIR`. The report replaces only files the bench wrote (`specexport.owned`): a new folder is made
and marked; an earlier report folder is reused; a folder of someone else's is written into only when
none of the report's files exists there yet (then they are recorded as the bench's)."""
from __future__ import annotations

import json
from pathlib import Path

from specexport import owned
from specexport.errors import SpecexportError

BY = "specexport bench"
REPORT_FILES = ("report.md", "report.json", "speedup_vs_gamma.png", "tokens_per_s.png")


def claim_report_folder(out: Path) -> Path:
    """The report folder, checked before the bench runs (minutes); raises SpecexportError naming a file
    of someone else's that the report would replace."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SpecexportError(f"--out: {out} exists and is not a folder")
    if not out.exists():
        owned.create(out, by=BY, sealed=True)
        return out
    if owned.is_owned(out, BY):
        return out
    if _earlier_report(out):                 # a report folder of a specexport from before markers
        owned.adopt(out, by=BY, files=[f for f in REPORT_FILES if (out / f).is_file()])
        return out
    clash = [f for f in REPORT_FILES if (out / f).exists()]
    if clash:
        raise SpecexportError(f"--out: {out / clash[0]} exists and was not written by {BY}; choose another "
                              f"folder for the report")
    return out


def record_report_files(out: Path, names) -> None:
    """After writing: the report's files are the bench's (later benches may replace them)."""
    out = Path(out)
    record = owned.owner(out)
    files = dict(record["files"] or {}) if record is not None and record["by"] == BY else {}
    files.update({n: (out / n).stat().st_size for n in names if (out / n).is_file()})
    if record is None:
        owned.adopt(out, by=BY, files=list(files))
    else:
        owned.own_files(out, files)


def _earlier_report(out: Path) -> bool:
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"rows", "output_dir", "command"} <= set(report)
