"""The link seam: opaque frames between a sender and each of its receivers.

A link knows nothing of the protocol: :class:`~streamsync.transports.linked.LinkedSender`
runs the handshake and the ring over it, and a link whose slot store has ``payload_frames``
carries a bucket's bytes after its header. At every boundary :func:`map_exceptions` maps
lower-level failures: a failed write raises :class:`~streamsync.PeerBrokenError`, a failed
read :class:`LinkLost`.

- :class:`SenderLink`, one per channel: ``open()`` binds (a taken address is a
  :class:`~streamsync.ConfigError`; ``url`` then names the bound port), ``serve(events)``
  accepts receivers until cancelled, each a :class:`Peer` whose frames go to
  :class:`LinkEvents` (receivers may leave and be replaced meanwhile).
- :class:`ReceiverLink`: ``connect()`` makes one try (:class:`NotThere` when nothing
  listens yet, for the caller to try again, paced by :class:`Tries`), ``handshake(hello)``
  returns the answer and any descriptors passed with it, ``receive()`` a frame and its
  payload.

Here: :class:`UnixLink`/:class:`UnixDialer`, length-prefixed frames over abstract unix
sockets, owner-only (``SO_PEERCRED``); :mod:`streamsync.transports.zeromq` adds ZeroMQ's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import torch
from anyio.abc import SocketAttribute, SocketListener, UNIXSocketStream

from streamsync.errors import (
    AuthenticationError,
    ConfigError,
    PeerBrokenError,
    StreamsyncError,
    WireFormatError,
)
from streamsync.wire.frames import WireCodec

#: Seconds a side waits for a peer's last word (a goodbye, the reason it failed) after
#: noticing the peer went, so the error it raises names the real reason.
LAST_WORD_S = 0.2
#: Largest control frame accepted (a bucket header with very many small tensors).
MAX_FRAME_BYTES = 64 << 20
#: Largest first frame accepted from a newcomer: a ``Hello`` is tiny, and until it is
#: checked the peer may be anyone.
MAX_HELLO_BYTES = 64 << 10
_PREFIX = struct.Struct(">I")
_CRED = struct.Struct("3i")
Fds = tuple[int, ...]


class LinkLost(Exception):
    """A link ended without a goodbye (EOF, reset, heartbeat timeout)."""


class NotThere(Exception):
    """Nothing listens at the sender's address (yet): try again."""


#: Shortest and longest pause between a receiver's tries to reach its sender.
RETRY_MIN_S = 0.002
RETRY_MAX_S = 0.02


@dataclass
class Tries:
    """How a receiver paces its tries to reach a sender not there yet (or still closing,
    between the steps of a one-shot loop): each pause is a tenth of the time waited so
    far, within :data:`RETRY_MIN_S` and :data:`RETRY_MAX_S`, so a sender that comes soon is
    met within milliseconds and one long in coming costs a try every :data:`RETRY_MAX_S`.
    Records the tries that failed and the pauses after them."""

    started: float
    #: Tries that did not get in, and the seconds paused after them (all, and the longest).
    failed: int = 0
    paused: float = 0.0
    longest: float = 0.0

    async def pause(self, deadline: float) -> None:
        """A try failed: wait before the next (not past ``deadline``)."""
        now = anyio.current_time()
        delay = min(RETRY_MAX_S, max(RETRY_MIN_S, (now - self.started) / 10))
        delay = min(delay, max(0.0, deadline - now))
        self.failed += 1
        self.paused += delay
        self.longest = max(self.longest, delay)
        await anyio.sleep(delay)


#: A read failing: the peer went away.
READ_ERRORS: Mapping[type[BaseException], type[BaseException]] = {
    anyio.EndOfStream: LinkLost,
    anyio.BrokenResourceError: LinkLost,
    anyio.ClosedResourceError: LinkLost,
    OSError: LinkLost,
}
#: A write failing: the peer is unreachable.
WRITE_ERRORS: Mapping[type[BaseException], type[BaseException]] = {
    anyio.BrokenResourceError: PeerBrokenError,
    anyio.ClosedResourceError: PeerBrokenError,
    OSError: PeerBrokenError,
}


