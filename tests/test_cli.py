"""The ``streamsync`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamsync.cli import main


def test_demo_runs_verifies_and_writes_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "reports.json"
    assert main(["demo", "--engine", "fake", "--steps", "2", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("verified=yes" in line for line in lines)
    reports = json.loads(out.read_text())
    assert [r["step"] for r in reports] == [1, 2]
    assert all(r["verified"] and r["nbytes"] > 0 for r in reports)


@pytest.mark.vllm
def test_demo_with_real_vllm_engine(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    out = tmp_path / "reports.json"
    assert main(["demo", "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2/2 steps verified" in printed
    reports = json.loads(out.read_text())
    assert [r["step"] for r in reports] == [1, 2]
    assert all(r["verified"] and r["complete"] and r["max_logprob_diff"] < 1e-4 for r in reports)
