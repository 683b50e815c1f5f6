"""Trainer loops as users write them, into the CPU build of vLLM.

A synchronous trainer (no ``async`` anywhere: ``with WeightSync(...)`` and a blocking
``sync.update``), ``asyncio.run(update_weights(...))`` once per step (a fresh event loop
each time), and two engines fed from one trainer through one channel. Every step is
verified: the engine's greedy tokens equal the trainer's and its prompt logprobs match
within 1e-5 (fp32).
"""

from __future__ import annotations

import asyncio
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
)

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

BUCKET = 256 << 10


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("loops")
    trainer = build_tiny_model(path, "dense", seed=0)
    llm = make_llm(str(path))
    yield llm, trainer
    shutdown(llm)


def test_a_synchronous_trainer_loop(dense: tuple[Any, torch.nn.Module]) -> None:
    from streamsync.vllm import WeightSync

    llm, trainer = dense
    endpoint = f"shm://loops-sync-{os.getpid()}"
    with WeightSync(llm, endpoint, bucket_bytes=BUCKET) as sync:
        for step in range(3):
            perturb(trainer, seed=300 + step)
            want = reference_outputs(trainer)
            assert engine_outputs(llm).tokens != want.tokens  # the perturbation is visible
            report = sync.update(ss.named_tensors(trainer))
            assert report.complete and report.receivers == 1
            assert report.instances["worker0.main"].missing == ()
            assert_matches(engine_outputs(llm), want)
    # Leaving the block closed the workers' receivers too.
    assert llm.collective_rpc("streamsync_close", args=(endpoint,)) == [0]


def test_update_weights_in_a_fresh_event_loop_per_step(
    dense: tuple[Any, torch.nn.Module], tmp_path: Path
) -> None:
    from streamsync.vllm import update_weights

    llm, trainer = dense
    endpoint = f"zmq+ipc://{tmp_path}/loops.sock"
    for step in range(3):
        perturb(trainer, seed=400 + step)
        want = reference_outputs(trainer)
        report = asyncio.run(
            update_weights(llm, ss.named_tensors(trainer), endpoint=endpoint, bucket_bytes=BUCKET)
        )
        assert report.complete and report.instances["worker0.main"].missing == ()
        assert_matches(engine_outputs(llm), want)
    # One channel served every step (kept on the engine), and it is still open.
    assert llm.collective_rpc("streamsync_close", args=(endpoint,)) == [1]


@pytest.mark.slow
def test_two_engines_from_one_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas, each with its engine core (and worker) in a process of its own, as
    data-parallel replicas run. (Two in-process engines cannot load concurrently in one
    process: vLLM keeps the current config in a process-wide global, and concurrent
    reloads tripped an assertion inside vLLM in about one run in four.)"""
    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    trainer = build_tiny_model(tmp_path / "first", "dense", seed=0)
    other = build_tiny_model(tmp_path / "second", "dense", seed=1)  # starts elsewhere
    engines = [make_llm(str(tmp_path / "first"))]
    try:
        engines.append(make_llm(str(tmp_path / "second")))
        first, second = engines
        assert_matches(engine_outputs(second), reference_outputs(other))  # its own weights
        assert engine_outputs(first).tokens != engine_outputs(second).tokens
        with WeightSync(engines, f"shm://loops-fan-{os.getpid()}", bucket_bytes=BUCKET) as sync:
            for step in range(3):
                perturb(trainer, seed=500 + step)
                want = reference_outputs(trainer)
                report = sync.update(ss.named_tensors(trainer))
                assert report.complete and report.receivers == 2  # one sender, both engines
                assert set(report.instances) == {"engine0.worker0.main", "engine1.worker0.main"}
                assert all(r.missing == () for r in report.instances.values())
                for llm in engines:
                    assert_matches(engine_outputs(llm), want)
        # Leaving the block closed every engine's receivers.
        assert [llm.collective_rpc("streamsync_close") for llm in engines] == [[0], [0]]
    finally:
        for llm in engines:
            shutdown(llm)
