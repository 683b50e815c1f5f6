"""What the process transports share: the handshake, a background reader on each side, and
the mapping of a lost link to :class:`~streamsync.PeerBrokenError`.

A process transport subclasses :class:`ProcessSender` and :class:`ProcessReceiver` and adds
only how frames (and slot bytes) move. The handshake is the same everywhere:

1. the receiver sends ``Hello`` with a fresh nonce, authenticated by the channel's shared
   secret when there is one;
2. the sender checks it, assigns the receiver an index and answers ``Welcome`` with the slot
   layout, its own nonce and the receiver's nonce echoed (so a recorded ``Welcome`` cannot be
   replayed);
3. every later frame on that link is authenticated with a session key derived from the
   secret and both nonces, so frames of another session cannot be replayed either.

A refused receiver gets a ``Bye`` saying why and the sender raises the refusal from the
rendezvous of its next sync. Each side runs one reader task (an ``asyncio`` task, so the
order in which channels are closed does not matter); readers never raise: what they meet
becomes ``on_broken`` on the sender and a queued exception on the receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import math
import os
from abc import abstractmethod
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from streamsync.errors import (
    AuthenticationError,
    ClosedError,
    ConfigError,
    PeerBrokenError,
    ProtocolVersionError,
    StreamsyncError,
    SyncTimeoutError,
    WireFormatError,
)
from streamsync.transports.ring import RingReceiver, RingSender
from streamsync.wire import (
    Abort,
    Ack,
    BucketHeader,
    Bye,
    Done,
    End,
    Failed,
    Hello,
    Message,
    Welcome,
    WireCodec,
)

__all__ = ["SECRET_ENV", "LinkLost", "Peer", "ProcessReceiver", "ProcessSender", "resolve_secret"]

#: Environment variable holding the channel's shared secret when none is passed.
SECRET_ENV = "STREAMSYNC_SECRET"

_NONCE_BYTES = 16
# How long a sender whose write failed waits for what the receiver said before it went.
_DRAIN_S = 0.2
# Refusal reasons a receiver maps back to the sender's exception type.
_REFUSALS: dict[str, type[StreamsyncError]] = {
    "AuthenticationError": AuthenticationError,
    "ProtocolVersionError": ProtocolVersionError,
    "ConfigError": ConfigError,
}


class LinkLost(Exception):
    """A transport's link ended without a goodbye (EOF, reset, heartbeat timeout)."""


def resolve_secret(secret: bytes | str | None) -> bytes | None:
    """The channel's shared secret: ``secret`` if given, else ``$STREAMSYNC_SECRET``, else
    none (no authentication)."""
    if secret is None:
        env = os.environ.get(SECRET_ENV)
        return env.encode() if env else None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ConfigError("secret is empty; pass some random bytes (32 is plenty) or None")
    return raw


def _session_codec(secret: bytes | None, receiver_nonce: bytes, sender_nonce: bytes) -> WireCodec:
    if secret is None:
        return WireCodec(None)
    key = hmac.new(
        secret, b"streamsync-session\0" + receiver_nonce + sender_nonce, hashlib.sha256
    ).digest()
    return WireCodec(key)


@dataclass(eq=False)
class Peer:
    """One joined receiver, as the sender sees it."""

    index: int
    codec: WireCodec
    describe: str
    #: Transport-specific handle of the link (a socket, a ZMQ identity).
    handle: Any = None
    said_bye: bool = False


