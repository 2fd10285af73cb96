"""What the trainers (distill-draft, train-heads) write and keep: the resumable-state folder beside --out,
atomic saves, the output folder put into place (only the command's own files replaced: specexport.owned),
options as JSON, and the progress bar."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from specexport import owned
from specexport._optional import require


def atomic_save(obj, path: Path) -> None:
    torch = require("torch")
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def distill_state_dir(out: Path) -> Path:
    """The resumable state, beside the output folder (which only ever appears complete). State that
    an older version kept inside the output folder is moved here."""
    state = out.parent / f".{out.name}.distill"
    legacy = out / ".distill"
    if legacy.is_dir() and not state.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(legacy, state)
    return state


def command_of(cfg) -> str:
    """The command whose marker an output or state folder of `cfg`'s carries."""
    return "specexport train-heads" if hasattr(cfg, "kind") else "specexport distill-draft"


# Files the state folder held before state folders were marked (adopted as the command's).
STATE_FILES = {"data.pt", "state.pt", "features.pt"}


def state_folder(path: Path, cfg) -> Path:
    """The resumable-state folder beside the output, the command's own (`specexport.owned`): made marked,
    or an earlier run's (a state folder from before markers is adopted when it holds only state files)."""
    by = command_of(cfg)
    if path.is_dir() and not owned.is_owned(path):
        names = {p.name for p in path.iterdir()}
        if names <= STATE_FILES | {f"{n}.tmp" for n in STATE_FILES}:
            owned.adopt(path, by=by, files=sorted(names))
    return owned.claim(path, by=by)


def output_partial(cfg) -> Path:
    """A new marked folder beside --out to write the outputs into."""
    return owned.fresh(cfg.out.parent, f".{cfg.out.name}.partial-", by=command_of(cfg))


def place_outputs(partial: Path, cfg) -> None:
    """Seal the written outputs and put them at --out, replacing only files an earlier run of the same
    command wrote (or, with --force in someone else's folder, files of the same names); a failure leaves
    --out as it was and removes the partial folder."""
    try:
        owned.check_destination(cfg.out, by=command_of(cfg), force=cfg.force)
        owned.seal(partial)
        owned.place(partial, cfg.out, by=command_of(cfg))
    finally:
        owned.remove(partial)


def json_config(cfg) -> dict:
    """The options as JSON values (paths as strings, tuples as lists, None as null)."""
    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return {k: plain(v) for k, v in asdict(cfg).items()}


def say(console, text):
    if console is not None:
        console.print(text)


def progress_bar(console, total: int, done: int, label: str = "distill"):
    """A rich progress bar with loss and tokens/s; call with step None to close it."""
    if console is None:
        return lambda *a: None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn(), console=console)
    task = bar.add_task(label, total=total, completed=done, info="")
    bar.start()

    def update(step, loss, tps):
        if step is None:
            bar.stop()
            return
        bar.update(task, completed=step, info="" if loss is None else f"loss {loss:.4f}  {tps:,.0f} tok/s")

    return update
