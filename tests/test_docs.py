"""The documentation's promises that nothing else checks: README.md and docs/*.md link only to files
(and headings) that exist, every `specexport <command> --flag` they show is an option of that command,
every pip extra they install exists, and mkdocs.yml's nav lists exactly the pages in docs/.

Fast and offline: plain text parsing, the click group imported from specexport.cli (no mkdocs)."""
from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

# Documented flags that are not options of the command they follow, each with the reason it stays.
# Keep this empty: when a page shows a flag the CLI lacks, correct the page.
FLAG_ALLOWLIST: dict[tuple[str, str], str] = {}


@dataclass
class Page:
    path: Path
    prose: str                      # the text with fenced code blocks blanked (line numbers kept)
    code: list[tuple[int, str]]     # (line number, line) of every fenced code block line

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


def _read(path: Path) -> Page:
    prose, code, fence = [], [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        opening = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and opening:
            fence = opening.group(1)
            prose.append("")
        elif fence is not None and re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
            fence = None
            prose.append("")
        elif fence is not None:
            code.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    return Page(path, "\n".join(prose), code)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def _inline_code(page: Page) -> list[tuple[int, str]]:
    return [(_line(page.prose, m.start()), " ".join(m.group(2).split())) for m in INLINE_CODE.finditer(page.prose)]


def _without_inline_code(text: str) -> str:
    """The prose with inline code spans blanked (offsets and line breaks kept): `[[0], [1]]` is no link."""
    return INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


# ---------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's and mkdocs' anchor for a heading (the two agree on ASCII headings without ' - ')."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"\s+", "-", text)


def _anchors(path: Path) -> set[str]:
    page, seen = _read(path), {}
    for line in page.prose.split("\n"):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if m:
            base = slug(m.group(1))
            seen[base] = seen.get(base, -1) + 1
            if seen[base]:
                seen[f"{base}-{seen[base]}"] = 0       # GitHub numbers repeated headings -1, -2, ...
                seen[f"{base}_{seen[base]}"] = 0       # mkdocs _1, _2, ...
    return set(seen)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _link_problems(page: Page) -> list[str]:
    problems = []
    prose = _without_inline_code(page.prose)
    for m in LINK.finditer(prose):
        target = m.group(1)
        where = f"{page.name}:{_line(prose, m.start())}: link ({target})"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue                                   # http:, https:, mailto: ... not checked offline
        path_part, _, anchor = target.partition("#")
        if path_part.startswith("/"):
            problems.append(f"{where}: an absolute path; link relative to the page")
            continue
        file = (page.path.parent / path_part).resolve() if path_part else page.path
        if not file.exists():
            problems.append(f"{where}: {path_part} does not exist")
            continue
        if ROOT not in file.parents and file != ROOT:
            problems.append(f"{where}: points outside the repository")
            continue
        if anchor:
            if file.suffix != ".md":
                problems.append(f"{where}: an anchor into {file.relative_to(ROOT)}, which is no markdown page")
            elif anchor not in _anchors(file):
                problems.append(f"{where}: no heading in {file.relative_to(ROOT)} makes the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_is_closed(path):
    """An unclosed fence turns the rest of a page into code, and hides its links from the checks below."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        opening = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and opening:
            fence, opened = opening.group(1), number
        elif fence is not None and re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
            fence = None
    assert fence is None, f"{path.relative_to(ROOT)}:{opened}: a code block opened here is never closed"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    problems = _link_problems(_read(path))
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slug_matches_github_and_mkdocs():
    assert slug("model.yaml") == "modelyaml"
    assert slug("GPU precisions: fp16, fp8, int8_sq") == "gpu-precisions-fp16-fp8-int8_sq"
    assert slug("A real model: SmolLM2-135M-Instruct") == "a-real-model-smollm2-135m-instruct"
    assert slug("Serving (OpenAI-compatible)") == "serving-openai-compatible"
    assert slug("The `--draft-stop` option") == "the---draft-stop-option"


def test_the_link_check_catches_what_it_should(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# Title\n\n## Some section: here\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#some-section-here) [ok](b.md) [ok](#top-heading) `[no](link.md)`\n"
                    "# Top heading\n[bad](c.md) [bad](b.md#nothere)\n```\n[no](code.md)\n```\n"
                    "[web](https://example.com/x.md)\n")
    problems = _link_problems(_read(page))
    assert len(problems) == 2, problems
    assert "a.md:3: link (c.md)" in problems[0] and "does not exist" in problems[0]
    assert "a.md:3: link (b.md#nothere)" in problems[1] and "#nothere" in problems[1]


# ---------------------------------------------------------------- CLI flags

def _command_options() -> dict[str, set[str]]:
    from specexport.cli import cli

    root = click.Context(cli, info_name="specexport", **cli.context_settings)
    options = {}
    for name, command in cli.commands.items():
        ctx = click.Context(command, parent=root, info_name=name, **command.context_settings)
        options[name] = {opt for param in command.get_params(ctx)
                         for opt in (*param.opts, *getattr(param, "secondary_opts", []))
                         if opt.startswith("-")}
    return options


INVOCATION = re.compile(r"(?<![\w./-])specexport\s+([a-z][a-z0-9_-]*)")
SEPARATOR = re.compile(r"&&|\|\||\s\|\s|;")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")


def _uses(text: str, commands: set[str], bare: bool) -> list[tuple[str, str, str]]:
    """(command, flag, the command as written) for every flag after `specexport <command>` in text; with
    bare, also for a span that starts with a command name (`generate --precision int8`). A command word
    without flags is not returned: quoted messages say `... another specexport process (...)`."""
    starts = [(m.start(), m.end(), m.group(1)) for m in INVOCATION.finditer(text)]
    if bare:
        m = re.match(r"\s*([a-z][a-z0-9-]*)\s+-", text)
        if m and m.group(1) in commands and not starts:
            starts = [(m.start(1), m.end(1), m.group(1))]
    uses = []
    for i, (start, end, command) in enumerate(starts):
        stop = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        separator = SEPARATOR.search(text, end, stop)
        segment = text[end:separator.start() if separator else stop]
        shown = " ".join(text[start:separator.start() if separator else stop].split())
        uses += [(command, flag, shown) for flag in FLAG.findall(segment)]
    return uses


def _flag_problems(page: Page, options: dict[str, set[str]]) -> list[str]:
    units = []
    code = list(page.code)
    while code:                                        # a fenced line ending in \ continues on the next
        number, line = code.pop(0)
        while line.rstrip().endswith("\\") and code:
            line = line.rstrip()[:-1] + " " + code.pop(0)[1]
        units.append((number, line, False))
    units += [(number, span, True) for number, span in _inline_code(page)]
    problems = []
    for number, text, bare in units:
        for command, flag, shown in _uses(text, set(options), bare):
            where = f"{page.name}:{number}: `{shown[:100]}`"
            if command not in options:
                problems.append(f"{where}: `specexport {command}` is no command (commands: {sorted(options)})")
            elif flag not in options[command] and (command, flag) not in FLAG_ALLOWLIST:
                problems.append(f"{where}: {flag} is no option of `specexport {command}`")
    return problems


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_flag_exists(path):
    problems = _flag_problems(_read(path), _command_options())
    assert not problems, "flags the CLI does not have:\n" + "\n".join(problems)


def test_the_flag_check_catches_what_it_should(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "a.md"
    page.write_text("```bash\npip install -e . && specexport generate d p --max-new-tokens 8 --nope  # --chat\n"
                    "python -m pytest -q --nope2\nspecexport bench d \\\n  --gammas 2 --nope3\n```\n"
                    "Run `generate --precision int8 --nope4`, `specexport\nserve d --nope5`, `--method x` "
                    "and `specexport frobnicate d --x`; `a specexport process (pid)` is prose.\n")
    problems = _flag_problems(_read(page), _command_options())
    expected = ["a.md:2: `specexport generate d p --max-new-tokens 8 --nope # --chat`: --nope is no option of "
                "`specexport generate`", "a.md:4: `specexport bench d --gammas 2 --nope3`: --nope3 is no option",
                "a.md:7: `generate --precision int8 --nope4`: --nope4 is no option of `specexport generate`",
                "a.md:7: `specexport serve d --nope5`: --nope5 is no option of `specexport serve`",
                "a.md:8: `specexport frobnicate d --x`: `specexport frobnicate` is no command"]
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected)), problems


def test_the_pages_show_flags_at_all():
    """The flag check reads what the pages show: a parser that found nothing would pass vacuously."""
    options, seen = _command_options(), set()
    for path in PAGES:
        page = _read(path)
        for _number, text, bare in [*((n, t, False) for n, t in page.code), *((n, t, True) for n, t in _inline_code(page))]:
            seen |= {(command, flag) for command, flag, _ in _uses(text, set(options), bare)}
    assert {("generate", "--max-new-tokens"), ("bench", "--gammas"), ("train-heads", "--kind"),
            ("serve", "--port"), ("export-triton", "--instances"), ("distill-draft", "--layers")} <= seen


# ---------------------------------------------------------------- pip extras

def test_every_extra_the_pages_install_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    problems = []
    for path in PAGES:
        page = _read(path)
        text = page.prose + "\n" + "\n".join(line for _, line in page.code)
        for m in re.finditer(r"(?:specexport|\.)\[([A-Za-z0-9_, -]+)\]", text):
            for extra in (e.strip() for e in m.group(1).split(",")):
                if extra and extra not in extras:
                    problems.append(f"{page.name}: {m.group(0)}: no extra {extra!r} in pyproject.toml")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- mkdocs.yml

def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries if isinstance(entries, list) else [entries]:
        if isinstance(entry, dict):
            for value in entry.values():
                pages += _nav_pages(value)
        elif isinstance(entry, str) and not re.match(r"^[a-z][a-z0-9+.-]*:", entry, re.I):
            pages.append(entry)
    return pages


def test_mkdocs_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs_dir = ROOT / config.get("docs_dir", "docs")
    assert docs_dir == DOCS, f"mkdocs.yml: docs_dir is {config.get('docs_dir')!r}, the tests read docs/"
    listed = _nav_pages(config.get("nav", []))
    missing = [page for page in listed if not (docs_dir / page).is_file()]
    assert not missing, f"mkdocs.yml: nav lists pages that do not exist in docs/: {missing}"
    unlisted = sorted(str(p.relative_to(docs_dir)) for p in docs_dir.rglob("*.md")
                      if str(p.relative_to(docs_dir)) not in listed)
    assert not unlisted, f"mkdocs.yml: nav does not list {unlisted}"
    repeated = sorted({page for page in listed if listed.count(page) > 1})
    assert not repeated, f"mkdocs.yml: nav lists {repeated} more than once"
