"""The rich consoles specexport prints through: a terminal's own width on a terminal; elsewhere (a piped
build log, CI) no wrapping, so a progress line such as "... to ONNX (1.9 s)" is never broken in two.
rich wraps at 80 columns when it cannot ask a terminal; $COLUMNS, when set, still decides."""
from __future__ import annotations

import os
import sys

WIDE = 1000         # columns for output that is not a terminal: tables keep their own width, lines stay whole


def console(*, stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS"):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=WIDE, soft_wrap=True)
