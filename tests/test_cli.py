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


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_help_reads_as_help(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps option help to the terminal
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "--timeout" in text and "--json" in text


def test_bench_help_lists_every_scenario_and_transport(capsys: pytest.CaptureFixture[str]) -> None:
    from streamsync.cli.bench.scenarios import SCENARIOS, TRANSPORTS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for name, scenario in SCENARIOS.items():
        assert f"  {name} " in text and scenario.description in text
    for name in TRANSPORTS:
        assert f"  {name} " in text


@pytest.mark.vllm
def test_demo_with_real_vllm_engine(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "reports.json"
    assert main(["demo", "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2/2 steps verified" in printed
    reports = json.loads(out.read_text())
    assert [r["step"] for r in reports] == [1, 2]
    assert all(r["verified"] and r["complete"] and r["max_logprob_diff"] < 1e-4 for r in reports)


def test_demo_hides_engine_output_unless_it_fails(capfd: pytest.CaptureFixture[str]) -> None:
    import os

    from streamsync.cli.demo import _engine_output

    with _engine_output(verbose=False) as progress:
        os.write(2, b"engine noise\n")  # what C++ warnings do: straight to fd 2
        progress.write("progress bar\n")
        progress.flush()
    err = capfd.readouterr().err
    assert "progress bar" in err and "engine noise" not in err
    with pytest.raises(RuntimeError), _engine_output(verbose=False):
        os.write(2, b"why it failed\n")
        raise RuntimeError("boom")
    assert "why it failed" in capfd.readouterr().err
    with _engine_output(verbose=True):
        os.write(2, b"shown when verbose\n")
    assert "shown when verbose" in capfd.readouterr().err
