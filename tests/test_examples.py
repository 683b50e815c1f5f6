"""The examples run as documented."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow  # a fresh interpreter each: make test, not the edit loop
@pytest.mark.parametrize("script", ["trainer_loop.py", "swap_transport.py", "moe_pipeline.py"])
def test_example_runs(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [script])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capsys.readouterr().out
    assert "[ok]" in out
