"""The library's functions stay short enough to read whole: none over 80 lines (the package
less ``cli/`` and ``testing/``, as issue-level limits count it)."""

from __future__ import annotations

import ast
from pathlib import Path

import streamsync

PACKAGE = Path(streamsync.__file__).parent
LIMIT = 80


def _long_functions(limit: int) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if {"cli", "testing"} & set(path.relative_to(PACKAGE).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length}")
    return found


def test_no_library_function_over_80_lines() -> None:
    assert _long_functions(LIMIT) == []


def test_the_check_sees_long_functions() -> None:
    # The scan itself works: with a small limit it finds the package's longer functions.
    assert any("sending.py" in entry for entry in _long_functions(20))
