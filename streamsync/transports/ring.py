"""The slot-ring protocol every transport shares: slot accounting with per-receiver acks,
receivers' reports, failure propagation.

A transport implements :meth:`RingSender._publish` and feeds what receivers send back into
``on_reply``, a receiver that leaves into ``on_left``, a channel that cannot go on into
``on_broken``; :class:`RingReceiver` needs ``_next`` and ``_post``.

A sync's *members* are the receivers present when it begins (``_admit``): only they get
its messages and owe acks; one that joins meanwhile takes part from the next sync. A member
that goes away fails the sync with a named error (``require_all=True``) or is reported
absent while the others complete it; either way the channel serves on, and a replacement
is admitted at the next sync.
"""

from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio
import torch

from streamsync._log import log
from streamsync.errors import (
    CONSEQUENCES,
    ClosedError,
    ConfigError,
    EndOfStream,
    PeerBrokenError,
    ReceiverFailedError,
    StreamsyncError,
    SyncInProgressError,
    SyncTimeoutError,
    WireFormatError,
)
from streamsync.report import LoadResult, SyncReport
from streamsync.transports.base import (
    Attendance,
    Incoming,
    Receiver,
    Sender,
    SenderStatistics,
)
from streamsync.transports.handshake import resolve_secret
from streamsync.transports.link import LAST_WORD_S
from streamsync.transports.slots import SlotStore
from streamsync.wire.frames import Abort, Ack, BucketHeader, Bye, Done, End, Failed, Message
from streamsync.wire.pack import Bucket

_LAST_LOOK_S = 0.05


class _Signal:
    """A level-triggered wake-up for waiters that re-check a condition."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait_until(self, ready: Callable[[], bool], *, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        last_look = False
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if last_look:
                    raise SyncTimeoutError(f"timed out after {timeout:g} s waiting for {what}")
                # One short look past the deadline: a process that was stopped or starved
                # may hold answers its readers have not delivered yet (a receiver's
                # failure), and they, not the timeout, say what went wrong.
                last_look = True
                remaining = _LAST_LOOK_S
                deadline = time.monotonic() + remaining
            if self._event is None:
                self._event = anyio.Event()
            with anyio.move_on_after(remaining):
                await self._event.wait()


class SlotRing:
    """Which slots are free: a slot is free again when every receiver acknowledged it."""

    def __init__(self, slots: int, receivers: int) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}; a ring needs at least 1 slot")
        self.slots = slots
        self.receivers = receivers
        self._owed: list[set[int]] = [set() for _ in range(slots)]
        self._owner: list[tuple[int, int] | None] = [None] * slots
        self._cursor = 0

    def take(self, sync_id: int, seq: int, owed: Iterable[int] | None = None) -> int | None:
        """A free slot, now owed an ack by each of ``owed`` (default: every receiver), or
        ``None``."""
        for step in range(self.slots):
            slot = (self._cursor + step) % self.slots
            if not self._owed[slot]:
                self._owed[slot] = set(range(self.receivers) if owed is None else owed)
                self._owner[slot] = (sync_id, seq)
                self._cursor = (slot + 1) % self.slots
                return slot
        return None

    def ack(self, ack: Ack) -> None:
        """Record a receiver's ack; an ack for a slot that holds another bucket is an error."""
        if not 0 <= ack.slot < self.slots:
            raise WireFormatError(f"receiver {ack.receiver} acked slot {ack.slot} of {self.slots}")
        if self._owner[ack.slot] != (ack.sync_id, ack.seq):
            raise WireFormatError(
                f"receiver {ack.receiver} acked bucket {ack.seq} of sync {ack.sync_id} in slot "
                f"{ack.slot}, which holds {self._owner[ack.slot]}"
            )
        self._owed[ack.slot].discard(ack.receiver)

    def forget(self, receiver: int) -> None:
        """Receiver ``receiver`` left: it owes no acks any more."""
        for owed in self._owed:
            owed.discard(receiver)


