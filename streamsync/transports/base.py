"""The transport ABC pair: :class:`Sender` and :class:`Receiver`.

The sender packs a bucket into a free slot of a ring and announces it; each receiver hands
it to its sink and acks the slot, reusable once every receiver acked it. After the last
bucket the sender announces the end and waits for every receiver's report. Every wait takes
a timeout. A side used after this process closed it raises :class:`~streamsync.ClosedError`;
the peer going away raises :class:`~streamsync.PeerBrokenError`; the peer closing cleanly
between syncs ends the receiver's iteration (:class:`~streamsync.EndOfStream`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self, TypeVar

import torch

from streamsync.wire.frames import Abort, BucketHeader, Done, End, Failed

if TYPE_CHECKING:
    from streamsync.wire.pack import Bucket

_State = TypeVar("_State")


@dataclass(frozen=True, slots=True)
class Incoming:
    """What a receiver got: a bucket header with its bytes (a uint8 view of the slot, valid
    until :meth:`Receiver.release`), the end of a sync, or the sender's abort."""

    message: BucketHeader | End | Abort
    data: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class SenderStatistics:
    """A sender's running totals across every sync on its channel (subtract two snapshots
    for one sync): seconds waiting for free slots, packing, handing over."""

    buckets: int = 0
    wait_seconds: float = 0.0
    pack_seconds: float = 0.0
    publish_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Attendance:
    """Who a finished sync did not reach: ``absent``, receivers the channel expects that took
    no part (gone, or not back yet; only with ``require_all=False``), and ``refused``, peers
    turned away since the sync before (a wrong secret, another protocol version)."""

    absent: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()


class _Resource(ABC):
    _closed = False
    _opened = False
    # Owned by the sync layer; opaque here (see ``sync_state``).
    _sync_state: object | None = None

    async def __aenter__(self) -> Self:
        await self.open()
        self._opened = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Acquire resources and meet the peer (called by ``async with``)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release every resource this side holds; idempotent."""

    def sync_state(self, kind: type[_State]) -> _State:
        """The sync layer's state on this channel: a ``kind()`` made on first use, then the
        same object for as long as this side lives. The sync layer owns it (what
        :func:`~streamsync.send` and :func:`~streamsync.receive` keep between syncs); the
        transport only holds it. A wrapper of a side hands this call to the side it
        wraps, so the state stays with the channel."""
        state = self._sync_state
        if state is None:
            made = kind()
            self._sync_state = made
            return made
        if not isinstance(state, kind):
            raise TypeError(
                f"{type(self).__name__} holds sync state of type {type(state).__name__}, "
                f"not {kind.__name__}"
            )
        return state

    def __del__(self) -> None:
        if self._opened and not self._closed:
            warnings.warn(
                f"{type(self).__name__} was not closed; use 'async with' or await aclose()",
                ResourceWarning,
                stacklevel=1,
            )


class Sender(_Resource):
    """Send side of a channel."""

    #: Number of receivers every bucket goes to.
    receivers: int = 1
    #: Largest bucket one slot holds.
    slot_bytes: int

    async def wait_ready(self, *, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until every receiver is there to be sent to."""

    def statistics(self) -> SenderStatistics | None:
        """Running totals of where :meth:`send` spends its time, or ``None`` if this
        transport does not count them."""
        return None

    def introductions(self) -> dict[int, bytes]:
        """What each receiver present said of itself as it joined (its ``facts``; empty
        bytes where it said nothing), by index."""
        return {}

    def attendance(self) -> Attendance:
        """Who the last finished sync did not reach (see :class:`Attendance`)."""
        return Attendance()

    @property
    def present(self) -> int:
        """Receivers counted in now: the next sync goes to them."""
        return self.receivers

    def seal(self) -> None:
        """Admit no further receivers (a one-shot sender, once its receivers are there):
        later arrivals are told it is closing, and try again for the next sender."""

    async def begin(self, sync_id: int, *, timeout: float) -> dict[int, int | None]:
        """Start sync ``sync_id`` before its first bucket (counting its members in now) and
        return the version each member's sink holds (``None``: none a delta can patch).
        A transport that does not track versions returns ``{}``: every sync is then full."""
        return {}

    async def forget(self, sync_id: int) -> None:
        """Drop sync ``sync_id``, begun with :meth:`begin` but never sent."""

    @abstractmethod
    async def send(
        self, sync_id: int, seq: int, bucket: Bucket, *, timeout: float, checksum: bool = False
    ) -> None:
        """Wait (up to ``timeout`` seconds) for a free slot, pack ``bucket`` into it and
        announce it to every receiver."""

    @abstractmethod
    async def end(self, end: End, *, timeout: float) -> list[Done]:
        """Announce the end of a sync and wait for every receiver's report (raises
        :class:`~streamsync.ReceiverFailedError` if any receiver failed)."""

    @abstractmethod
    async def abort(self, abort: Abort) -> None:
        """Tell every receiver the sync is abandoned (best effort, never blocks long)."""


class Receiver(_Resource):
    """Receive side of a channel."""

    _index = 0

    @property
    def index(self) -> int:
        """This receiver's index among the sender's receivers (assigned when it joins)."""
        return self._index

    @abstractmethod
    async def receive(self, *, timeout: float) -> Incoming:
        """The next bucket, end or abort (:class:`~streamsync.EndOfStream`: the sender
        closed the channel between syncs)."""

    @abstractmethod
    async def release(self, header: BucketHeader) -> None:
        """Give the bucket's slot back to the sender (its views become invalid)."""

    @abstractmethod
    async def reply(self, report: Done | Failed) -> None:
        """Send this receiver's report of a sync back to the sender."""
