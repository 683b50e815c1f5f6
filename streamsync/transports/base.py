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
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from streamsync._delta import Baseline
from streamsync._replay import BucketPlans
from streamsync.wire.frames import Abort, BucketHeader, Done, End, Failed
from streamsync.wire.pack import Bucket
from streamsync.wire.unpack import Unpacker


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

    def __del__(self) -> None:
        if self._opened and not self._closed:
            warnings.warn(
                f"{type(self).__name__} was not closed; use 'async with' or await aclose()",
                ResourceWarning,
                stacklevel=1,
            )


@dataclass
class SenderState:
    """What :func:`~streamsync.send` keeps on a sender between syncs: the delta baseline and
    the bucket plans of its sources."""

    baseline: Baseline = field(default_factory=Baseline)
    plans: BucketPlans = field(default_factory=BucketPlans)


class Sender(_Resource):
    """Send side of a channel."""

    #: Number of receivers every bucket goes to.
    receivers: int = 1
    #: Largest bucket one slot holds.
    slot_bytes: int
    _state: SenderState | None = None

    @property
    def state(self) -> SenderState:
        """The sync protocol's state on this channel (created on first use)."""
        if self._state is None:
            self._state = SenderState()
        return self._state

    async def wait_ready(self, *, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until every receiver is there to be sent to."""

    def statistics(self) -> SenderStatistics | None:
        """Running totals of where :meth:`send` spends its time, or ``None`` if this
        transport does not count them."""
        return None

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


@dataclass
class ReceiverState:
    """What :func:`~streamsync.receive` keeps on a receiver between syncs: the unpacker (and
    its staging buffer), the last sync applied and the last one that failed here."""

    unpacker: Unpacker = field(default_factory=Unpacker)
    last_sync_id: int | None = None
    failed_sync_id: int | None = None
    #: A ``receive`` is running on this receiver (one sync at a time per channel).
    busy: bool = False
    #: The last ``receive`` was cancelled before its sync's first message: an abort of that
    #: sync (which the sender sends when it gives the sync up before its first bucket) may
    #: still be the next message, and the next ``receive`` skips it.
    abandoned: bool = False
    #: A ``receive`` is waiting for its sync's first message.
    waiting: bool = False
    #: What the last ``Done`` was worked out from, the names its sync carried and the
    #: sink's loaded names, and what it said: ``skipped`` and ``added``.
    carried: tuple[list[str], tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None
    #: The model the last sync here completed into, held weakly, and the version (sync id)
    #: it holds since: a :class:`~streamsync.ModuleSink` made anew for that model each sync
    #: takes deltas on it; another model, or a new receiver, starts at no known version.
    held: tuple[weakref.ref[Any], int] | None = None

    def version_of(self, model: Any) -> int | None:
        """The version ``model`` holds, if the last sync here completed into it."""
        if self.held is None or self.held[0]() is not model:
            return None
        return self.held[1]

    def hold(self, model: Any, version: int | None) -> None:
        """Record that ``model`` holds ``version`` (``None``: no known version)."""
        self.held = None if version is None else (weakref.ref(model), version)


class Receiver(_Resource):
    """Receive side of a channel."""

    _index = 0
    _state: ReceiverState | None = None

    @property
    def index(self) -> int:
        """This receiver's index among the sender's receivers (assigned when it joins)."""
        return self._index

    @property
    def state(self) -> ReceiverState:
        """The sync protocol's state on this channel (created on first use)."""
        if self._state is None:
            self._state = ReceiverState()
        return self._state

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