@dataclass
class RunningSync:
    """One sync on a sender, from its begin to its end: who takes part and what they said
    (made when the sync begins, dropped when it ends: nothing of it outlives it)."""

    sync_id: int
    #: Bounds each wait of this sync, a transport's own (a broadcast) included.
    timeout: float = 60.0
    #: The receivers taking part: those present when it began.
    members: set[int] = field(default_factory=set)
    #: Each member's report.
    reports: dict[int, Done | Failed] = field(default_factory=dict)
    #: The first member's failure.
    failed: Failed | None = None
    #: A member went away during it (``require_all``): it fails.
    lost: StreamsyncError | None = None
    #: Members that took no part (``require_all=False``), each with why.
    absent: list[str] = field(default_factory=list)


class RingSender(Sender):
    """Sender half of the ring protocol over ``store``; transports provide the messaging."""

    def __init__(
        self,
        url: str,
        store: SlotStore,
        *,
        receivers: int = 1,
        require_all: bool = True,
        connect_timeout: float = 60.0,
        secret: bytes | str | None = None,
    ) -> None:
        self.url = url
        self.receivers = receivers
        self.require_all = require_all
        self.connect_timeout = connect_timeout
        self._secret = resolve_secret(secret)
        self.store = store
        self.slot_bytes = store.slot_bytes
        self.ring = SlotRing(store.slots, receivers)
        self._signal = _Signal()
        self._broken: StreamsyncError | None = None
        #: The running sync (``None`` between syncs).
        self._sync: RunningSync | None = None
        self._attendance = Attendance()
        #: Per receiver, the version its sink holds (from its last ``Done``): what a delta
        #: sync may be based on. Forgotten when it fails, leaves or misses a sync's end.
        self._held: dict[int, int | None] = {}
        self._quorum_met = False
        self._stats = SenderStatistics()
        #: Opened with ``receivers=0``: per team, how many join and who said so first.
        self._learning = receivers == 0
        self._teams: dict[str, tuple[int, str]] = {}
        #: Per receiver present, what it said of itself as it joined (its ``facts``).
        self._facts: dict[int, bytes] = {}

    # -- transport hooks ---------------------------------------------------------------
    def slot(self, index: int) -> torch.Tensor:
        """The writable uint8 buffer of slot ``index``."""
        return self.store.slot(index)

    @property
    def _members(self) -> set[int]:
        """The receivers taking part in the running sync: whom ``_publish`` sends to."""
        return set() if self._sync is None else self._sync.members

    @abstractmethod
    async def _publish(
        self, msg: BucketHeader | End | Abort | Bye, payload: torch.Tensor | None
    ) -> None:
        """Deliver ``msg`` (and a bucket's packed bytes) to every receiver."""

    async def wait_ready(self, *, timeout: float) -> None:
        """Wait, within ``timeout`` and ``connect_timeout``, until enough receivers are
        there for a sync to begin (:meth:`_enough`)."""
        self._check()
        limit = min(timeout, self.connect_timeout)

        def ready() -> bool:
            self._check()
            return self._enough(len(self._admit()))

        try:
            await self._signal.wait_until(ready, timeout=limit, what="receivers")
        except SyncTimeoutError:
            expected = self.receivers or "the (not yet said) count of"
            raise SyncTimeoutError(
                f"{self.url}: {len(self._admit())} of {expected} receivers joined "
                f"within {limit:g} s{self._whereabouts()}"
            ) from None

    def count(self, who: str, group: int, team: str = "") -> StreamsyncError | None:
        """A receiver (``who``) joins saying ``group`` receivers of ``team`` join with it;
        the error to refuse it with, if any. A sender opened with ``receivers=0`` waits for
        the sum of what the first of each team says (every receiver says it before it is
        welcomed, so once each one that will join was welcomed the count is whole); one
        that says another count than its team's first is refused by name."""
        if not self._learning:
            return None
        if group < 1:
            return ConfigError(
                f"{self.url} was opened with receivers=0 (as many as the receivers say), "
                f"but {who} did not say how many join with it; open the sender with "
                "receivers=N, or the receivers with group=N"
            )
        known = self._teams.get(team)
        if known is None:
            self._teams[team] = (group, who)
            self.receivers = self.ring.receivers = sum(n for n, _ in self._teams.values())
            log("channel.counted", url=self.url, receivers=self.receivers, team=team, by=who)
        elif known[0] != group:
            return ConfigError(
                f"{self.url}: {who} says {group} receivers join with it, but {known[1]} "
                f"said {known[0]}"
            )
        return None

    def introductions(self) -> dict[int, bytes]:
        return {i: self._facts.get(i, b"") for i in sorted(self._admit())}

    def _whereabouts(self) -> str:
        """What a timeout waiting for receivers adds: who left, who was refused."""
        return ""

    async def _hear(self, heard: Callable[[], bool]) -> None:
        """Give the readers a moment (:data:`LAST_WORD_S`) until ``heard()``: what a
        receiver said before it went (its failure, its goodbye) may still be unread, and
        it, not what this side saw, is the reason to raise."""
        with contextlib.suppress(SyncTimeoutError):
            await self._signal.wait_until(heard, timeout=LAST_WORD_S, what="")

    def _admit(self) -> set[int]:
        """The receivers present now, who become the members of the sync that begins."""
        return set(range(self.receivers))

    @property
    def present(self) -> int:
        return len(self._admit())

    def _enough(self, present: int) -> bool:
        """A sync may begin with ``present`` receivers: all of them, or, once the channel
        was whole, any with ``require_all=False`` (the others are reported absent)."""
        if present >= self.receivers > 0:
            self._quorum_met = True
            return True
        return not self.require_all and self._quorum_met and present > 0

    def _describe(self, index: int) -> str:
        """How messages name receiver ``index``."""
        return f"receiver {index}"

    def _refusals(self) -> tuple[str, ...]:
        """Peers turned away since the last call (wrong secret, other protocol version)."""
        return ()

    def attendance(self) -> Attendance:
        return self._attendance

    def statistics(self) -> SenderStatistics:
        return self._stats

    def on_reply(self, msg: Message) -> None:
        """Feed a message a receiver sent back (transports call this)."""
        if isinstance(msg, Ack):
            try:
                self.ring.ack(msg)
            except WireFormatError as exc:
                self.on_broken(exc)
        elif isinstance(msg, Done | Failed):
            sync = self._sync
            if sync is not None and msg.sync_id == sync.sync_id:
                sync.reports[msg.receiver] = msg
                if isinstance(msg, Done):
                    self._held[msg.receiver] = msg.held
                else:
                    self._held.pop(msg.receiver, None)
                if isinstance(msg, Failed) and sync.failed is None:
                    sync.failed = msg
        elif isinstance(msg, Bye):
            self.on_left(
                msg.receiver,
                PeerBrokenError(
                    f"{self._describe(msg.receiver)} closed the channel: {msg.reason or 'bye'}"
                ),
            )
        else:
            self.on_broken(WireFormatError(f"receiver sent an unexpected {type(msg).__name__}"))
        self._signal.notify()

    def on_joined(self, index: int) -> None:
        """A receiver joined as ``index`` (transports call this): whatever the index's
        previous receiver held, this one is at no version the sender knows."""
        self._held.pop(index, None)
        self._signal.notify()

    def on_left(self, index: int, why: StreamsyncError) -> None:
        """Receiver ``index`` left or went away (transports call this): it owes nothing; a
        running sync it had not reported on fails (``require_all``) or goes on without it."""
        self.ring.forget(index)
        self._facts.pop(index, None)
        sync = self._sync
        if sync is not None and index in sync.members and index not in sync.reports:
            sync.members.discard(index)
            if self.require_all:
                if sync.lost is None:
                    sync.lost = type(why)(f"{why} during sync {sync.sync_id}")
            else:
                sync.absent.append(f"{why} during sync {sync.sync_id}")
        self._signal.notify()

    def on_broken(self, exc: StreamsyncError) -> None:
        """The channel cannot go on (its socket failed): every later call raises ``exc``."""
        if self._broken is None:
            self._broken = exc
        self._signal.notify()

    def _failed_as_consequence(self) -> bool:
        """Whether the receiver that failed only timed out or saw the channel end: then a
        receiver lost meanwhile is the cause to raise (:data:`~streamsync.errors.CONSEQUENCES`)."""
        failed = None if self._sync is None else self._sync.failed
        return failed is not None and failed.error in _CONSEQUENCE_NAMES

    # -- protocol ----------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        sync = self._sync
        failed, lost = (None, None) if sync is None else (sync.failed, sync.lost)
        if failed is not None and not (self._failed_as_consequence() and (lost or self._broken)):
            raise _receiver_failed(failed)
        if self._broken is not None:
            raise self._broken
        if lost is not None:
            raise lost

    async def send(
        self, sync_id: int, seq: int, bucket: Bucket, *, timeout: float, checksum: bool = False
    ) -> None:
        if seq == 0 and (self._sync is None or self._sync.sync_id != sync_id):
            await self._begin(sync_id, timeout)
        self._check()
        if self._sync is not None:
            self._sync.timeout = timeout
        if bucket.nbytes > self.slot_bytes:
            raise StreamsyncError(
                f"bucket of {bucket.nbytes} bytes does not fit a slot of {self.slot_bytes}"
            )
        taken: list[int] = []

        def ready() -> bool:
            self._check()
            slot = self.ring.take(sync_id, seq, self._members)
            if slot is not None:
                taken.append(slot)
            return slot is not None

        t0 = time.perf_counter()
        await self._signal.wait_until(
            ready, timeout=timeout, what=f"a free slot for bucket {seq} (receivers did not ack)"
        )
        t1 = time.perf_counter()
        slot = taken[0]
        buf = self.slot(slot)
        layout = bucket.pack_into(buf, checksum=checksum)
        header = BucketHeader(sync_id, seq, slot, bucket.nbytes, layout, bucket.base)
        self.store.filled(slot)
        t2 = time.perf_counter()
        await self._publish(header, buf[: bucket.nbytes])
        stats = self._stats
        self._stats = SenderStatistics(
            stats.buckets + 1,
            stats.wait_seconds + (t1 - t0),
            stats.pack_seconds + (t2 - t1),
            stats.publish_seconds + (time.perf_counter() - t2),
        )

    async def begin(self, sync_id: int, *, timeout: float) -> dict[int, int | None]:
        """Start sync ``sync_id`` now (its members are the receivers counted in) and return
        the version each member holds, for a delta's choice of base."""
        await self._begin(sync_id, timeout)
        return {index: self._held.get(index) for index in sorted(self._members)}

    async def forget(self, sync_id: int) -> None:
        """Drop sync ``sync_id``, begun but never sent (its receivers saw nothing of it)."""
        self._finish_sync(sync_id)

    async def _begin(self, sync_id: int, timeout: float) -> None:
        if self._sync is not None:
            raise SyncInProgressError(
                f"sync {sync_id} started while sync {self._sync.sync_id} is still running "
                "on this channel"
            )
        self._sync = sync = RunningSync(sync_id, timeout)
        await self.wait_ready(timeout=timeout)
        sync.members = self._admit()
        sync.absent += [
            f"{self._describe(index)} is not there"
            for index in range(self.receivers)
            if index not in sync.members
        ]

    async def end(self, end: End, *, timeout: float) -> list[Done]:
        try:
            if end.buckets == 0 and (self._sync is None or self._sync.sync_id != end.sync_id):
                await self._begin(end.sync_id, timeout)
            sync = self._sync
            assert sync is not None
            try:
                self._check()
            except StreamsyncError as exc:
                # A receiver failed before End went out: the others are still reading this
                # sync and would wait out their timeout for an End that never comes.
                await self.abort(Abort(end.sync_id, f"{type(exc).__name__}: {exc}"))
                raise
            await self._publish(end, None)

            def ready() -> bool:
                # A member lost during the sync (require_all) fails it, even when the
                # members left have all reported: the one that left may have been the only.
                if sync.lost is None and sync.members.issubset(sync.reports):
                    return True
                self._check()
                return False

            await self._signal.wait_until(
                ready,
                timeout=timeout,
                what=f"the reports of {len(sync.members)} receiver(s) on sync {end.sync_id}",
            )
            if sync.failed is not None:
                raise _receiver_failed(sync.failed)
            if not sync.members:
                # Without require_all every member left before reporting: none applied it.
                gone = "; ".join(sync.absent) or "no receiver reported"
                raise PeerBrokenError(f"every receiver left sync {end.sync_id}: {gone}")
            return [r for r in sync.reports.values() if isinstance(r, Done)]
        finally:
            self._finish_sync(end.sync_id)

    async def abort(self, abort: Abort) -> None:
        begun = self._sync
        if begun is not None and begun.sync_id != abort.sync_id:
            return  # that sync never started here (SyncInProgressError): leave the running one
        sync = self._sync = begun or RunningSync(abort.sync_id)
        for index in sync.members:
            self._held.pop(index, None)  # it may have applied part of the sync
        try:
            if not self._closed and self._broken is None:
                if not sync.members:
                    # Nothing of it went out (its receivers did not all come, its source
                    # raised at once): the receivers here wait for its first message, so
                    # they hear it is off rather than wait out their own timeout.
                    sync.members = self._admit()
                with anyio.move_on_after(1.0):
                    await self._publish(abort, None)
        finally:
            if begun is not None:
                self._finish_sync(abort.sync_id)
            self._sync = None

    def _finish_sync(self, sync_id: int) -> None:
        # A receiver's failure ends its sync, not the channel: the next sync starts clean.
        # Slots stay owed until acked: a receiver may still be reading one (it acks what it
        # skips), and reusing it early would hand it another bucket's bytes.
        sync = self._sync
        if sync is not None and sync.sync_id == sync_id:
            self._attendance = Attendance(tuple(sync.absent), self._refusals())
            self._sync = None


