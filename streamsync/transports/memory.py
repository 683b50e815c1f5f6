"""``memory://NAME``: an in-process transport for tests and single-process setups.

The slot-ring protocol of the process transports (so backpressure, fan-out and reports
behave the same) over :class:`~streamsync.transports.slots.HostSlots`, read by reference;
messages travel as objects through per-receiver inboxes. Sender and receivers meet by name.

It takes every option the process transports take, so a user's test makes the production
call. ``secret`` is checked (a receiver whose secret differs from the sender's gets
:class:`~streamsync.errors.AuthenticationError`), though nothing crosses a process
boundary to sign; a receiver's ``connect_timeout`` has no meaning here (it joins at once).
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
    SyncTimeoutError,
)
from streamsync.transports import Endpoint, Transport
from streamsync.transports.handshake import resolve_secret
from streamsync.transports.ring import RingReceiver, RingSender
from streamsync.transports.slots import HostSlots
from streamsync.wire.bucket import DEFAULT_BUCKET_BYTES
from streamsync.wire.frames import Abort, Ack, BucketHeader, Bye, Done, End, Failed, Message


@dataclass
class _Channel:
    name: str
    sender: MemorySender | None = None
    inboxes: list[MemoryObjectSendStream[Message]] = field(default_factory=list)
    receivers: list[MemoryReceiver | None] = field(default_factory=list)
    joined: anyio.Event | None = None


_channels: dict[str, _Channel] = {}


def _forget_if_unused(chan: _Channel) -> None:
    if chan.sender is None and not any(chan.receivers) and _channels.get(chan.name) is chan:
        del _channels[chan.name]


class MemorySender(RingSender):
    """Sender side of ``memory://NAME``."""

    def __init__(
        self,
        name: str,
        *,
        receivers: int = 1,
        slots: int = 2,
        slot_bytes: int = DEFAULT_BUCKET_BYTES,
        connect_timeout: float = 60.0,
        require_all: bool = True,
        secret: bytes | str | None = None,
    ) -> None:
        store = HostSlots(slots, slot_bytes, prefault=False)
        super().__init__(store, receivers=receivers, require_all=require_all)
        self.name = name
        self.connect_timeout = connect_timeout
        self.secret = resolve_secret(secret)
        self._chan: _Channel | None = None

    async def open(self) -> None:
        chan = _channels.setdefault(self.name, _Channel(self.name))
        if chan.sender is not None:
            raise ConfigError(f"memory://{self.name} already has a sender")
        chan.sender = self
        self._chan = chan
        for index, receiver in enumerate(chan.receivers):
            if receiver is not None and receiver.secret != self.secret:
                receiver.refuse(self.name)
                chan.receivers[index] = None
        self.store.open()  # allocated once and reused by every sync on this channel

    async def _await_receivers(self, timeout: float) -> None:
        chan = self._chan
        assert chan is not None
        with anyio.move_on_after(min(timeout, self.connect_timeout)):
            while not self._enough(len(self._admit())):
                chan.joined = anyio.Event()
                await chan.joined.wait()
        if not self._enough(len(self._admit())):
            raise SyncTimeoutError(
                f"memory://{self.name}: {len(self._admit())} of {self.receivers} receivers "
                f"joined within {min(timeout, self.connect_timeout):g} s"
            )
        if len(chan.receivers) > self.receivers:
            raise ConfigError(
                f"memory://{self.name}: {len(chan.receivers)} receivers joined; the sender "
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
                self.on_left(
                    index, PeerBrokenError(f"memory://{self.name}: receiver {index} is gone")
                )
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
            _forget_if_unused(chan)
        self.store.close()
        self._closed = True


class MemoryReceiver(RingReceiver):
    """Receiver side of ``memory://NAME``."""

    def __init__(
        self, name: str, *, secret: bytes | str | None = None, connect_timeout: float = 60.0
    ) -> None:
        self.name = name
        self.secret = resolve_secret(secret)
        self.connect_timeout = connect_timeout  # joining is immediate in one process
        self._chan: _Channel | None = None
        self._inbox: MemoryObjectReceiveStream[Message] | None = None
        self._refused: AuthenticationError | None = None

    def refuse(self, name: str) -> None:
        """Turned away by a sender whose secret differs: the next receive raises."""
        self._refused = AuthenticationError(
            f"memory://{name}: the sender has another secret; pass the same secret= (or "
            "$STREAMSYNC_SECRET) to both sides"
        )
        if self._inbox is not None:
            self._inbox.close()

    async def open(self) -> None:
        chan = _channels.setdefault(self.name, _Channel(self.name))
        if chan.sender is not None and chan.sender.secret != self.secret:
            self.refuse(self.name)
            assert self._refused is not None
            raise self._refused
        send, recv = anyio.create_memory_object_stream[Message](math.inf)
        if None in chan.receivers:  # the place of a receiver that left
            self._index = chan.receivers.index(None)
            chan.receivers[self._index] = self
            chan.inboxes[self._index] = send
        else:
            self._index = len(chan.receivers)
            chan.receivers.append(self)
            chan.inboxes.append(send)
        self._chan = chan
        self._inbox = recv
        if chan.sender is not None:
            chan.sender.on_joined(self._index)
        if chan.joined is not None:
            chan.joined.set()

    async def _next(self, *, timeout: float) -> tuple[Message, torch.Tensor | None]:
        if self._refused is not None:
            raise self._refused
        assert self._inbox is not None and self._chan is not None
        while True:
            try:
                with anyio.fail_after(timeout):
                    msg = await self._inbox.receive()
            except TimeoutError:
                raise SyncTimeoutError(
                    f"memory://{self.name}: nothing from the sender within {timeout:g} s"
                ) from None
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if self._refused is not None:
                    raise self._refused from None
                raise EndOfStream(f"memory://{self.name}: sender closed the channel") from None
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
        _forget_if_unused(chan)


def _sender(endpoint: Endpoint, opts: dict[str, Any]) -> MemorySender:
    return MemorySender(endpoint.target, **opts)


def _receiver(endpoint: Endpoint, opts: dict[str, Any]) -> MemoryReceiver:
    return MemoryReceiver(endpoint.target, **opts)


#: ``memory://NAME``: the entry point's object (every transport's options).
TRANSPORT = Transport(_sender, _receiver)
