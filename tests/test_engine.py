"""The engine seam without vLLM: a second engine is one client plus one sink.

``ThreadEngine`` is an :class:`~streamsync.engine.EngineClient` whose workers are threads,
each with its own event loop (a :class:`~streamsync.worker.WorkerReceivers`) and a
``ModuleSink``; options and results cross its "RPC" through msgpack, as they cross vLLM's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
import torch

import streamsync as ss
from streamsync.engine import (
    WORKER_PROTOCOL,
    EngineClient,
    WeightSync,
    WorkerOptions,
    WorkerResult,
    update_engine,
)
from streamsync.worker import WorkerReceivers


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))


class MainSink(ss.ModuleSink):
    """A ``ModuleSink`` that reports itself as the worker's ``"main"`` instance."""

    def finalize(self) -> ss.LoadResult:
        result = super().finalize()
        return msgspec.structs.replace(result, instances={"main": result})


def rpc(value: Any) -> Any:
    """What crossing an engine's RPC leaves of ``value``: plain msgpack values."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value))


class ThreadEngine:
    """An engine whose workers are threads; each serves one module."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules
        self.workers = [WorkerReceivers(name=f"fake-worker{i}") for i in range(len(modules))]
        self.resets = 0
        self.closed = 0

    @property
    def receivers(self) -> int:
        return len(self.workers)

    def _worker_receive(self, rank: int, endpoint: str, options: Any) -> dict[str, Any]:
        # The worker side, as an engine extension writes it.
        try:
            opts = WorkerOptions.from_wire(options)
            if opts.quirks:
                raise ss.ConfigError(f"unknown quirk {opts.quirks[0]!r}; known: none")
            sink = MainSink(self.modules[rank])
        except ss.StreamsyncError as exc:
            return WorkerResult.failed(exc).to_wire()
        return self.workers[rank].receive(endpoint, opts, sink).to_wire()

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        raw: list[Any] = [None] * len(self.workers)

        async def one(rank: int) -> None:
            wire = rpc(options.to_wire())
            result = await anyio.to_thread.run_sync(
                self._worker_receive, rank, endpoint, wire, abandon_on_cancel=True
            )
            raw[rank] = rpc(result)

        async with anyio.create_task_group() as tg:
            for rank in range(len(self.workers)):
                tg.start_soon(one, rank)
        return [WorkerResult.from_wire(r, rank=rank) for rank, r in enumerate(raw)]

    async def after_sync(self) -> None:
        self.resets += 1

    async def close_receivers(self, endpoint: str) -> int:
        closed = 0
        for worker in self.workers:
            closed += await anyio.to_thread.run_sync(worker.close, endpoint)
        self.closed += closed
        return closed

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


@pytest.fixture
def engine() -> Iterator[ThreadEngine]:
    engine = ThreadEngine([model(1), model(2)])
    yield engine
    engine.shutdown()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


async def test_a_second_engine_is_one_client_plus_one_sink(engine: ThreadEngine) -> None:
    assert isinstance(engine, EngineClient)
    trainer = model(0)
    async with WeightSync(engine, f"shm://engine-{os.getpid()}", timeout=20) as channel:
        for step in range(3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.1 * (step + 1))
            report = await channel.update(ss.named_tensors(trainer))
            assert report.complete and report.receivers == 2
            assert set(report.instances) == {"worker0.main", "worker1.main"}
            assert all(r.missing == () and len(r.loaded) == 4 for r in report.instances.values())
            assert all(same_weights(trainer, m) for m in engine.modules)
            assert engine.resets == step + 1  # after every sync
    assert engine.closed == 2  # leaving the channel closed the workers' receivers too


async def test_a_worker_error_is_raised_under_its_own_name(engine: ThreadEngine) -> None:
    engine.modules[1] = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 9))
    async with WeightSync(engine, f"shm://engine-err-{os.getpid()}", timeout=20) as channel:
        with pytest.raises(ss.ShapeMismatchError, match=r"worker 1 \(pid \d+\)") as info:
            await channel.update(ss.named_tensors(model(0)))
    assert info.value.report is not None and not info.value.report.complete
    assert engine.resets == 0  # a failed sync keeps the engine's caches


