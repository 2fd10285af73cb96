"""io_spec.py is the only module that spells a tensor name (ARCHITECTURE.md, "A tensor").

Every other module under specexport/ names a graph input or output through io_spec's constants
(INPUT_IDS, LOGITS, past_names(i), ...) or its IO tables (ModelIO.input_names, ...). This walks
their syntax trees (ast only: nothing is imported) and lists each string literal that spells one.
Docstrings and comments are prose, not code, and are not looked at."""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specexport"
IO_SPEC = PACKAGE / "io_spec.py"

# the KV cache names, whole or with a layer (past_key, past_key.0, past_key.) and their format
# templates ("past_key.{}", "past_key.%d")
KV_NAME = re.compile(r"^(past|present)_(key|value)(\.(\d+|\{[^}]*\}|%\w)?)?$")
KV_PREFIXES = ("past_key.", "past_value.", "present_key.", "present_value.")

# The one place a name's string stands for something else: (file, function) -> why. Keep it short.
NOT_TENSOR_NAMES = {
    ("specexport/export/gqa.py", "register_gqa_schema"):
        "ONNX Runtime's GroupQueryAttention schema: the op's own parameter names (past_key, position_ids, ...)",
}


def tensor_names(io_spec: Path = IO_SPEC) -> frozenset[str]:
    """The string values of io_spec's module-level constants (NAME = "..." and A, B = "...", "...")."""
    names = set()
    for stmt in ast.parse(io_spec.read_text()).body:
        if not isinstance(stmt, ast.Assign):
            continue
        for target in stmt.targets:
            pairs = []
            if isinstance(target, ast.Name):
                pairs = [(target, stmt.value)]
            elif isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                pairs = list(zip(target.elts, stmt.value.elts))
            for name, value in pairs:
                if (isinstance(name, ast.Name) and name.id.isupper() and isinstance(value, ast.Constant)
                        and isinstance(value.value, str)):
                    names.add(value.value)
    return frozenset(names)


def _spells(text: str, names: frozenset[str]) -> bool:
    return text in names or bool(KV_NAME.match(text))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings: the first statement of a module, class or function."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                ids.add(id(first.value))
    return ids


def scan_source(source: str, names: frozenset[str], filename: str = "<string>",
                exempt: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, literal) for each string literal in source that spells a tensor name: a constant equal to
    one, or an f-string whose literal start is a KV cache name ("past_key.{i}"). `exempt`: qualified
    names of functions (or classes) whose bodies are not looked at."""
    tree = ast.parse(source, filename)
    skip = _docstrings(tree)
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
            if scope in exempt:
                return
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            whole = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if (isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith(KV_PREFIXES)
                    or all(isinstance(v, ast.Constant) for v in node.values) and _spells(whole, names)):
                found.append((node.lineno, ast.unparse(node)))
                return
            for value in node.values:          # the literal parts are not names; the {expressions} may hold some
                if isinstance(value, ast.FormattedValue):
                    visit(value, scope)
            return
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                and _spells(node.value, names)):
            found.append((node.lineno, repr(node.value)))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "")
    return sorted(found)


def offenders(root: Path = PACKAGE, names: frozenset[str] | None = None) -> list[str]:
    """"file:line: literal" for every module under root but io_spec.py."""
    names = tensor_names() if names is None else names
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == IO_SPEC.resolve():
            continue
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        exempt = frozenset(scope for (file, scope) in NOT_TENSOR_NAMES if file == rel.as_posix())
        for line, literal in scan_source(path.read_text(), names, str(path), exempt):
            out.append(f"{rel}:{line}: {literal}")
    return out


def test_the_names_come_from_io_spec():
    names = tensor_names()
    for expected in ("input_ids", "position_ids", "attention_mask", "logits_rows", "logits", "hidden_states",
                     "aux_hidden_states", "head_topk_ids", "head_topk_logprobs", "features", "draft_hidden",
                     "topk_ids", "topk_logprobs", "past_key", "past_value", "present_key", "present_value"):
        assert expected in names, expected


def test_the_scanner_catches_a_planted_literal(tmp_path):
    names = tensor_names()
    source = textwrap.dedent('''
        """A module docstring may say logits and past_key.0 freely."""
        import numpy as np


        def run(session, tokens, layers):
            """So may a function's: input_ids."""
            feeds = {"input_ids": tokens}
            feeds.update({f"past_key.{i}": np.zeros(1) for i in range(layers)})
            names = ["present_value.3", "logits_raw", "the logits"]
            return session.run(["logits"], feeds)[0], names, f"{'hidden_states'}"
    ''')
    module = tmp_path / "planted.py"
    module.write_text(source)
    assert scan_source(source, names) == [
        (8, "'input_ids'"), (9, "f'past_key.{i}'"), (10, "'present_value.3'"), (11, "'hidden_states'"),
        (11, "'logits'")]
    found = offenders(tmp_path, names)
    assert len(found) == 5 and all(f.startswith(str(module) + ":") for f in found), found
    assert scan_source('"""logits"""\nx = 1\n', names) == []            # a docstring is prose
    exempted = scan_source(source, names, exempt=frozenset({"run"}))
    assert exempted == [], exempted                                  # an exempt function's body is skipped
    assert scan_source("def f():\n    return 'logits'\n", names, exempt=frozenset({"g"})) == [(2, "'logits'")]
    for file, function in NOT_TENSOR_NAMES:                          # an exemption names a real function
        defined = {n.name for n in ast.walk(ast.parse((ROOT / file).read_text()))
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        assert function in defined, (file, function)


def test_only_io_spec_spells_a_tensor_name():
    found = offenders()
    assert not found, ("these literals spell a tensor name; use io_spec's constants (INPUT_IDS, LOGITS, "
                       "past_names(i), ...) or its IO tables instead:\n  " + "\n  ".join(found))
