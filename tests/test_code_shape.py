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


def _calls(attribute: str) -> list[str]:
    """Where the library calls ``<something>.<attribute>(...)``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if {"cli", "testing"} & set(path.relative_to(PACKAGE).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == attribute
            ):
                found.append(str(path.relative_to(PACKAGE)))
    return found


def test_one_place_opens_route_senders_and_one_runs_the_commit_sequence() -> None:
    assert _calls("open_on") == ["engine/fanout.py"]
    assert _calls("apply_staged") == ["engine/staged.py"]


def test_the_sync_round_does_not_branch_on_ranks_sharding_or_lora() -> None:
    # The cut (chosen when the fan-out opens) and what a lifecycle sends decide those.
    tree = ast.parse((PACKAGE / "engine" / "channel.py").read_text())
    (channel,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineChannel")
    methods = {
        n.name: n for n in channel.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    for name in ("sync_round", "_run", "_receive", "_conclude"):
        named = {
            node.attr if isinstance(node, ast.Attribute) else node.id
            for node in ast.walk(methods[name])
            if isinstance(node, ast.Attribute | ast.Name)
        }
        assert not {"ranks", "sharded", "lora", "_plans"} & named, name
