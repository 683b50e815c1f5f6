"""Real syncs into the CPU build of vLLM: a dense Qwen3, over shm, zmq+ipc and zmq+tcp.

The engine starts on weights A; the trainer (a Transformers model) is perturbed and synced
three times per transport. After every sync the engine's greedy tokens equal the trainer's
and its prompt logprobs match within 1e-5 (fp32).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import (
    assert_matches,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
    sync,
)

from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("dense")
    trainer = build_tiny_model(path, "dense", seed=0)
    llm = make_llm(str(path))
    yield llm, trainer
    shutdown(llm)


@pytest.mark.parametrize("transport", ["shm", "zmq+ipc", "zmq+tcp"])
def test_dense_three_syncs(
    dense: tuple[Any, torch.nn.Module], transport: str, tmp_path: Path
) -> None:
    llm, trainer = dense
    endpoint = {
        "shm": f"shm://dense-{os.getpid()}",
        "zmq+ipc": f"zmq+ipc://{tmp_path}/dense.sock",
        "zmq+tcp": "zmq+tcp://127.0.0.1:0",  # bound when the channel opens
    }[transport]
    for step in range(3):
        before = engine_outputs(llm)
        perturb(trainer, seed=100 * step + len(transport))
        want = reference_outputs(trainer)
        assert before.tokens != want.tokens  # the perturbation is visible
        report = sync(llm, trainer, endpoint)
        assert report.complete and report.receivers == 1
        assert report.instances["worker0.main"].missing == ()
        assert_matches(engine_outputs(llm), want)