async def test_a_worker_that_cannot_start_fails_the_sync_at_once(engine: ThreadEngine) -> None:
    async with WeightSync(
        engine, f"shm://engine-opt-{os.getpid()}", timeout=30, worker_options={"quirks": ["x"]}
    ) as channel:
        start = time.monotonic()
        with pytest.raises(ss.ConfigError, match=r"worker 0 .*unknown quirk 'x'"):
            await channel.update(ss.named_tensors(model(0)))
        assert time.monotonic() - start < 10  # not the send's 30 s timeout
        channel.worker_options = WorkerOptions()
        report = await channel.update(ss.named_tensors(model(0)))  # the channel recovers
        assert report.complete and engine.resets == 1


def test_worker_options_are_typed_and_versioned() -> None:
    opts = WorkerOptions.coerce({"quirks": ["cpu-moe-prepack"], "timeout": 5})
    assert opts == WorkerOptions(quirks=("cpu-moe-prepack",), timeout=5.0)
    assert WorkerOptions.from_wire(rpc(opts.to_wire())) == opts
    assert WorkerOptions.from_wire(None) == WorkerOptions()
    with pytest.raises(ss.ConfigError, match="valid options: timeout, transport, lifecycle"):
        WorkerOptions.coerce({"quirk": []})
    with pytest.raises(ss.ProtocolVersionError, match="version 2"):
        WorkerOptions.from_wire({"version": WORKER_PROTOCOL + 1})
    with pytest.raises(ss.ProtocolVersionError, match="worker 3's result"):
        WorkerResult.from_wire({"version": WORKER_PROTOCOL + 1, "pid": 1}, rank=3)
    with pytest.raises(ss.WireFormatError, match="worker 0's result"):
        WorkerResult.from_wire({"pid": "x"})


def test_worker_result_round_trip_keeps_the_error_and_the_partial_report() -> None:
    partial = ss.SyncReport(
        sync_id=7, side="receive", tensors=1, nbytes=4, buckets=1, seconds=0.1, complete=False
    )
    exc = ss.ChecksumError("tensor 'w' does not match")
    exc.report = partial
    result = WorkerResult.from_wire(rpc(WorkerResult.failed(exc).to_wire()))
    assert not result.ok and result.report == partial
    again = result.exception(rank=2)
    assert type(again) is ss.ChecksumError and again.report == partial
    assert str(again) == f"worker 2 (pid {os.getpid()}): tensor 'w' does not match"
    unknown = msgspec.structs.replace(result, error="NotAStreamsyncError")
    assert type(unknown.exception(0)) is ss.ReceiverFailedError


def test_update_engine_refuses_a_channel_from_another_event_loop(
    engine: ThreadEngine, tmp_path: Path
) -> None:
    class Engine:  # what a user holds (an LLM); the client wraps it
        pass

    handle = Engine()
    endpoint = f"zmq+ipc://{tmp_path}/engine.sock"

    async def step() -> ss.SyncReport:
        return await update_engine(
            handle,
            ss.named_tensors(model(0)),
            client=lambda _: engine,
            endpoint=endpoint,
            timeout=20,
        )

    async def two_steps() -> None:
        assert (await step()).complete
        assert (await step()).complete  # the same channel, reused
        assert engine.closed == 0

    anyio.run(two_steps)
    with pytest.raises(ss.ConfigError, match="opened in another event loop"):
        anyio.run(step)


def test_lifecycles_register_by_name_like_quirks() -> None:
    from streamsync.vllm.lifecycles import LIFECYCLES, choose_lifecycle, register_lifecycle

    @register_lifecycle
    class Recording:
        name = "recording"

        def prepare(self, inst: Any) -> None:
            pass

        def load(self, inst: Any, tensors: Any) -> set[str]:
            return set()

        def finalize(self, inst: Any) -> None:
            pass

    try:
        assert list(LIFECYCLES)[:2] == ["layerwise-reload", "direct-load"]  # preference
        assert isinstance(choose_lifecycle("recording"), Recording)
        with pytest.raises(ss.ConfigError, match="valid: layerwise-reload, direct-load, recording"):
            choose_lifecycle("nope")
    finally:
        del LIFECYCLES["recording"]