class RingReceiver(Receiver):
    """Receiver half of the ring protocol; transports provide ``_next`` and ``_post``."""

    def __init__(
        self,
        url: str,
        *,
        secret: bytes | str | None = None,
        connect_timeout: float = 60.0,
        group: int = 0,
        team: str = "",
        facts: bytes = b"",
    ) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self._secret = resolve_secret(secret)
        #: How many receivers join with this one, and what it says of itself, as it joins.
        self.group, self.team, self.facts = group, team, facts

    def _silence(self, timeout: float) -> SyncTimeoutError:
        """The error of a receive that heard nothing within its ``timeout``."""
        return SyncTimeoutError(f"{self.url}: nothing from the sender within {timeout:g} s")

    def _no_sender(self) -> SyncTimeoutError:
        """The error of a receiver that met no sender within ``connect_timeout``."""
        return SyncTimeoutError(f"{self.url}: no sender answered within {self.connect_timeout:g} s")

    @abstractmethod
    async def _next(self, *, timeout: float) -> tuple[Message, torch.Tensor | None]:
        """The next message from the sender and, for a bucket, its bytes."""

    @abstractmethod
    async def _post(self, msg: Ack | Done | Failed) -> None:
        """Send ``msg`` to the sender."""

    async def receive(self, *, timeout: float) -> Incoming:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        msg, data = await self._next(timeout=timeout)
        if isinstance(msg, Bye):
            raise EndOfStream(f"sender closed the channel: {msg.reason or 'bye'}")
        if not isinstance(msg, BucketHeader | End | Abort):
            raise WireFormatError(f"sender sent an unexpected {type(msg).__name__}")
        if isinstance(msg, BucketHeader) and data is None:
            raise WireFormatError(
                f"bucket {msg.seq} of sync {msg.sync_id} arrived without its bytes"
            )
        return Incoming(msg, data)

    async def release(self, header: BucketHeader) -> None:
        await self._post(Ack(header.sync_id, header.seq, header.slot, self.index))

    async def reply(self, report: Done | Failed) -> None:
        await self._post(report)


_CONSEQUENCE_NAMES = frozenset(c.__name__ for c in CONSEQUENCES)


def _receiver_failed(failed: Failed) -> ReceiverFailedError:
    exc = ReceiverFailedError(
        f"receiver {failed.receiver} failed sync {failed.sync_id}: {failed.error}: {failed.message}"
    )
    # What the failed receiver's model now holds (``send`` fills in its own counts).
    exc.report = SyncReport(
        sync_id=failed.sync_id,
        side="send",
        tensors=0,
        nbytes=0,
        buckets=0,
        seconds=0.0,
        complete=False,
        loaded=failed.applied,
        instances={f"receiver{failed.receiver}": LoadResult(loaded=failed.applied)},
    )
    return exc
