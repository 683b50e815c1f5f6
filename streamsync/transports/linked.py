"""The ring protocol between processes: a link (frames) composed with a slot store (bytes).

A transport between processes builds a :class:`LinkedSender` from a ``SenderLink`` and a
``SlotStore``, and a :class:`LinkedReceiver` from a ``ReceiverLink`` and a ``SlotView``
(see :mod:`streamsync.transports.shm`). They run the handshake when a receiver joins,
authenticate every later frame with the session's codec, and keep one reader per link in
the channel's task group; readers never raise: what they meet becomes ``on_broken`` on the
sender and a queued exception on the receiver.
"""

from __future__ import annotations

import contextlib
import math
import os

import anyio
import torch

from streamsync._tasks import ChannelTasks
from streamsync.errors import (
    ClosedError,
    ConfigError,
    PeerBrokenError,
    StreamsyncError,
    SyncTimeoutError,
    WireFormatError,
)
from streamsync.transports import handshake
from streamsync.transports.link import LinkLost, Peer, ReceiverLink, SenderLink
from streamsync.transports.ring import RingReceiver, RingSender
from streamsync.transports.slots import SlotStore, SlotView
from streamsync.wire import Abort, Ack, BucketHeader, Bye, Done, End, Failed, Message, WireCodec

__all__ = ["LinkedReceiver", "LinkedSender"]

# How long a sender whose write failed waits for what the receiver said before it went.
_DRAIN_S = 0.2


class LinkedSender(RingSender):
    """Sender side of the ring over ``link``, its bytes in ``store``."""

    def __init__(
        self,
        link: SenderLink,
        store: SlotStore,
        *,
        receivers: int = 1,
        secret: bytes | str | None = None,
        connect_timeout: float = 60.0,
    ) -> None:
        url = link.url
        if receivers < 1:
            raise ConfigError(f"{url}: receivers={receivers}; need at least 1")
        if store.slots < 1:
            raise ConfigError(
                f"{url}: slots={store.slots}; need at least 1 (2 or more to pipeline)"
            )
        if store.slot_bytes < 1024:
            raise ConfigError(f"{url}: slot_bytes={store.slot_bytes}; need at least 1024")
        super().__init__(store, receivers=receivers)
        self.url = url
        self.link = link
        self.connect_timeout = connect_timeout
        self._secret = handshake.resolve_secret(secret)
        self._codec = WireCodec(self._secret)
        self.peers: dict[int, Peer] = {}
        # Indices handed out in a Welcome whose receiver has not joined yet: two receivers
        # shaking hands at once must not get the same index.
        self._joining: set[int] = set()
        self._refused: StreamsyncError | None = None
        self._tasks = ChannelTasks()

    async def open(self) -> None:
        try:
            self.store.open()
            await self.link.open()
            self.url = self.link.url
            await self._tasks.start()
            self._tasks.start_soon(self.link.serve, self)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise

    # -- link events -------------------------------------------------------------------
    async def on_frame(self, peer: Peer, frame: bytes) -> bool:
        if peer.codec is not None:
            self._deliver(peer, frame)
            return True
        try:
            hello = handshake.check_hello(self._codec, frame, url=self.url, who=peer.who)
            taken = set(self.peers) | self._joining
            free = [i for i in range(self.receivers) if i not in taken]
            if not free or self._closed:
                raise ConfigError(
                    f"{self.url}: {hello.receiver} (pid {hello.pid}) tried to join, but all "
                    f"{self.receivers} receiver(s) have joined; open the sender with "
                    "receivers=N to serve more"
                )
        except StreamsyncError as exc:
            await self.on_refused(peer, exc)
            return False
        index = free[0]
        shared = self.store.shared()
        codec, welcome = handshake.welcome(
            self._codec,
            self._secret,
            hello,
            index=index,
            slots=self.ring.slots,
            slot_bytes=self.slot_bytes,
            shared=shared,
        )
        self._joining.add(index)
        try:
            await self.link.send(peer, welcome, None, shared.fds)
        except PeerBrokenError:
            return False
        finally:
            self._joining.discard(index)
        peer.index, peer.codec = index, codec
        peer.describe = f"receiver {index} ({hello.receiver}, pid {hello.pid})"
        self.peers[index] = peer
        if len(self.peers) >= self.receivers:
            self.link.all_joined()
        self._signal.notify()
        return True

    async def on_refused(self, peer: Peer, exc: StreamsyncError) -> None:
        # Sent first: recording the refusal may close this sender, and the newcomer
        # should still learn why.
        with anyio.move_on_after(1.0), contextlib.suppress(StreamsyncError):
            await self.link.send(peer, handshake.refusal(self._codec, exc))
        if len(self.peers) < self.receivers and self._refused is None:
            self._refused = type(exc)(f"{self.url}: refused {peer.who}: {exc}")
            self._signal.notify()

    def on_lost(self, peer: Peer, detail: str) -> None:
        if peer.codec is None or peer.said_bye or self._closed:
            return
        self.on_broken(
            PeerBrokenError(
                f"{self.url}: {peer.describe} went away without closing the channel ({detail})"
            )
        )

    def _deliver(self, peer: Peer, frame: bytes) -> None:
        assert peer.codec is not None
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

    # -- ring hooks ----------------------------------------------------------------------
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

    async def _send_frame(self, peer: Peer, frame: bytes, payload: torch.Tensor | None) -> None:
        await self.link.send(peer, frame, payload)

    async def _publish(
        self, msg: BucketHeader | End | Abort | Bye, payload: torch.Tensor | None
    ) -> None:
        payload = payload if self.store.payload_frames else None
        for index in sorted(self.peers):
            peer = self.peers[index]
            assert peer.codec is not None
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
                    if not peer.said_bye and peer.codec is not None:
                        with contextlib.suppress(StreamsyncError, OSError):
                            frame = peer.codec.encode(Bye("sender closed"))
                            await self._send_frame(peer, frame, None)
            await self._shutdown()

    async def _shutdown(self) -> None:
        self._closed = True
        await self._tasks.aclose()
        await self.link.aclose()
        self.store.close()
        self._signal.notify()


