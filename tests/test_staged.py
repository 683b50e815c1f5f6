"""Staged syncs without vLLM: thread workers stage a version while their models stay on the
old one, then every engine commits it, or none does. On real vLLM engines (LLM, AsyncLLM,
TP=2): ``test_vllm_staged.py``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
import torch
from test_engine import MainSink, ThreadEngine, model, rpc, same_weights

import streamsync as ss
from streamsync.engine.channel import EngineChannel
from streamsync.engine.clients import StagingClient
from streamsync.engine.messages import WorkerOptions, WorkerResult


class LoadFails(MainSink):
    """A sink whose load fails (as an engine's loader may at commit)."""

    def load(self, tensors: Any) -> None:
        raise ss.ReceiverFailedError("this worker's loader broke")


class StagingEngine(ThreadEngine):
    """Thread workers that stage (``WorkerReceivers.stage``) and commit on request; the
    commit records the pause mode, sets the engine's weight version and drops its caches."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        super().__init__(modules)
        self.pauses: list[str] = []
        self.paused = False
        self.weight_version = "default"
        self.fail_load: set[int] = set()  # ranks whose loader fails (at commit)

    def _sink(self, rank: int) -> ss.Sink:
        return (LoadFails if rank in self.fail_load else MainSink)(self.modules[rank])

    async def _each(self, call: Any, *args: Any) -> list[WorkerResult]:
        raw: list[Any] = [None] * len(self.workers)

        async def one(rank: int) -> None:
            result = await anyio.to_thread.run_sync(call, rank, *args, abandon_on_cancel=True)
            raw[rank] = rpc(result.to_wire())

        async with anyio.create_task_group() as tg:
            for rank in range(len(self.workers)):
                tg.start_soon(one, rank)
        return [WorkerResult.from_wire(r, rank=rank) for rank, r in enumerate(raw)]

    async def start_stage(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        def stage(rank: int, wire: Any) -> WorkerResult:
            return self.workers[rank].stage(endpoint, wire, lambda o, r: self._sink(rank))

        return await self._each(stage, rpc(options.to_wire()))

    async def staged(self, sync_id: int, *, wait: bool = True) -> list[WorkerResult]:
        return await self._each(lambda rank: self.workers[rank].staged(sync_id, wait=wait))

    async def pause(self, mode: Any) -> None:
        self.pauses.append(mode)
        self.paused = True

    async def apply_staged(self, sync_id: int, *, version: str) -> list[WorkerResult]:
        return await self._each(lambda rank: self.workers[rank].commit(sync_id))

    async def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    async def reset_prefix_cache(self) -> None:
        assert self.paused  # the commit drops the caches inside its pause
        self.resets += 1

    async def resume(self) -> None:
        self.paused = False

    async def drop(self) -> None:
        for worker in self.workers:
            await anyio.to_thread.run_sync(worker.drop)


@pytest.fixture
def engines() -> Iterator[list[StagingEngine]]:
    made = [StagingEngine([model(1), model(2)]), StagingEngine([model(3), model(4)])]
    yield made
    for engine in made:
        engine.shutdown()


def snapshot(engines: list[StagingEngine]) -> list[list[dict[str, torch.Tensor]]]:
    return [[{k: v.clone() for k, v in m.state_dict().items()} for m in e.modules] for e in engines]


def unchanged(engines: list[StagingEngine], before: list[list[dict[str, torch.Tensor]]]) -> bool:
    return all(
        torch.equal(v, b[k])
        for e, kept in zip(engines, before, strict=True)
        for m, b in zip(e.modules, kept, strict=True)
        for k, v in m.state_dict().items()
    )


def trained(step: int) -> torch.nn.Module:
    trainer = model(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01 * (step + 1))
    return trainer


def endpoint() -> str:
    return f"shm://staged-{os.getpid()}-{os.urandom(3).hex()}"


async def test_a_staged_version_reaches_no_model_until_every_engine_commits_it(
    engines: list[StagingEngine],
) -> None:
    assert all(isinstance(e, StagingClient) for e in engines)
    async with EngineChannel(engines, endpoint(), timeout=20) as channel:
        for step in range(2):
            before = snapshot(engines)
            trainer = trained(step)
            staged = await channel.stage(ss.named_tensors(trainer))
            assert unchanged(engines, before)  # staged: every model still on the old one
            assert channel.staged_version == staged.sync_id
            assert all(e.resets == step for e in engines)
            report = await channel.commit(mode="wait")
            assert report.complete and report.sync_id == staged.sync_id
            assert report.phases["apply"] > 0  # the slowest worker's copy into its models
            assert "apply" not in staged.phases
            assert set(report.instances) == {
                f"engine{e}.worker{w}.main" for e in range(2) for w in range(2)
            }
            assert all(same_weights(trainer, m) for e in engines for m in e.modules)
            assert channel.versions == {0: staged.sync_id, 1: staged.sync_id}
            assert channel.staged_version is None
            assert all(e.weight_version == str(staged.sync_id) for e in engines)
            assert all(e.pauses[-1] == "wait" and e.resets == step + 1 for e in engines)


async def test_a_failure_while_staging_leaves_every_engine_as_it_was(
    engines: list[StagingEngine],
) -> None:
    # Engine 1's worker 1 serves a model of another shape: it refuses the version when
    # staging ends, and no engine may commit.
    engines[1].modules[1] = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 9))
    before = snapshot(engines)
    async with EngineChannel(engines, endpoint(), timeout=20) as channel:
        with pytest.raises(ss.ShapeMismatchError, match=r"engine 1 worker 1 .*'1\.weight'"):
            await channel.stage(ss.named_tensors(trained(1)))
        assert unchanged(engines, before) and channel.staged_version is None
        assert all(w._staging is None for e in engines for w in e.workers)  # dropped
        assert all(e.pauses == [] and e.resets == 0 for e in engines)  # none paused
        with pytest.raises(ss.ConfigError, match="nothing is staged"):
            await channel.commit()
        engines[1].modules[1] = model(4)
        await channel.stage(ss.named_tensors(trained(2)))
        await channel.commit()
        assert all(same_weights(trained(2), m) for e in engines for m in e.modules)


async def test_a_bad_name_or_a_sender_that_fails_mid_stream_stages_nothing(
    engines: list[StagingEngine],
) -> None:
    before = snapshot(engines)
    async with EngineChannel(engines, endpoint(), timeout=20) as channel:
        extra = dict(trained(1).state_dict())
        extra["2.weight"] = torch.zeros(8, 8)
        with pytest.raises(ss.UnknownTensorError, match=r"'2\.weight' is not a parameter"):
            await channel.stage(extra)
        assert unchanged(engines, before)

        async def dies() -> AsyncIterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(trained(1).state_dict().items()):
                if i == 2:
                    raise RuntimeError("the trainer died mid-stream")
                yield item

        with pytest.raises(Exception, match="the trainer died mid-stream"):
            await channel.stage(dies())
        assert unchanged(engines, before) and channel.staged_version is None
        assert all(w._staging is None for e in engines for w in e.workers)


async def test_a_commit_that_fails_on_one_engine_is_named_and_the_next_sync_is_full(
    engines: list[StagingEngine],
) -> None:
    async with EngineChannel(engines, endpoint(), timeout=20, delta=True) as channel:
        first = await channel.update(ss.named_tensors(trained(0)))
        engines[1].fail_load = {0}
        staged = await channel.stage(ss.named_tensors(trained(1)))
        assert staged.delta is not None and staged.delta.base == first.sync_id
        with pytest.raises(ss.PartialCommitError, match=r"committed on engines \[0\]") as info:
            await channel.commit()
        assert info.value.versions == {0: staged.sync_id, 1: None} == channel.versions
        assert "this worker's loader broke" in str(info.value)
        assert all(same_weights(trained(1), m) for m in engines[0].modules)
        engines[1].fail_load = set()
        report = await channel.update(ss.named_tensors(trained(2)))
        assert report.delta is not None and report.delta.base is None  # full everywhere
        assert all(same_weights(trained(2), m) for e in engines for m in e.modules)
        assert channel.versions == {0: report.sync_id, 1: report.sync_id}


async def test_staged_delta_syncs_commit_bit_exact(engines: list[StagingEngine]) -> None:
    async with EngineChannel(engines, endpoint(), timeout=20, delta=True, staged=True) as sync:
        for step in range(3):
            before = snapshot(engines)
            staged = await sync.stage(ss.named_tensors(trained(step)))
            assert unchanged(engines, before)
            assert (staged.delta is not None and staged.delta.base is not None) == (step > 0)
            await sync.commit(mode="keep")
            assert all(same_weights(trained(step), m) for e in engines for m in e.modules)
        report = await sync.update(ss.named_tensors(trained(3)))  # staged=True: both at once
        assert report.complete and all(e.pauses[-1] == "keep" for e in engines)
        assert all(same_weights(trained(3), m) for e in engines for m in e.modules)


async def test_one_version_is_staged_at_a_time_and_a_dropped_one_is_never_served(
    engines: list[StagingEngine],
) -> None:
    before = snapshot(engines)
    async with EngineChannel(engines, endpoint(), timeout=20, delta=True) as channel:
        await channel.stage(ss.named_tensors(trained(0)))
        with pytest.raises(ss.ConfigError, match="is staged already"):
            await channel.stage(ss.named_tensors(trained(1)))
        with pytest.raises(ss.ConfigError, match=r"commit\(mode='later'\)"):
            await channel.commit(mode="later")  # type: ignore[arg-type]
        await channel.drop()
        assert unchanged(engines, before) and channel.staged_version is None
        assert all(w._staging is None for e in engines for w in e.workers)
        report = await channel.update(ss.named_tensors(trained(1)))
        assert report.delta is not None and report.delta.base is None  # not on the dropped


def test_a_channel_refuses_staging_into_an_engine_that_cannot() -> None:
    plain = ThreadEngine([model(1)])
    try:
        with pytest.raises(ss.ConfigError, match="ThreadEngine cannot stage"):
            EngineChannel(plain, endpoint(), staged=True)
    finally:
        plain.shutdown()
