"""Streaming holds: the pipeline never keeps more than a bucket's worth of tensors plus one."""

from __future__ import annotations

import gc
import weakref

import anyio
import torch

import streamsync as ss
from streamsync.adapters import cast, rename, select


class AliveCounter:
    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(t, self._dead)
        return t

    def _dead(self) -> None:
        self.alive -= 1


class Discard:
    """A sink that checks each tensor's value and keeps nothing."""

    def __init__(self) -> None:
        self.seen = 0

    def prepare(self) -> None: ...

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            assert t.dtype == torch.bfloat16
            assert float(t[0]) == float(int(name.split(".")[1]) % 256)
            self.seen += 1

    def finalize(self) -> None: ...


async def test_pipeline_holds_at_most_a_bucket_plus_one() -> None:
    counter = AliveCounter()
    n, elems = 1000, 512  # fp32: 2 KiB each, sent as bf16: 1 KiB each
    bucket_bytes = 8 * 1024
    per_bucket = bucket_bytes // (elems * 2)

    async def source():  # type: ignore[no-untyped-def]
        for i in range(n):
            yield f"layer.{i}.weight", counter.track(torch.full((elems,), float(i % 256)))

    gc.disable()  # count by reference, not by whenever the collector runs
    try:
        sink = Discard()
        pipeline = select(lambda name: True) | rename(lambda name: name) | cast(torch.bfloat16)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: ss.receive("memory://stream", sink, timeout=10))
            tg.start_soon(
                lambda: ss.send(
                    source(),
                    "memory://stream",
                    pipeline=pipeline,
                    bucket_bytes=bucket_bytes,
                    timeout=10,
                )
            )
    finally:
        gc.enable()
    assert sink.seen == n
    assert counter.alive == 0
    assert counter.peak <= per_bucket + 1, counter.peak
    assert counter.peak >= per_bucket  # the counter does see a full bucket
