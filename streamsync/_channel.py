"""What both sides of a sync share (``sending.py``, ``receiving.py``): the default wait, the
state each side keeps on its transport end between syncs, the names a sync carried as both
sides count them, and the log line of a finished sync.

A transport holds the state without knowing it (:meth:`~streamsync.Sender.sync_state`):
it lives as long as the channel, on the sender or receiver object, and only this layer
reads it.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamsync._delta import Baseline
from streamsync._log import log
from streamsync._replay import BucketPlans
from streamsync.report import SyncReport
from streamsync.transports.base import Receiver, Sender
from streamsync.wire.unpack import Unpacker

#: Seconds any single wait may take unless told otherwise.
DEFAULT_TIMEOUT = 60.0


@dataclass
class SenderState:
    """What :func:`~streamsync.send` keeps on a sender between syncs: the delta baseline and
    the bucket plans of its sources."""

    baseline: Baseline = field(default_factory=Baseline)
    plans: BucketPlans = field(default_factory=BucketPlans)


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


def sender_state(sender: Sender) -> SenderState:
    """The sync protocol's state on ``sender``'s channel (made on first use)."""
    return sender.sync_state(SenderState)


def receiver_state(receiver: Receiver) -> ReceiverState:
    """The sync protocol's state on ``receiver``'s channel (made on first use)."""
    return receiver.sync_state(ReceiverState)


def sorted_once(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` sorted, each once (a chunked tensor's name comes with each chunk): the
    names a sync carried, as the receiver's ``Done`` and the sender's report count them."""
    ordered = sorted(names)
    if all(map(operator.ne, ordered, itertools.islice(ordered, 1, None))):
        return tuple(ordered)
    return tuple(name for name, _ in itertools.groupby(ordered))


def finished(report: SyncReport) -> SyncReport:
    """Log a finished sync's report (either side) and return it."""
    log(
        "sync.done",
        side=report.side,
        sync_id=report.sync_id,
        bytes=report.nbytes,
        seconds=round(report.seconds, 6),
        gbps=round(report.gbps, 3),
    )
    return report
