"""The code stays readable: functions fit on a screen, and library code logs instead of printing."""

from __future__ import annotations

import ast

from tests.conftest import REPO

MAX_FUNCTION_LINES = 80


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def test_no_function_in_src_is_longer_than_80_lines():
    long = []
    for path in sorted((REPO / "src").rglob("*.py")):
        for node in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_library_code_does_not_print():
    printing = []
    for path in sorted((REPO / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert printing == []
