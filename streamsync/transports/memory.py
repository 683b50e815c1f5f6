"""``memory://NAME``: an in-process transport for tests and single-process setups.

The process transports' slot ring (the same backpressure, fan-out and reports) over
:class:`~streamsync.transports.slots.HostSlots`, read by reference; messages travel as
objects through per-receiver inboxes. It takes every option they take, so a user's test
makes the production call, and checks ``secret`` (a differing one is an
:class:`~streamsync.errors.AuthenticationError`). A receiver opens at once (one task may
open both sides); its first receive waits for a sender until ``connect_timeout`` after it
opened, within that receive's ``timeout``.

Both ends of a channel share one state object, as anyio's memory streams do, found by
name through :class:`MemoryChannels`, which holds each open channel until its last side
closes.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from streamsync.errors import (
    AuthenticationError,
    ConfigError,
    EndOfStream,
    PeerBrokenError,
    StreamsyncError,
)
from streamsync.transports import Transport
from streamsync.transports.ring import RingReceiver, RingSender
from streamsync.transports.slots import HostSlots
from streamsync.wire.frames import Abort, Ack, BucketHeader, Bye, Done, End, Failed, Message


@dataclass(eq=False)
class _Channel:
    """The state a sender and its receivers on one name share."""

    name: str
    sender: MemorySender | None = None
    inboxes: list[MemoryObjectSendStream[Message]] = field(default_factory=list)
    receivers: list[MemoryReceiver | None] = field(default_factory=list)


class MemoryChannels:
    """The open ``memory://`` channels of this process, by name: where a sender and
    receivers opened separately meet. A channel is dropped when its last side closes."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Channel] = {}

    def join(self, name: str) -> _Channel:
        """The channel named ``name``, made if none is open."""
        return self._by_name.setdefault(name, _Channel(name))

    def leave(self, chan: _Channel) -> None:
        """A side of ``chan`` closed: forget the channel if nothing uses it now."""
        unused = chan.sender is None and not any(chan.receivers)
        if unused and self._by_name.get(chan.name) is chan:
            del self._by_name[chan.name]

    def transport(self) -> Transport:
        """``memory://`` whose sides meet in these channels."""
        return Transport(
            lambda endpoint, opts: MemorySender(endpoint.target, self, **opts),
            lambda endpoint, opts: MemoryReceiver(endpoint.target, self, **opts),
        )


class MemorySender(RingSender):
    """Sender side of ``memory://NAME``."""

    def __init__(
        self, name: str, channels: MemoryChannels, *, slots: int, slot_bytes: int, **options: Any
    ) -> None:
        store = HostSlots(slots, slot_bytes, prefault=False)
        super().__init__(f"memory://{name}", store, **options)
        self.name = name
        self._channels = channels
        self._chan: _Channel | None = None

    async def open(self) -> None:
        chan = self._channels.join(self.name)
        if chan.sender is not None:
            raise ConfigError(f"{self.url} already has a sender")
        chan.sender = self
        self._chan = chan
        for index, receiver in enumerate(chan.receivers):
            if receiver is None:
                continue
            refused = self._meet(index, receiver)
            if refused is not None:
                receiver.refuse(refused)
                chan.receivers[index] = None
            else:
                receiver.met()
        self.store.open()  # allocated once and reused by every sync on this channel

    def _meet(self, index: int, receiver: MemoryReceiver) -> StreamsyncError | None:
        """Receiver ``index`` meets this sender: why it is refused, if it is."""
        if receiver._secret != self._secret:
            return AuthenticationError(
                f"{self.url}: the sender has another secret; pass the same secret= (or "
                "$STREAMSYNC_SECRET) to both sides"
            )
        refused = self.count(f"receiver {index}", receiver.group, receiver.team)
        if refused is None:
            self._facts[index] = receiver.facts
        return refused

    async def wait_ready(self, *, timeout: float) -> None:
        await super().wait_ready(timeout=timeout)
        chan = self._chan
        assert chan is not None
        if len(chan.receivers) > self.receivers:
            raise ConfigError(
                f"{self.url}: {len(chan.receivers)} receivers joined; the sender "
                f"expects receivers={self.receivers}"
            )

    def _admit(self) -> set[int]:
        assert self._chan is not None
        return {i for i, r in enumerate(self._chan.receivers[: self.receivers]) if r is not None}

    async def _publish(
        self, msg: BucketHeader | End | Abort | Bye, payload: torch.Tensor | None
    ) -> None:
        assert self._chan is not None
        inboxes = self._chan.inboxes
        for index in sorted(self._members):
            try:
                if index >= len(inboxes):  # every receiver closed: the roster was cleared
                    raise anyio.ClosedResourceError
                inboxes[index].send_nowait(msg)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.on_left(index, PeerBrokenError(f"{self.url}: receiver {index} is gone"))
                self._check()

    async def aclose(self) -> None:
        if self._closed:
            return
        chan = self._chan
        if chan is not None and chan.sender is self:
            for send in chan.inboxes:
                with contextlib.suppress(
                    anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock
                ):
                    send.send_nowait(Bye("sender closed"))
                send.close()
            chan.sender = None
            chan.inboxes = []
            chan.receivers = []
            self._channels.leave(chan)
        self.store.close()
        self._closed = True


