"""The examples run as documented."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import extra

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


@pytest.mark.vllm
def test_the_synchronous_vllm_example_runs() -> None:
    """``examples/vllm_sync.py``: a real engine, three blocking syncs, each checked against
    the trainer's greedy tokens by the example itself."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "vllm_sync.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, proc.stdout
    assert all("[ok]" in s and s.endswith("engine matches the trainer: True") for s in steps)


@pytest.mark.vllm
def test_the_ray_rl_loop_runs_as_a_user_runs_it(tmp_path: Path) -> None:
    """``examples/ray_rl_loop.py`` copied into a fresh directory and run with ``python
    ray_rl_loop.py``, nothing of the repository on the path: a three-node Ray cluster on this
    machine, two engine actors on two nodes, staged syncs while they generate."""
    import os
    import shutil

    extra("ray", "ray")
    script = tmp_path / "ray_rl_loop.py"
    shutil.copy(EXAMPLES / "ray_rl_loop.py", script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "STREAMSYNC"))}
    proc = subprocess.run(
        [sys.executable, script.name, "--steps", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("[ok]" in s for s in steps), proc.stdout
    assert "engines match the policy: True" in proc.stdout.splitlines(), proc.stdout
