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
from collections import deque
from typing import Any

import anyio
import torch

from streamsync._log import log, warn
from streamsync._tasks import ChannelTasks
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
from streamsync.transports import handshake
from streamsync.transports.link import (
    LinkLost,
    NotThere,
    Peer,
    ReceiverLink,
    SenderLink,
    Tries,
)
from streamsync.transports.ring import RingReceiver, RingSender
from streamsync.transports.slots import SlotStore, SlotView
from streamsync.wire.frames import (
    Abort,
    Ack,
    BucketHeader,
    Bye,
    Done,
    End,
    Failed,
    Hello,
    Joined,
    Message,
    Welcome,
    WireCodec,
)

# Departures and refusals a sender remembers for its messages and reports.
_KEEP = 8
_Payload = torch.Tensor | None
_Published = BucketHeader | End | Abort | Bye


class FrameFilter:
    """Changes what a :class:`LinkedSender` sends, on its way out: the seam for a test peer
    that spoils its own frames. The default changes nothing."""

    def message(self, msg: _Published, slot: _Payload) -> _Published:
        """The message to send in place of ``msg`` (``slot``: a bucket's packed bytes),
        once per message."""
        return msg

    def frame(self, msg: _Published, frame: bytes, payload: _Payload) -> tuple[bytes, _Payload]:
        """The frame and payload frame to send for ``msg`` to one receiver."""
        return frame, payload


# Longest wait for the sender's answer to one Hello before trying again with a new link.
_ATTEMPT_S = 5.0