class MemoryReceiver(RingReceiver):
    """Receiver side of ``memory://NAME``."""

    def __init__(self, name: str, channels: MemoryChannels, **options: Any) -> None:
        super().__init__(f"memory://{name}", **options)
        self.name = name
        self._channels = channels
        self._chan: _Channel | None = None
        self._inbox: MemoryObjectReceiveStream[Message] | None = None
        self._refused: StreamsyncError | None = None
        # Set once a sender is there (or turned this receiver away); until then the first
        # receive waits for one, until connect_timeout after opening.
        self._met: anyio.Event | None = None
        self._meet_by = 0.0

    def met(self) -> None:
        """A sender is there: the first receive need not wait for one."""
        if self._met is not None:
            self._met.set()

    def refuse(self, why: StreamsyncError) -> None:
        """Turned away by the sender (another secret, another count): the next receive
        raises ``why``."""
        self._refused = why
        if self._inbox is not None:
            self._inbox.close()
        self.met()

    async def open(self) -> None:
        self._met = anyio.Event()
        self._meet_by = anyio.current_time() + self.connect_timeout
        chan = self._channels.join(self.name)
        index = chan.receivers.index(None) if None in chan.receivers else len(chan.receivers)
        refused = None if chan.sender is None else chan.sender._meet(index, self)
        if refused is not None:
            self.refuse(refused)
            self._channels.leave(chan)
            raise refused
        send, recv = anyio.create_memory_object_stream[Message](math.inf)
        if None not in chan.receivers:  # else the place of a receiver that left
            chan.receivers.append(None)
            chan.inboxes.append(send)
        self._index = chan.receivers.index(None)
        chan.receivers[self._index] = self
        chan.inboxes[self._index] = send
        self._chan = chan
        self._inbox = recv
        if chan.sender is not None:
            chan.sender.on_joined(self._index)
            self.met()

    async def _meet(self, timeout: float) -> None:
        """Wait for a sender to be there, until ``connect_timeout`` after opening and
        within the receive's ``timeout``."""
        assert self._met is not None
        if self._met.is_set():
            return
        left = self._meet_by - anyio.current_time()
        with anyio.move_on_after(max(0.0, min(left, timeout))):
            await self._met.wait()
        if self._met.is_set():
            return
        if left <= timeout:
            raise self._no_sender()
        raise self._silence(timeout)

    async def _next(self, *, timeout: float) -> tuple[Message, torch.Tensor | None]:
        await self._meet(timeout)
        if self._refused is not None:
            raise self._refused
        assert self._inbox is not None and self._chan is not None
        while True:
            try:
                with anyio.fail_after(timeout):
                    msg = await self._inbox.receive()
            except TimeoutError:
                raise self._silence(timeout) from None
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if self._refused is not None:
                    raise self._refused from None
                raise EndOfStream(f"{self.url}: sender closed the channel") from None
            if not isinstance(msg, BucketHeader):
                return msg, None
            sender = self._chan.sender
            if sender is not None:
                return msg, sender.slot(msg.slot) if 0 <= msg.slot < sender.ring.slots else None
            # The sender left with this bucket in flight (its slots are gone); what it said
            # last, an abort or a goodbye, follows in the inbox.

    async def _post(self, msg: Ack | Done | Failed) -> None:
        chan = self._chan
        # As over a socket whose peer left: the reply is dropped; the next receive says why.
        if chan is not None and chan.sender is not None:
            chan.sender.on_reply(msg)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        chan = self._chan
        if chan is None:
            return
        if chan.sender is not None:
            chan.sender.on_reply(Bye("receiver closed", self.index))
        if self in chan.receivers:
            chan.receivers[chan.receivers.index(self)] = None
        if not any(chan.receivers):
            # Nobody listens any more: the next receivers start a fresh roster.
            chan.receivers = []
            chan.inboxes = []
        if self._inbox is not None:
            self._inbox.close()
        self._channels.leave(chan)


#: ``memory://NAME``: the entry point's object (every transport's options); its factories
#: hold the process's open channels.
TRANSPORT = MemoryChannels().transport()
