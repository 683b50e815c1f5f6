"""A sender and a receiver that wrap a transport's and stamp when each bucket was handed
over, arrived and was released: what the bench's ``transfer`` phase is computed from."""

from __future__ import annotations

import math
import time
from typing import Any

from streamsync.transports.base import Incoming, Receiver, Sender, SenderStatistics
from streamsync.wire.frames import Abort, BucketHeader, Done, End, Failed


class StampedSender(Sender):
    """Passes everything to ``inner`` and notes when each bucket was handed over."""

    def __init__(self, inner: Sender) -> None:
        self.inner = inner
        self.published: list[float] = []

    # Read through to ``inner`` (the transport may learn them only as it opens).
    @property
    def receivers(self) -> int:
        return self.inner.receivers

    @receivers.setter
    def receivers(self, value: int) -> None:
        self.inner.receivers = value

    @property
    def slot_bytes(self) -> int:
        return self.inner.slot_bytes

    @slot_bytes.setter
    def slot_bytes(self, value: int) -> None:
        self.inner.slot_bytes = value

    async def open(self) -> None:
        await self.inner.open()

    async def wait_ready(self, *, timeout: float) -> None:
        await self.inner.wait_ready(timeout=timeout)

    def statistics(self) -> SenderStatistics | None:
        return self.inner.statistics()

    async def send(
        self, sync_id: int, seq: int, bucket: Any, *, timeout: float, checksum: bool = False
    ) -> None:
        await self.inner.send(sync_id, seq, bucket, timeout=timeout, checksum=checksum)
        self.published.append(time.monotonic())

    async def end(self, end: End, *, timeout: float) -> list[Done]:
        return await self.inner.end(end, timeout=timeout)

    async def abort(self, abort: Abort) -> None:
        await self.inner.abort(abort)

    async def aclose(self) -> None:
        await self.inner.aclose()


class StampedReceiver(Receiver):
    """Passes everything to ``inner`` and notes when each bucket arrived and was released;
    any other attribute (a receiver's ``index``, say) is ``inner``'s."""

    def __init__(self, inner: Receiver) -> None:
        self.inner = inner
        self.arrived: list[float] = []
        self.released: list[float] = []

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet: in __init__ or while unpickling
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def open(self) -> None:
        await self.inner.open()

    async def receive(self, *, timeout: float) -> Incoming:
        incoming = await self.inner.receive(timeout=timeout)
        if isinstance(incoming.message, BucketHeader):
            self.arrived.append(time.monotonic())
        return incoming

    async def release(self, header: BucketHeader) -> None:
        await self.inner.release(header)
        self.released.append(time.monotonic())

    async def reply(self, report: Done | Failed) -> None:
        await self.inner.reply(report)

    async def aclose(self) -> None:
        await self.inner.aclose()


def transfer_seconds(published: list[float], arrived: list[float], released: list[float]) -> float:
    """Seconds the receiver sat idle waiting for buckets the sender had already handed to
    the transport: per bucket, from when it was handed over or the receiver was done with
    the previous one (whichever is later) to when it arrived."""
    total = 0.0
    free = -math.inf
    for k, (sent, got) in enumerate(zip(published, arrived, strict=False)):
        total += max(0.0, got - max(sent, free))
        if k < len(released):
            free = released[k]
    return total