class ProcessSender(RingSender):
    """Sender half of a process transport: rendezvous, handshake, replies and lost links."""

    def __init__(
        self,
        url: str,
        *,
        receivers: int,
        slots: int,
        slot_bytes: int,
        secret: bytes | str | None,
        connect_timeout: float,
    ) -> None:
        if receivers < 1:
            raise ConfigError(f"{url}: receivers={receivers}; need at least 1")
        if slots < 1:
            raise ConfigError(f"{url}: slots={slots}; need at least 1 (2 or more to pipeline)")
        if slot_bytes < 1024:
            raise ConfigError(f"{url}: slot_bytes={slot_bytes}; need at least 1024")
        super().__init__(slots=slots, receivers=receivers, slot_bytes=slot_bytes)
        self.url = url
        self.connect_timeout = connect_timeout
        self._secret = resolve_secret(secret)
        self._codec = WireCodec(self._secret)
        self.peers: dict[int, Peer] = {}
        # Indices handed out in a Welcome whose receiver has not joined yet: two receivers
        # shaking hands at once must not get the same index.
        self._joining: set[int] = set()
        self._refused: StreamsyncError | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- transport hooks ---------------------------------------------------------------
    @abstractmethod
    async def _start(self) -> None:
        """Create the slots and the listening end; start the reader(s) with ``_spawn``."""

    @abstractmethod
    async def _send_frame(self, peer: Peer, frame: bytes, payload: torch.Tensor | None) -> None:
        """Send one frame (and a bucket's bytes) to ``peer``; raise ``PeerBrokenError`` if
        the link is gone."""

    @abstractmethod
    async def _stop(self) -> None:
        """Release every resource (tolerates a partly started transport)."""

    def _layout(self) -> tuple[str, bytes]:
        """``Welcome.segment`` and ``Welcome.layout`` for a joining receiver."""
        return "", b""

    def _on_all_joined(self) -> None:
        """Every receiver has joined (e.g. remove a rendezvous file nobody needs now)."""

    # -- helpers for transports --------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _welcome(self, frame: bytes, who: str) -> tuple[Peer, bytes]:
        """Check a newcomer's ``Hello``: the joined peer and the ``Welcome`` frame to send.
        Raises the reason to refuse it (send ``_refusal(exc)`` back, then call
        ``_refused_by`` and drop the link)."""
        msg = self._codec.decode(frame)
        if not isinstance(msg, Hello):
            raise WireFormatError(f"{self.url}: {who} sent {type(msg).__name__} before Hello")
        free = [i for i in range(self.receivers) if i not in self.peers and i not in self._joining]
        if not free or self._closed:
            raise ConfigError(
                f"{self.url}: {msg.receiver} (pid {msg.pid}) tried to join, but all "
                f"{self.receivers} receiver(s) have joined; open the sender with receivers=N "
                "to serve more"
            )
        nonce = os.urandom(_NONCE_BYTES)
        segment, layout = self._layout()
        welcome = Welcome(
            free[0],
            self.ring.slots,
            self.slot_bytes,
            segment,
            nonce=nonce,
            echo=msg.nonce,
            layout=layout,
        )
        self._joining.add(free[0])
        peer = Peer(
            free[0],
            _session_codec(self._secret, msg.nonce, nonce),
            f"receiver {free[0]} ({msg.receiver}, pid {msg.pid})",
        )
        return peer, self._codec.encode(welcome)

    def _refusal(self, exc: StreamsyncError) -> bytes:
        """The ``Bye`` frame that tells a refused newcomer why."""
        return self._codec.encode(Bye(f"refused: {type(exc).__name__}: {exc}"))

    def _refused_by(self, who: str, exc: StreamsyncError) -> None:
        """Record why ``who`` was refused, for the next rendezvous to raise. Called once
        the refusal is sent: raising it may close this sender, and the newcomer should
        still learn why."""
        if len(self.peers) < self.receivers and self._refused is None:
            self._refused = type(exc)(f"{self.url}: refused {who}: {exc}")
            self._signal.notify()

    def _joined(self, peer: Peer) -> None:
        self._joining.discard(peer.index)
        self.peers[peer.index] = peer
        if len(self.peers) >= self.receivers:
            self._on_all_joined()
        self._signal.notify()

    def _deliver(self, peer: Peer, frame: bytes) -> None:
        """Decode a frame ``peer`` sent and feed it to the ring."""
        try:
            msg = peer.codec.decode(frame)
        except StreamsyncError as exc:
            self.on_broken(type(exc)(f"{self.url}: {peer.describe}: {exc}"))
            return
        if isinstance(msg, Bye):
            peer.said_bye = True
            msg = Bye(msg.reason, peer.index)
        elif isinstance(msg, Ack | Done | Failed) and msg.receiver != peer.index:
            self.on_broken(
                WireFormatError(f"{self.url}: {peer.describe} replied as receiver {msg.receiver}")
            )
            return
        self.on_reply(msg)

    def _lost(self, peer: Peer, detail: str) -> None:
        if peer.said_bye or self._closed:
            return
        self.on_broken(
            PeerBrokenError(
                f"{self.url}: {peer.describe} went away without closing the channel ({detail})"
            )
        )

    # -- lifecycle and ring hooks --------------------------------------------------------
    async def open(self) -> None:
        try:
            await self._start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise

    async def _await_receivers(self, timeout: float) -> None:
        limit = min(timeout, self.connect_timeout)

        def ready() -> bool:
            if self._refused is not None:
                # Raised once: a stray or mismatched peer must not lock out the right one.
                refused, self._refused = self._refused, None
                raise refused
            self._check()
            return len(self.peers) >= self.receivers

        try:
            await self._signal.wait_until(ready, timeout=limit, what="receivers")
        except SyncTimeoutError:
            raise SyncTimeoutError(
                f"{self.url}: {len(self.peers)} of {self.receivers} receivers joined within "
                f"{limit:g} s"
            ) from None

    async def _publish(
        self, msg: BucketHeader | End | Abort | Bye, payload: torch.Tensor | None
    ) -> None:
        for index in sorted(self.peers):
            peer = self.peers[index]
            try:
                await self._send_frame(peer, peer.codec.encode(msg), payload)
            except PeerBrokenError as exc:
                # What the receiver said before it went (its failure, its goodbye) may
                # still be unread: give the reader a moment, so that the reason wins.
                def heard(index: int = index) -> bool:
                    return (
                        self._failed is not None
                        or self._broken is not None
                        or index in self._departed
                    )

                with contextlib.suppress(SyncTimeoutError):
                    await self._signal.wait_until(heard, timeout=_DRAIN_S, what="")
                self.on_broken(exc)
                self._check()

    async def aclose(self) -> None:
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(1.0):
                for peer in list(self.peers.values()):
                    if not peer.said_bye:
                        with contextlib.suppress(StreamsyncError, OSError):
                            frame = peer.codec.encode(Bye("sender closed"))
                            await self._send_frame(peer, frame, None)
            self._closed = True
            await self._shutdown()

    async def _shutdown(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._stop()
        self._signal.notify()


_Item = tuple[Message, torch.Tensor | None] | StreamsyncError


class ProcessReceiver(RingReceiver):
    """Receiver half of a process transport: connect, handshake, and a reader task that
    queues what the sender says (so a dead sender is noticed even while a sink loads)."""

    def __init__(self, url: str, *, secret: bytes | str | None, connect_timeout: float) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self._secret = resolve_secret(secret)
        self._codec = WireCodec(self._secret)
        self._session: WireCodec | None = None
        self.slots = 0
        self.slot_bytes = 0
        self._queue_in, self._queue = anyio.create_memory_object_stream[_Item](math.inf)
        self._terminal: _Item | None = None
        self._task: asyncio.Task[None] | None = None

    # -- transport hooks ---------------------------------------------------------------
    @abstractmethod
    async def _connect(self) -> None:
        """Reach the sender and run the handshake (``_hello`` / ``_accept``); bounded by the
        caller's connect timeout."""

    @abstractmethod
    async def _send_frame(self, frame: bytes) -> None:
        """Send one frame to the sender; raise ``PeerBrokenError`` if the link is gone."""

    @abstractmethod
    async def _recv_frame(self) -> tuple[bytes, Any]:
        """The next frame from the sender and its payload (transport-specific, or None);
        raise :class:`LinkLost` when the link ends."""

    @abstractmethod
    def _bucket_data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        """The uint8 bytes of a bucket: a view of its slot, or of the payload frame."""

    @abstractmethod
    async def _stop(self) -> None:
        """Release every resource (tolerates a partly connected transport)."""

    # -- helpers for transports --------------------------------------------------------
    def _hello(self) -> tuple[bytes, bytes]:
        """A fresh nonce and the ``Hello`` frame carrying it."""
        nonce = os.urandom(_NONCE_BYTES)
        who = f"{os.uname().nodename}/{os.getpid()}"
        return nonce, self._codec.encode(Hello(who, os.getpid(), nonce=nonce))

    def _accept(self, frame: bytes, nonce: bytes) -> Welcome:
        """Check the sender's answer to our ``Hello`` and adopt the session it starts."""
        msg = self._codec.decode(frame)
        if isinstance(msg, Bye):
            kind, _, detail = msg.reason.removeprefix("refused: ").partition(": ")
            error = _REFUSALS.get(kind, PeerBrokenError)
            raise error(f"{self.url}: the sender refused this receiver: {detail or msg.reason}")
        if not isinstance(msg, Welcome):
            raise WireFormatError(f"{self.url}: sender answered Hello with {type(msg).__name__}")
        if msg.echo != nonce:
            raise AuthenticationError(
                f"{self.url}: the sender's Welcome answers another Hello (replayed?)"
            )
        self.index = msg.index
        self.slots = msg.slots
        self.slot_bytes = msg.slot_bytes
        self._session = _session_codec(self._secret, nonce, msg.nonce)
        return msg

    # -- lifecycle and ring hooks --------------------------------------------------------
    async def open(self) -> None:
        try:
            with anyio.fail_after(self.connect_timeout):
                await self._connect()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._stop()
            if isinstance(exc, TimeoutError) and not isinstance(exc, StreamsyncError):
                raise SyncTimeoutError(
                    f"{self.url}: no sender answered within {self.connect_timeout:g} s"
                ) from None
            if isinstance(exc, LinkLost):
                raise PeerBrokenError(
                    f"{self.url}: the sender dropped the connection during the handshake ({exc})"
                ) from None
            raise
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        assert self._session is not None
        try:
            while True:
                frame, payload = await self._recv_frame()
                msg = self._session.decode(frame)
                data = self._bucket_data(msg, payload) if isinstance(msg, BucketHeader) else None
                self._queue_in.send_nowait((msg, data))
                if isinstance(msg, Bye):
                    return
        except LinkLost as exc:
            self._queue_in.send_nowait(
                PeerBrokenError(
                    f"{self.url}: the sender went away without closing the channel ({exc})"
                )
            )
        except StreamsyncError as exc:
            self._queue_in.send_nowait(exc)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # closing
        except Exception as exc:  # a reader never raises: the next receive does
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._queue_in.send_nowait(
                    PeerBrokenError(f"{self.url}: link to the sender failed: {exc!r}")
                )

    async def _next(self, *, timeout: float) -> tuple[Message, torch.Tensor | None]:
        try:
            item = self._queue.receive_nowait()
        except anyio.WouldBlock:
            if self._terminal is not None:
                item = self._terminal
            else:
                try:
                    with anyio.fail_after(timeout):
                        item = await self._queue.receive()
                except TimeoutError:
                    raise SyncTimeoutError(
                        f"{self.url}: nothing from the sender within {timeout:g} s"
                    ) from None
        if isinstance(item, StreamsyncError):
            self._terminal = item
            raise item
        if isinstance(item[0], Bye):
            self._terminal = item
        return item

    def _link_up(self) -> bool:
        """The sender is still there to be written to: it neither left nor vanished (a
        frame this side could not read ends the channel, but the sender should hear why)."""
        terminal = self._terminal
        return terminal is None or (
            isinstance(terminal, StreamsyncError) and not isinstance(terminal, PeerBrokenError)
        )

    async def _post(self, msg: Ack | Done | Failed) -> None:
        if self._session is None:
            raise ClosedError(f"{self.url}: receiver is not open")
        if not self._link_up():
            # Like a socket whose peer left: the reply is dropped; the next receive says why.
            return
        with contextlib.suppress(PeerBrokenError):
            await self._send_frame(self._session.encode(msg))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._session is not None and self._link_up():
                with anyio.move_on_after(1.0), contextlib.suppress(StreamsyncError, OSError):
                    await self._send_frame(self._session.encode(Bye("receiver closed", self.index)))
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            self._queue_in.close()
            self._queue.close()
            await self._stop()
