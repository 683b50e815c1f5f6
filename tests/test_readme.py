"""Every code block of the README and of the pages under ``docs/`` runs as printed.

A ``python`` block runs in a fresh namespace, in a temporary working directory; one that
defines ``test_*`` functions is a user's test file, run by a plain ``python -m pytest`` in a
directory of its own (no ``pyproject.toml``, no ``conftest.py``), as a user would run it.
A block preceded by ``<!-- vllm -->`` needs a real engine and runs under the ``vllm``
marker. Any other block is preceded by ``<!-- not run: why -->``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(
    r"(?:^[ \t]*(<!--[^\n]*-->)\n)?^([ \t]*)```([^\n]*)\n(.*?)^[ \t]*```", flags=re.S | re.M
)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, the comment line before it, its code."""

    page: str
    line: int
    language: str
    note: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language == "python" and not self.note.startswith("<!-- not run")


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start(3)) + 1
        name = str(page.relative_to(ROOT))
        code = textwrap.dedent(match[4]) if match[2] else match[4]
        found.append(Block(name, line, match[3].strip(), match[1] or "", code))
    return found


BLOCKS = [b for page in PAGES for b in blocks_of(page)]
#: Blocks whose output the tests below check as well; the others just run.
CHECKED = ('"memory://demo"', "async def test_my_renames", "async def delta_steps")
IN_PROCESS = [
    b
    for b in BLOCKS
    if b.runs and b.note != "<!-- vllm -->" and not any(c in b.code for c in CHECKED)
]
WITH_VLLM = [b for b in BLOCKS if b.runs and b.note == "<!-- vllm -->"]


def block(containing: str) -> Block:
    """The one block whose code contains ``containing``."""
    (found,) = [b for b in BLOCKS if containing in b.code]
    return found


def run_block(b: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run ``b`` as printed: a test file under plain pytest, anything else executed (its
    globals returned)."""
    scope: dict[str, Any] = {"__name__": "__main__"}
    if re.search(r"^(async )?def test_", b.code, flags=re.M):
        run_as_a_users_tests(b.code, tmp_path)
        return scope
    monkeypatch.chdir(tmp_path)
    exec(compile(b.code, b.id, "exec", dont_inherit=True), scope)
    return scope


def run_as_a_users_tests(code: str, directory: Path) -> None:
    """``code`` saved as a test file in ``directory`` and run by ``python -m pytest`` there, in
    a fresh interpreter with no configuration: every test must pass, none be skipped."""
    (directory / "test_from_the_docs.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^\d+ passed", proc.stdout.splitlines()[-1]), proc.stdout
    assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout


def test_every_block_either_runs_or_says_why_not() -> None:
    unmarked = [
        b.id for b in BLOCKS if not b.runs and not re.fullmatch(r"<!-- not run: \S.* -->", b.note)
    ]
    assert not unmarked, f"blocks neither python nor marked '<!-- not run: why -->': {unmarked}"
    # A block left to other tests names them: they must exist.
    named = {p for b in BLOCKS for p in re.findall(r"\b(?:tests|examples)/\w+\.py", b.note)}
    assert named and all((ROOT / p).is_file() for p in named), named
    assert IN_PROCESS and WITH_VLLM, "the docs' examples were not found"


@pytest.mark.slow  # fresh interpreters for the users' test files
@pytest.mark.parametrize("b", IN_PROCESS, ids=lambda b: b.id)
def test_the_block_runs(b: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_block(b, tmp_path, monkeypatch)


@pytest.mark.vllm
@pytest.mark.parametrize("b", WITH_VLLM, ids=lambda b: b.id)
def test_the_engine_block_runs(
    b: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: starts fast
    scope = run_block(b, tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert out.count("[ok]") >= 3, out  # one complete report per step
    # The engine now generates what the trainer's own model does.
    from streamsync.cli.verify import engine_outputs, reference_outputs

    llm, policy = scope["llm"], scope["policy"]
    try:
        got, want = engine_outputs(llm), reference_outputs(policy)
        assert got.tokens == want.tokens
        assert got.max_logprob_diff(want) <= 1e-4  # rounding; a stale tensor moves it 0.045+
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_usage_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_block(block('"memory://demo"'), tmp_path, monkeypatch)
    assert "[ok]" in capsys.readouterr().out


@pytest.mark.slow  # a fresh interpreter
def test_the_pipeline_test_example_passes_under_plain_pytest(tmp_path: Path) -> None:
    run_as_a_users_tests(block("async def test_my_renames").code, tmp_path)


def test_the_delta_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_block(block("async def delta_steps"), tmp_path, monkeypatch)
    first, *deltas = capsys.readouterr().out.splitlines()
    assert "no baseline yet" in first
    assert len(deltas) == 2 and all("delta on" in line for line in deltas)
    full = int(first.split()[0])
    assert all(int(line.split()[0]) < full / 20 for line in deltas)


def test_every_relative_link_resolves() -> None:
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in [*PAGES, ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md"]
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not broken, broken
