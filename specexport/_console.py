"""The rich consoles specexport prints through: a terminal's own width on a terminal; elsewhere (a piped
build log, CI) no wrapping, so a progress line such as "... to ONNX (1.9 s)" is never broken in two.
rich wraps at 80 columns when it cannot ask a terminal; $COLUMNS, when set, still decides."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

WIDE = 1000         # columns for output that is not a terminal: tables keep their own width, lines stay whole


def console(*, stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS"):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=WIDE, soft_wrap=True)


class Steps:
    """What a long step reports while it runs: its total once known (`total`), each unit done (`advance`).
    Without a console (tests, quiet builds) it records nothing and shows nothing."""

    def __init__(self, bar=None, task=None):
        self._bar, self._task = bar, task

    def total(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=n)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def say(self, what: str) -> None:
        """The live line's label: what the step is doing now."""
        if self._bar is not None:
            self._bar.update(self._task, description=what)


@contextmanager
def progress(console, label: str, total: int | None = None):
    """A live line for a step that takes more than a few seconds: a spinner, the label and the time spent;
    with a total (given here or later through the yielded Steps), a bar, n/N and the time left, estimated
    from the rate so far (no estimate is printed before there is one). Transient: the caller prints the
    finished line. On a console that is not a terminal (a piped log, CI) nothing is drawn at all."""
    if console is None or not console.is_terminal:
        yield Steps()
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    bar = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console, transient=True)
    with bar:
        yield Steps(bar, bar.add_task(label, total=total))
