"""Trainer loops as users write them, into the CPU build of vLLM.

A synchronous trainer (no ``async`` anywhere: ``with WeightSync(...)`` and a blocking
``sync.update``), ``asyncio.run(update_weights(...))`` once per step (a fresh event loop
each time), and two multi-process ``AsyncLLM`` engines fed from one trainer through one
channel. Every step is verified: the engine's greedy tokens equal the trainer's and its
prompt logprobs match within 1e-5 (fp32).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import (
    TRAINER,
    assert_matches,
    async_outputs,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
)

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb
from streamsync.testing.peers import free_port

pytestmark = pytest.mark.vllm

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
    # One channel served every step (kept for the engine, not on it), and it is still open.
    assert not [k for k in vars(llm) if k.startswith("_streamsync")]
    assert llm.collective_rpc("streamsync_close", args=(endpoint,)) == [1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("form", "kill"),
    [
        ("shm://loops-fan-{pid}", True),
        ("zmq+tcp://127.0.0.1:{port}", False),
        ("torch+gloo://127.0.0.1:{port}", False),
    ],
)
def test_two_engines_from_one_trainer(tmp_path: Path, form: str, kill: bool) -> None:
    """Two ``AsyncLLM`` replicas, each with its engine core (and worker) in a process of its
    own, as data-parallel replicas run, fed by one channel: a shared-memory ring, zmq, or
    one gloo broadcast per bucket to both workers (``torch+gloo``). Over shm the channel is
    opened with ``require_all=False`` and one engine is then SIGKILLed: the channel goes on
    serving the other, and the report names the dead one. (Two in-process engines cannot
    share a channel: vLLM keeps the current config in a process-wide global, and their
    concurrent loads tripped an assertion inside vLLM; ``WeightSync`` refuses them.)"""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.vllm import WeightSync

    trainer = build_tiny_model(tmp_path / "first", "dense", seed=0)
    other = build_tiny_model(tmp_path / "second", "dense", seed=1)  # starts elsewhere

    def args(name: str) -> Any:
        return AsyncEngineArgs(
            model=str(tmp_path / name),
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            max_num_seqs=4,
            seed=0,
            worker_extension_cls="streamsync.vllm.WorkerExtension",
        )

    engines: list[Any] = []

    async def start(name: str) -> None:
        engines.append(AsyncLLM.from_engine_args(args(name)))

    try:
        for name in ("first", "second"):
            TRAINER.run(functools.partial(start, name), timeout=300)
        before = [
            TRAINER.run(functools.partial(async_outputs, llm), timeout=120) for llm in engines
        ]
        assert_matches(before[1], reference_outputs(other))  # each serves its own weights
        assert before[0].tokens != before[1].tokens
        endpoint = form.format(pid=os.getpid(), port=free_port())

        async def train() -> None:
            # With a kill, the dead engine is named absent after the channel's timeout.
            timeout = 20 if kill else 60
            async with WeightSync(
                engines, endpoint, bucket_bytes=BUCKET, require_all=not kill, timeout=timeout
            ) as sync:
                for step in range(3):
                    perturb(trainer, seed=500 + step)
                    want = reference_outputs(trainer)
                    report = await sync.update(ss.named_tensors(trainer))
                    assert report.complete and report.receivers == 2  # one sender, both engines
                    names = {"engine0.worker0.main", "engine1.worker0.main"}
                    assert set(report.instances) == names and not report.absent
                    assert all(r.missing == () for r in report.instances.values())
                    for llm in engines:
                        assert_matches(await async_outputs(llm), want)
                if not kill:
                    return
                # Engine 1's core process (its worker with it) dies between two steps.
                core = engines[1].engine_core.resources.engine_manager.processes[0]
                os.kill(core.pid, signal.SIGKILL)
                perturb(trainer, seed=600)
                want = reference_outputs(trainer)
                report = await sync.update(ss.named_tensors(trainer))
                assert report.complete and report.receivers == 1, report
                assert set(report.instances) == {"engine0.worker0.main"}, report
                assert any(a.startswith("engine 1: ") for a in report.absent), report
                assert_matches(await async_outputs(engines[0]), want)

        async def closed() -> list[Any]:
            alive = engines[:1] if kill else engines
            return [await llm.collective_rpc("streamsync_close") for llm in alive]

        TRAINER.run(train, timeout=600)
        # Leaving the block closed every live engine's receivers.
        assert all(c == [0] for c in TRAINER.run(closed, timeout=60))
    finally:
        for llm in engines:
            llm.shutdown()
        engines.clear()
        gc.collect()
