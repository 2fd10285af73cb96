"""The house rules ARCHITECTURE.md states, checked: the import layers and no import cycles (import-linter,
contracts in pyproject.toml), and no module over ~400 lines without a reason in its docstring."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 420


def test_import_layers_and_no_cycles(capsys):
    from importlinter.cli import lint_imports

    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    out = capsys.readouterr().out
    broken = out[out.find("Broken contracts"):] if "Broken contracts" in out else out[-3000:]
    assert code == 0, f"import contracts broken (see ARCHITECTURE.md for the layers):\n{broken}"


def test_long_modules_say_why():
    """A module over MAX_LINES lines says why in its docstring ("Longer than ... because ...")."""
    long = []
    for path in sorted((ROOT / "specexport").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "longer than" not in doc.lower():
                long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, f"split these modules or say in their docstring why they are longer than {MAX_LINES} lines: {long}"


def test_no_import_cycle_at_all_counting_packages_and_imports_in_functions():
    """acyclic_siblings compares sibling modules only: a package that imports its own module which imports the
    package back (plugins.cpu and its tiers, serve and its guard, once) passes it. Here every import counts,
    in functions too (grimp's graph), and no module may reach itself."""
    import grimp

    graph = grimp.build_graph("specexport", cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    loops, state = [], {}

    def visit(module, path):                     # depth-first; a module met again on the path is a loop
        state[module] = "open"
        for nxt in sorted(edges[module]):
            if state.get(nxt) == "open":
                loops.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: a function two modules share is public in one of
    them (the GGUF stages' helpers, the bench's row and timing functions once were not)."""
    shared = []
    for path in sorted((ROOT / "specexport").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specexport"):
                source = ROOT / Path(*node.module.split("."))
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    module = (source / f"{alias.name}.py").is_file() or (source / alias.name).is_dir()
                    if private and not module:
                        shared.append(f"{path.relative_to(ROOT)}: {alias.name} from {node.module}")
    assert not shared, "make these public where they are defined:\n" + "\n".join(shared)


def test_the_architecture_map_names_every_package_long_module_and_kernel_unit():
    """ARCHITECTURE.md stays current: every package (by its path, `runtime/backends/`), every module over 300
    lines (by its path, or its file name where its package's line names it) and every C++ unit is named."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    package = ROOT / "specexport"
    missing = [f"package {p.parent.relative_to(package).as_posix()}/" for p in sorted(package.rglob("__init__.py"))
               if p.parent != package and f"{p.parent.relative_to(package).as_posix()}/" not in text]
    missing += [f"module {p.relative_to(package).as_posix()}" for p in sorted(package.rglob("*.py"))
                if p.read_text().count("\n") > 300 and p.relative_to(package).as_posix() not in text
                and p.name not in text]
    missing += [f"unit {p.name}" for p in sorted(package.rglob("*.cc")) if p.name not in text]
    assert not missing, "ARCHITECTURE.md does not name: " + ", ".join(missing)