@contextlib.contextmanager
def map_exceptions(
    mapping: Mapping[type[BaseException], type[BaseException]], context: str
) -> Iterator[None]:
    """Raise the first ``mapping`` target whose source matches an exception from the body,
    as ``target(f"{context} ({detail})")`` from it (after httpcore's ``map_exceptions``)."""
    try:
        yield
    except StreamsyncError:
        raise
    except Exception as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                detail = str(exc) or str(exc.__cause__ or "") or "connection closed"
                raise target(f"{context} ({detail})".lstrip()) from exc
        raise


@dataclass(eq=False)
class Peer:
    """One receiver as the sender sees it (its index and codec once it joined)."""

    who: str
    handle: Any = None
    index: int = -1
    codec: WireCodec | None = None
    describe: str = ""
    said_bye: bool = False


class LinkEvents(Protocol):
    """What a :class:`SenderLink` reports (implemented by the ring protocol)."""

    async def on_frame(self, peer: Peer, frame: bytes) -> bool:
        """A frame from ``peer`` (its first is its ``Hello``); False: drop the peer."""

    async def on_refused(self, peer: Peer, exc: StreamsyncError) -> None:
        """The link itself refuses ``peer`` (wrong owner, malformed first message)."""

    def on_lost(self, peer: Peer, detail: str) -> None:
        """``peer``'s link ended."""

    def on_broken(self, exc: StreamsyncError) -> None:
        """A peer sent something the link cannot carry on from."""


class SenderLink(ABC):
    """The sender's end of a link (see the module docstring)."""

    url: str

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def serve(self, events: LinkEvents) -> None: ...

    @abstractmethod
    async def send(
        self, peer: Peer, frame: bytes, payload: torch.Tensor | None = None, fds: Fds = ()
    ) -> None: ...

    @abstractmethod
    async def aclose(self) -> None: ...


class ReceiverLink(ABC):
    """A receiver's end of a link (see the module docstring)."""

    url: str

    @abstractmethod
    async def connect(self) -> None: ...

    @abstractmethod
    async def handshake(self, hello: bytes) -> tuple[bytes, list[int]]: ...

    @abstractmethod
    async def send(self, frame: bytes) -> None: ...

    @abstractmethod
    async def receive(self) -> tuple[bytes, Any]: ...

    @abstractmethod
    async def aclose(self) -> None: ...


# -- unix stream sockets --------------------------------------------------------------------
def unix_address(scheme: str, name: str) -> str:
    """The abstract socket of ``scheme://name``, private to this uid."""
    if sys.platform != "linux":
        raise ConfigError(f"{scheme}://{name}: needs Linux (abstract sockets, memfd)")
    address = f"\0streamsync-{scheme}/{os.getuid()}/{name}"
    if not name or "/" in name or len(address.encode()) > 107:
        raise ConfigError(
            f"{scheme}://{name}: the name must be 1 to {107 - len(address) + len(name)} "
            "characters without '/'"
        )
    return address


def _check_owner(sock: socket.socket, url: str, role: str) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, _ = _CRED.unpack(raw)
    if uid != os.getuid():
        raise AuthenticationError(
            f"{url}: the {role} (pid {pid}) runs as uid {uid}; only uid {os.getuid()} may join"
        )
    return int(pid)


class _Framed:
    """Length-prefixed frames over a unix stream (descriptors ride on a frame)."""

    def __init__(self, stream: UNIXSocketStream) -> None:
        self.stream = stream
        self.raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
        self._buf = bytearray()
        self._lock = anyio.Lock(fast_acquire=True)

    async def send(self, frame: bytes, fds: Fds, context: str) -> None:
        data = _PREFIX.pack(len(frame)) + frame
        async with self._lock:
            with map_exceptions(WRITE_ERRORS, f"{context}the peer's socket is gone"):
                if fds:
                    await self.stream.send_fds(data, fds)
                    return
                # A frame fits the socket buffer nearly always: write it now, and leave
                # only the wait for room to the stream (which yields to the loop first).
                try:
                    sent = self.raw.send(data)
                except BlockingIOError:
                    sent = 0
                if sent < len(data):
                    await self.stream.send(data[sent:])

    def _frame(self, limit: int) -> bytes | None:
        if len(self._buf) < _PREFIX.size:
            return None
        (size,) = _PREFIX.unpack_from(self._buf)
        if size > limit:
            raise WireFormatError(f"peer sent a frame of {size} bytes; at most {limit}")
        end = _PREFIX.size + size
        if len(self._buf) < end:
            return None
        frame = bytes(self._buf[_PREFIX.size : end])
        del self._buf[:end]
        return frame

    async def receive(
        self, *, with_fds: bool = False, limit: int = MAX_FRAME_BYTES
    ) -> tuple[bytes, list[int]]:
        fds: list[int] = []
        try:
            while (frame := self._frame(limit)) is None:
                with map_exceptions(READ_ERRORS, ""):
                    if with_fds:
                        data, more = await self.stream.receive_fds(1 << 16, 4)
                        fds += more
                    else:
                        # Likewise: what is here is read now; the stream waits for more.
                        try:
                            data = self.raw.recv(1 << 16)
                        except BlockingIOError:
                            data = await self.stream.receive(1 << 16)
                        if not data:
                            raise LinkLost("connection closed")
                self._buf += data
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return frame, fds

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


