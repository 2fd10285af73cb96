"""Prompt files: JSON lines, one prompt string (or {"prompt": ...}) per line; read by `specexport bench
--prompts` and by the build's `eagle.prompts` (tree: auto's decoding contexts)."""
from __future__ import annotations

import json
from pathlib import Path

from specexport.errors import SpecexportError


def json_lines(path: Path, *, where: str, example: str = ""):
    """(line number, value) of each non-blank line of a JSON-lines file; unreadable files and lines that
    are not JSON are one-line errors naming `where`, the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecexportError(f"{where}: {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecexportError(f"{where}: {path}: cannot be read as UTF-8 text ({err})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecexportError(f"{where}: {path} line {number}: not JSON ({err.msg}){example}") from None


def read_prompts(path: Path, *, where: str = "--prompts") -> tuple[str, ...]:
    """A JSON-lines file of prompt strings (or objects with a "prompt" string); errors name the line."""
    prompts = []
    for number, value in json_lines(path, where=where,
                                    example='; expected one JSON string per line, e.g. "def f(x):"'):
        if isinstance(value, dict) and isinstance(value.get("prompt"), str):
            value = value["prompt"]
        if not isinstance(value, str) or not value:
            raise SpecexportError(f"{where}: {path} line {number}: expected a non-empty JSON string (or "
                                  f"{{\"prompt\": ...}}), got {type(value).__name__}")
        prompts.append(value)
    if not prompts:
        raise SpecexportError(f"{where}: {path} holds no prompts")
    return tuple(prompts)