_Item = tuple[Message, torch.Tensor | None] | StreamsyncError


class LinkedReceiver(RingReceiver):
    """Receiver side of the ring over ``link``, reaching the slots through ``view``; its
    reader queues what the sender says (a dead sender is noticed even while a sink loads)."""

    def __init__(
        self,
        link: ReceiverLink,
        view: SlotView,
        *,
        secret: bytes | str | None = None,
        connect_timeout: float = 60.0,
    ) -> None:
        self.url = link.url
        self.link = link
        self.view = view
        self.connect_timeout = connect_timeout
        self._secret = handshake.resolve_secret(secret)
        self._codec = WireCodec(self._secret)
        self._session: WireCodec | None = None
        self.slots = 0
        self.slot_bytes = 0
        self._queue_in, self._queue = anyio.create_memory_object_stream[_Item](math.inf)
        self._terminal: _Item | None = None
        self._tasks = ChannelTasks()

    async def open(self) -> None:
        try:
            with anyio.fail_after(self.connect_timeout):
                await self._join()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            if isinstance(exc, TimeoutError) and not isinstance(exc, StreamsyncError):
                raise SyncTimeoutError(
                    f"{self.url}: no sender answered within {self.connect_timeout:g} s"
                ) from None
            if isinstance(exc, LinkLost):
                raise PeerBrokenError(
                    f"{self.url}: the sender dropped the connection during the handshake ({exc})"
                ) from None
            raise
        await self._tasks.start()
        self._tasks.start_soon(self._read_loop)

    async def _join(self) -> None:
        await self.link.connect()
        nonce, hello = handshake.hello(self._codec)
        frame, fds = await self.link.handshake(hello)
        try:
            welcome, session = handshake.accept(
                self._codec, self._secret, frame, nonce, url=self.url
            )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        try:
            self.view.attach(welcome, fds)
        except StreamsyncError as exc:
            raise type(exc)(f"{self.url}: {exc}") from None
        self._index, self.slots, self.slot_bytes = welcome.index, welcome.slots, welcome.slot_bytes
        self._session = session

    async def _read_loop(self) -> None:
        assert self._session is not None
        try:
            while True:
                frame, payload = await self.link.receive()
                msg = self._session.decode(frame)
                data = None
                if isinstance(msg, BucketHeader):
                    try:
                        data = self.view.data(msg, payload)
                    except StreamsyncError as exc:
                        raise type(exc)(f"{self.url}: {exc}") from None
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
            await self.link.send(self._session.encode(msg))

    async def release(self, header: BucketHeader) -> None:
        self.view.release(header)
        await super().release(header)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._session is not None and self._link_up():
                with anyio.move_on_after(1.0), contextlib.suppress(StreamsyncError, OSError):
                    await self.link.send(self._session.encode(Bye("receiver closed", self.index)))
            await self._shutdown()

    async def _shutdown(self) -> None:
        await self._tasks.aclose()
        self._queue_in.close()
        self._queue.close()
        await self.link.aclose()
        self.view.close()