class UnixLink(SenderLink):
    """Sender end over an abstract unix socket, one stream per receiver (no payload frames)."""

    def __init__(self, scheme: str, name: str, *, receivers: int, timeout: float) -> None:
        self.url = f"{scheme}://{name}"
        self.address = unix_address(scheme, name)
        self.receivers = receivers
        self.timeout = timeout  # for a newcomer's Hello
        self._listener: SocketListener | None = None

    async def open(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.address)
            sock.listen(max(8, self.receivers))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{self.url} already has a sender") from None
            raise
        self._listener = await SocketListener.from_socket(sock)

    async def serve(self, events: LinkEvents) -> None:
        assert self._listener is not None
        async with anyio.create_task_group() as group:
            while True:
                try:
                    stream = await self._listener.accept()
                except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return
                assert isinstance(stream, UNIXSocketStream)
                group.start_soon(self._serve, _Framed(stream), events)

    async def _serve(self, link: _Framed, events: LinkEvents) -> None:
        peer = Peer("a receiver", link)
        try:
            try:
                peer.who = f"pid {_check_owner(link.raw, self.url, 'receiver')}"
                # Until its Hello is checked the peer may be anyone: what it may cost is
                # bounded (one small frame, within the timeout).
                with anyio.fail_after(self.timeout):
                    frame, _ = await link.receive(limit=MAX_HELLO_BYTES)
            except (StreamsyncError, LinkLost, TimeoutError) as exc:
                if not isinstance(exc, StreamsyncError):
                    exc = WireFormatError(
                        "left before saying Hello"
                        if isinstance(exc, LinkLost)
                        else f"sent no Hello within {self.timeout:g} s"
                    )
                await events.on_refused(peer, exc)
                return
            while await events.on_frame(peer, frame):
                try:
                    frame, _ = await link.receive()
                except LinkLost as exc:
                    events.on_lost(peer, str(exc))
                    return
                except StreamsyncError as exc:
                    events.on_broken(exc)
                    return
        finally:
            await link.aclose()

    async def send(
        self, peer: Peer, frame: bytes, payload: torch.Tensor | None = None, fds: Fds = ()
    ) -> None:
        await peer.handle.send(frame, fds, f"{self.url}: {peer.describe or peer.who}: ")

    async def aclose(self) -> None:
        if self._listener is not None:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
            self._listener = None


class UnixDialer(ReceiverLink):
    """Receiver end over an abstract unix socket."""

    def __init__(self, scheme: str, name: str) -> None:
        self.url = f"{scheme}://{name}"
        self.address = unix_address(scheme, name)
        self._link: _Framed | None = None
        #: The sender's pid, once connected (0 before).
        self.peer_pid = 0

    async def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            sock.connect(self.address)
        except (ConnectionRefusedError, FileNotFoundError, BlockingIOError) as exc:
            sock.close()
            raise NotThere(str(exc)) from None  # no sender yet (or its backlog is full)
        except BaseException:
            sock.close()
            raise
        self._link = _Framed(await UNIXSocketStream.from_socket(sock))
        self.peer_pid = _check_owner(sock, self.url, "sender")

    async def handshake(self, hello: bytes) -> tuple[bytes, list[int]]:
        assert self._link is not None
        await self.send(hello)
        return await self._link.receive(with_fds=True)

    async def send(self, frame: bytes) -> None:
        assert self._link is not None
        await self._link.send(frame, (), f"{self.url}: ")

    async def receive(self) -> tuple[bytes, Any]:
        assert self._link is not None
        frame, _ = await self._link.receive()
        return frame, None

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()
            self._link = None
