"""Staged syncs into real CPU vLLM engines: the version lands on every worker while the
engine serves the old one (its outputs bit-identical until the commit), and the commit
brings the engine to exactly what a plain full sync of the same weights serves. Dense,
tied, MoE through the expander and a drafter on TP=2 engines (each worker stages its own
slices); failures while staging that leave the engine untouched; and an ``AsyncLLM`` whose
requests keep producing tokens while a version is staged, with ``weight_versions`` spans
that name the sync."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from test_vllm_sharded import nudge, start, stream
from vllm_harness import (
    TRAINER,
    assert_matches,
    async_engine_args,
    async_outputs,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
)

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


class Progress:
    """How many tokens a request has produced, and a wait for more."""

    def __init__(self) -> None:
        self.tokens = 0
        self._target = 0
        self._reached = anyio.Event()

    def update(self, tokens: int) -> None:
        self.tokens = tokens
        if tokens >= self._target:
            self._reached.set()

    async def more(self, count: int) -> tuple[int, int]:
        """Wait (at most 120 s) until ``count`` more tokens came; (tokens then, now)."""
        start, self._target, self._reached = self.tokens, self.tokens + count, anyio.Event()
        with anyio.fail_after(120):
            await self._reached.wait()
        return start, self.tokens


def same(got: Any, want: Any) -> bool:
    return bool(got.tokens == want.tokens and got.max_logprob_diff(want) == 0)


@pytest.mark.parametrize("kind", ["dense", "tied", "moe", "drafter"])
def test_a_staged_version_is_served_only_after_its_commit(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    llm, trainer, pipeline = start(kind, tmp_path)
    try:
        sent, seen = [], []
        with WeightSync(llm, "zmq+tcp://127.0.0.1:0", delta=True, pipeline=pipeline) as sync:
            assert sync.channel.sharded  # TP=2: each worker stages only its slices
            for step in range(3):
                before = engine_outputs(llm)
                nudge(trainer, seed=step)
                staged = sync.stage(ss.named_tensors(trainer))
                assert same(engine_outputs(llm), before)  # staged, not served
                assert sync.staged_version == staged.sync_id
                report = sync.commit()
                assert report.sync_id == staged.sync_id and sync.versions == {0: staged.sync_id}
                assert llm.llm_engine.get_weight_version() == str(staged.sync_id)
                assert (staged.delta is not None and staged.delta.base is not None) == (step > 0)
                sent.append(stream(trainer, pipeline))
                seen.append(engine_outputs(llm))
        assert_matches(seen[-1], reference_outputs(trainer))
        # The same weights through a plain full sync: exactly the same outputs.
        with WeightSync(llm, f"shm://staged-plain-{os.getpid()}") as plain:
            for tensors, got in zip(sent, seen, strict=True):
                plain.update(tensors)
                assert same(got, engine_outputs(llm))
    finally:
        shutdown(llm)


def test_a_failed_staging_leaves_the_engine_serving_bit_identical(tmp_path: Path) -> None:
    from streamsync.vllm import WeightSync

    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0)
    llm = make_llm(str(tmp_path / "model"))
    try:
        with WeightSync(llm, f"shm://staged-fail-{os.getpid()}", delta=True) as sync:
            perturb(trainer, seed=1)
            sync.update(ss.named_tensors(trainer))
            before = engine_outputs(llm)
            version = llm.llm_engine.get_weight_version()
            perturb(trainer, seed=2)

            bad = dict(trainer.state_dict())
            bad["model.layers.0.mlp.no_such.weight"] = torch.zeros(4, 4)
            with pytest.raises(ss.UnknownTensorError, match=r"'model\.layers\.0\.mlp\.no_such"):
                sync.stage(bad)
            assert same(engine_outputs(llm), before) and sync.staged_version is None

            async def dies() -> AsyncIterator[tuple[str, torch.Tensor]]:
                for i, item in enumerate(trainer.state_dict().items()):
                    if i == 5:
                        raise RuntimeError("the trainer died mid-stream")
                    yield item

            with pytest.raises(RuntimeError, match="the trainer died mid-stream"):
                sync.stage(dies())
            assert same(engine_outputs(llm), before)
            assert llm.llm_engine.get_weight_version() == version

            report = sync.update(ss.named_tensors(trainer))  # then a sync goes through
            assert report.delta is not None and report.delta.base is None  # full
            staged = sync.stage(ss.named_tensors(trainer))
            sync.commit()
            assert llm.llm_engine.get_weight_version() == str(staged.sync_id)
        assert_matches(engine_outputs(llm), reference_outputs(trainer))
    finally:
        shutdown(llm)


@pytest.mark.slow
def test_async_llm_generates_while_a_version_is_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0)
    args = async_engine_args(tmp_path / "model", max_model_len=512)

    async def begin() -> Any:
        return AsyncLLM.from_engine_args(args)

    llm = TRAINER.run(begin, timeout=300)
    # Long enough to outlast the staging and the commit many times over (seconds of decode
    # against the tiny model's tens of milliseconds of sync); checked below.
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        progress = Progress()
        final: list[Any] = []

        async def generate() -> None:
            prompt = {"prompt_token_ids": [1, 2, 3, 4]}
            async for part in llm.generate(prompt, long, str(uuid.uuid4())):
                progress.update(len(part.outputs[0].token_ids))
                final[:] = [part]

        async with WeightSync(llm, f"shm://staged-async-{os.getpid()}") as sync:
            await sync.update(ss.named_tensors(trainer))
            old = str(sync.versions[0])
            perturb(trainer, seed=3)

            async def weights() -> AsyncIterator[tuple[str, torch.Tensor]]:
                # Half-way through the stream, with half of the version on the worker, the
                # request must produce more tokens: were the engine paused for the sync,
                # this would wait out its limit and fail.
                items = list(trainer.state_dict().items())
                for i, item in enumerate(items):
                    if i == len(items) // 2:
                        out["during"] = await progress.more(3)
                    yield item

            async with anyio.create_task_group() as tg:
                tg.start_soon(generate)
                await progress.more(1)
                staged = await sync.stage(weights())
                out["at_commit"] = progress.tokens
                await sync.commit(mode="keep")
            out["spans"] = final[0].outputs[0].weight_versions
            out["old"], out["new"] = old, str(staged.sync_id)
            out["after"] = await async_outputs(llm)
        return out

    try:
        out = TRAINER.run(run, timeout=600)
    finally:
        llm.shutdown()
        llm = None
        gc.collect()
    before, during = out["during"]
    assert during >= before + 3  # tokens came while the version was half staged
    spans = [(s.version, s.start, s.end) for s in out["spans"]]
    assert spans[0][0] == out["old"] and spans[-1][0] == out["new"], spans
    assert out["at_commit"] < 500  # committed while the request was still generating
    assert spans[-1][1] >= out["at_commit"] >= during  # the new version only after commit
    assert_matches(out["after"], reference_outputs(trainer))


@pytest.mark.slow
def test_an_engine_killed_while_staging_fails_it_and_no_engine_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``AsyncLLM`` engines, each in processes of its own; engine 1's core (its worker
    with it) is SIGKILLed half-way through a staged sync. The sync fails naming engine 1,
    engine 0 serves bit-identical outputs, and after a restart of engine 1 the next staged
    sync brings both to one version."""
    import signal

    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0)
    args = async_engine_args(tmp_path / "model")
    engines: list[Any] = []

    async def begin() -> None:
        engines.append(AsyncLLM.from_engine_args(args))

    async def first(endpoint: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with WeightSync(engines, endpoint, timeout=20) as sync:
            await sync.update(ss.named_tensors(trainer))
            out["before"] = await async_outputs(engines[0])
            perturb(trainer, seed=4)
            core = engines[1].engine_core.resources.engine_manager.processes[0]

            async def weights() -> AsyncIterator[tuple[str, torch.Tensor]]:
                items = list(trainer.state_dict().items())
                for i, item in enumerate(items):
                    if i == len(items) // 2:
                        os.kill(core.pid, signal.SIGKILL)
                    yield item

            try:
                await sync.stage(weights())
            except ss.StreamsyncError as exc:
                out["error"] = (type(exc).__name__, str(exc), exc.engine)
            out["staged"] = sync.staged_version
            out["after"] = await async_outputs(engines[0])
        return out

    async def second(endpoint: str) -> dict[str, Any]:
        async with WeightSync(engines, endpoint, timeout=30) as sync:
            staged = await sync.stage(ss.named_tensors(trainer))
            await sync.commit()
            return {
                "versions": sync.versions,
                "sync_id": staged.sync_id,
                "outputs": [await async_outputs(llm) for llm in engines],
            }

    try:
        for _ in range(2):
            TRAINER.run(begin, timeout=300)
        out = TRAINER.run(lambda: first(f"shm://staged-kill-{os.getpid()}"), timeout=300)
        engines.pop().shutdown()  # the dead one
        TRAINER.run(begin, timeout=300)  # engine 1 again, on its old weights
        again = TRAINER.run(lambda: second(f"shm://staged-kill2-{os.getpid()}"), timeout=300)
    finally:
        for llm in engines:
            llm.shutdown()
        engines.clear()
        gc.collect()
    assert "error" in out and out["error"][2] == 1, out.get("error")  # named: engine 1
    assert out["staged"] is None
    assert same(out["after"], out["before"])  # engine 0: untouched, serving
    assert again["versions"] == {0: again["sync_id"], 1: again["sync_id"]}
    want = reference_outputs(trainer)
    for got in again["outputs"]:
        assert_matches(got, want)
