"""The live progress line long steps show (_console.progress): a bar with n/N once a total is known, a spinner
and the time spent before; nothing at all without a console (tests, quiet builds)."""
from __future__ import annotations

import io

from rich.console import Console

from specexport._console import Steps, progress


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=120, color_system=None), out


def test_a_step_with_a_total_shows_its_count():
    console, out = _terminal()
    with progress(console, "sampling", total=4) as steps:
        for _ in range(4):
            steps.advance()
    assert "sampling" in out.getvalue() and "4/4" in out.getvalue()


def test_a_total_and_a_label_can_come_later():
    console, out = _terminal()
    with progress(console, "converting") as steps:
        steps.say("converting: writing its tensors")
        steps.total(2)
        steps.advance(2)
    assert "writing its tensors" in out.getvalue() and "2/2" in out.getvalue()


def test_without_a_console_nothing_is_shown():
    with progress(None, "x", total=3) as steps:
        assert isinstance(steps, Steps)
        steps.total(5)
        steps.advance()
        steps.say("y")                               # no console: every call is a no-op