class LinkedSender(RingSender):
    """Sender side of the ring over ``link``, its bytes in ``store``.

    Receivers may come and go while the channel is open: a newcomer is counted in once it
    confirmed its ``Welcome`` and takes part from the next sync; one that leaves or dies
    frees its index for a replacement (see :mod:`streamsync.transports.ring`). Anything
    that is not a streamsync receiver of this channel is turned away at the handshake and
    logged with its address; a refused peer that looks like a receiver (wrong secret, other
    protocol version) also shows in the next sync's report and in a timeout's message.

    ``codec`` encodes the frames before the handshake (default: one of ``secret`` in this
    protocol version); ``frames`` changes what goes out (default: nothing).
    """

    def __init__(
        self,
        link: SenderLink,
        store: SlotStore,
        *,
        codec: WireCodec | None = None,
        frames: FrameFilter | None = None,
        **options: Any,
    ) -> None:
        super().__init__(link.url, store, **options)
        self.link = link
        self._codec = codec or WireCodec(self._secret)
        self._frames = frames
        #: The receivers counted in, by index.
        self.peers: dict[int, Peer] = {}
        # Welcomed, not yet confirmed: their indices are reserved.
        self._joining: dict[int, Peer] = {}
        self._sealed = False
        self._refused: deque[str] = deque(maxlen=_KEEP)
        self._left: deque[str] = deque(maxlen=_KEEP)
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
            return self._deliver(peer, frame)
        try:
            hello = handshake.check_hello(self._codec, frame, url=self.url, who=peer.who)
        except StreamsyncError as exc:
            await self.on_refused(peer, exc)
            return False
        taken = set(self.peers) | set(self._joining)
        if not self._closed and not self._sealed:
            refused = self.count(f"receiver {hello.receiver}", hello.group, hello.team)
            if refused is not None:
                await self.on_refused(peer, refused)
                return False
        free = [i for i in range(self.receivers) if i not in taken]
        if self._closed or self._sealed or not free:
            why = (
                f"{self.url} is closing"
                if self._closed or self._sealed
                else f"all {self.receivers} receiver(s) of {self.url} are there; open the "
                "sender with receivers=N to serve more"
            )
            log("channel.busy", url=self.url, peer=peer.who, pid=hello.pid, reason=why)
            await self._tell(peer, handshake.refusal(self._codec, ConfigError(why), busy=True))
            return False
        index = free[0]
        shared = self.store.shared()
        codec, welcome = handshake.welcome(
            self._codec,
            hello,
            index=index,
            slots=self.ring.slots,
            slot_bytes=self.slot_bytes,
            shared=shared,
        )
        peer.index, peer.codec = index, codec
        self._facts[index] = hello.facts
        peer.describe = f"receiver {index} ({hello.receiver}, pid {hello.pid})"
        self._joining[index] = peer
        try:
            await self.link.send(peer, welcome, None, shared.fds)
        except PeerBrokenError:
            self._joining.pop(index, None)
            return False
        return True

    async def on_refused(self, peer: Peer, exc: StreamsyncError) -> None:
        if not isinstance(exc, AuthenticationError | ProtocolVersionError | ConfigError):
            # Not a receiver trying to join (a port scanner, random bytes, malformed frames,
            # a late frame of an earlier session): dropped without an answer.
            log("channel.stranger", url=self.url, peer=peer.who, error=str(exc))
            return
        # A receiver of another channel or version: told why, and reported.
        warn("channel.refused", url=self.url, peer=peer.who, error=f"{type(exc).__name__}: {exc}")
        self._refused.append(f"{peer.who}: {type(exc).__name__}: {exc}")
        await self._tell(peer, handshake.refusal(self._codec, exc))

    async def _tell(self, peer: Peer, frame: bytes, *, within: float = 1.0) -> None:
        """Send ``peer`` a last frame, best effort: a peer that cannot hear it is going."""
        with anyio.move_on_after(within), contextlib.suppress(StreamsyncError, OSError):
            await self.link.send(peer, frame)

    def on_lost(self, peer: Peer, detail: str) -> None:
        if peer.codec is None or peer.said_bye:
            return
        self._leave(
            peer,
            PeerBrokenError(
                f"{self.url}: {peer.describe} went away without closing the channel ({detail})"
            ),
        )

    def _leave(self, peer: Peer, why: StreamsyncError) -> None:
        """``peer`` is gone (or must go): free its index; a sync it is in is told."""
        if self._joining.get(peer.index) is peer:
            del self._joining[peer.index]
            return
        if self.peers.get(peer.index) is not peer:
            return  # left already
        del self.peers[peer.index]
        self._left.append(str(why))
        log("channel.left", url=self.url, receiver=peer.index, reason=str(why))
        self.on_left(peer.index, why)

    def _deliver(self, peer: Peer, frame: bytes) -> bool:
        assert peer.codec is not None
        joining = self._joining.get(peer.index) is peer
        if not joining and self.peers.get(peer.index) is not peer:
            return False  # a receiver that left: nothing it says counts now
        try:
            msg = peer.codec.decode(frame)
            if joining:
                if not isinstance(msg, Joined) or msg.receiver != peer.index:
                    raise WireFormatError(f"sent {type(msg).__name__} instead of Joined")
            elif isinstance(msg, Ack | Done | Failed) and msg.receiver != peer.index:
                raise WireFormatError(f"replied as receiver {msg.receiver}")
            elif isinstance(msg, Hello | Welcome | Joined):
                raise WireFormatError(f"sent {type(msg).__name__} after joining")
        except StreamsyncError as exc:
            self._leave(peer, type(exc)(f"{self.url}: {peer.describe}: {exc}"))
            return False
        if joining:
            del self._joining[peer.index]
            self.peers[peer.index] = peer
            self.on_joined(peer.index)
            log("channel.joined", url=self.url, receiver=peer.index, peer=peer.describe)
            return True
        if isinstance(msg, Bye):
            peer.said_bye = True
            del self.peers[peer.index]
            self._left.append(f"{peer.describe} closed the channel: {msg.reason or 'bye'}")
            msg = Bye(msg.reason, peer.index)
        self.on_reply(msg)
        return not peer.said_bye

    def seal(self) -> None:
        self._sealed = True

    # -- ring hooks ----------------------------------------------------------------------
    def _admit(self) -> set[int]:
        return set(self.peers)

    def _describe(self, index: int) -> str:
        peer = self.peers.get(index)
        return f"{self.url}: {peer.describe if peer is not None else f'receiver {index}'}"

    def _refusals(self) -> tuple[str, ...]:
        refused = tuple(self._refused)
        self._refused.clear()
        return refused

    def _whereabouts(self) -> str:
        return "".join(
            f"; {label}: {'; '.join(items)}"
            for label, items in (("left", self._left), ("refused", self._refused))
            if items
        )

    async def _send_frame(self, peer: Peer, frame: bytes, payload: _Payload) -> None:
        await self.link.send(peer, frame, payload)

    async def _publish(self, msg: _Published, payload: _Payload) -> None:
        if self._frames is not None:
            msg = self._frames.message(msg, payload)
        await self._post_all(msg, payload)

    async def _post_all(self, msg: _Published, payload: _Payload) -> None:
        """Send ``msg`` to every member, with ``payload`` where the store sends frames."""
        payload = payload if self.store.payload_frames else None
        for index in sorted(self._members):
            peer = self.peers.get(index)
            if peer is None:
                continue  # left during this sync: on_left recorded it
            assert peer.codec is not None
            frame, data = peer.codec.encode(msg), payload
            if self._frames is not None:
                frame, data = self._frames.frame(msg, frame, data)
            try:
                await self._send_frame(peer, frame, data)
            except PeerBrokenError as exc:

                def heard(peer: Peer = peer) -> bool:
                    failed = self._sync is not None and self._sync.failed is not None
                    return failed or self.peers.get(peer.index) is not peer

                await self._hear(heard)
                self._leave(peer, exc)
                self._check()

    async def aclose(self) -> None:
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(1.0):
                for peer in list(self.peers.values()):
                    if not peer.said_bye and peer.codec is not None:
                        await self._tell(peer, peer.codec.encode(Bye("sender closed")))
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
    reader queues what the sender says (a dead sender is noticed even while a sink loads).
    ``codec`` is as the sender's."""

    def __init__(
        self,
        link: ReceiverLink,
        view: SlotView,
        *,
        codec: WireCodec | None = None,
        **options: Any,
    ) -> None:
        super().__init__(link.url, **options)
        self.link = link
        self.view = view
        #: How the last :meth:`open` paced its tries to reach the sender.
        self.tries = Tries(0.0)
        self._sync_timeout = self.connect_timeout  # the running receive's, once there is one
        self._codec = codec or WireCodec(self._secret)
        self._session: WireCodec | None = None
        self.slots = 0
        self.slot_bytes = 0
        self._queue_in, self._queue = anyio.create_memory_object_stream[_Item](math.inf)
        self._terminal: _Item | None = None
        self._tasks = ChannelTasks()

    async def open(self) -> None:
        deadline = anyio.current_time() + self.connect_timeout
        last: StreamsyncError | None = None  # why the last attempt did not get in
        self.tries = tries = Tries(anyio.current_time())
        try:
            while True:
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    raise last or self._no_sender()
                try:
                    with anyio.fail_after(min(remaining, _ATTEMPT_S)):
                        await self._join()
                    break
                except NotThere:
                    pass  # no sender yet
                except handshake.Busy as exc:
                    last = exc.error  # closing, or full until a leaver is noticed
                except LinkLost as exc:  # e.g. a sender that closed as we reached it
                    last = PeerBrokenError(
                        f"{self.url}: the sender dropped the connection during the "
                        f"handshake ({exc})"
                    )
                except TimeoutError as exc:
                    if isinstance(exc, StreamsyncError):
                        raise
                    if last is None or isinstance(last, SyncTimeoutError):
                        last = self._no_sender()
                # Try again on a new link (a new identity: nothing of this one carries over).
                with anyio.CancelScope(shield=True):
                    await self.link.aclose()
                await tries.pause(deadline)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise
        await self._tasks.start()
        self._tasks.start_soon(self._read_loop)

    async def _join(self) -> None:
        await self.link.connect()
        nonce, hello = handshake.hello(
            self._codec, group=self.group, team=self.team, facts=self.facts
        )
        try:
            frame, fds = await self.link.handshake(hello)
        except PeerBrokenError as exc:  # our Hello could not be written: the sender went
            raise LinkLost(str(exc)) from None
        try:
            welcome, session = handshake.accept(self._codec, frame, nonce, url=self.url)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        try:
            self.view.attach(welcome, fds)
        except StreamsyncError as exc:
            raise type(exc)(f"{self.url}: {exc}") from None
        try:
            await self.link.send(session.encode(Joined(welcome.index)))
        except BaseException as exc:
            self.view.close()
            if isinstance(exc, PeerBrokenError):
                raise LinkLost(str(exc)) from None
            raise
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
                        data = await self.view.fill(msg, payload, timeout=self._sync_timeout)
                    except LinkLost:
                        raise
                    except StreamsyncError as exc:
                        raise type(exc)(f"{self.url}: {exc}") from None
                self._queue_in.send_nowait((msg, data))
                if isinstance(msg, Bye):
                    return
                # The queue holds this bucket now: holding it here too, while the next
                # one is awaited, would keep one more bucket alive (a zmq message).
                del frame, payload, data
        except LinkLost as exc:
            self.view.lost()
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
        self._sync_timeout = timeout  # what the reader's view.fill is bounded by
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
                    raise self._silence(timeout) from None
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
