"""The README's in-process examples, run as written (the vLLM ones run in the engine tests)."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def block(containing: str) -> str:
    (found,) = [b for b in BLOCKS if containing in b]
    return found


def test_the_usage_example_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    exec(compile(block('"memory://demo"'), "README.md", "exec"), {})
    assert "[ok]" in capsys.readouterr().out


async def test_the_pipeline_test_example_passes() -> None:
    scope: dict[str, object] = {}
    exec(compile(block("async def test_my_renames"), "README.md", "exec"), scope)
    await scope["test_my_renames_match_the_model"]()  # type: ignore[operator]


def test_the_delta_example_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    exec(compile(block("async def delta_steps"), "README.md", "exec"), {})
    first, *deltas = capsys.readouterr().out.splitlines()
    assert "no baseline yet" in first
    assert len(deltas) == 2 and all("delta on" in line for line in deltas)
    full = int(first.split()[0])
    assert all(int(line.split()[0]) < full / 20 for line in deltas)
