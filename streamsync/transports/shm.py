"""``shm://NAME``: a ring of shared-memory slots between processes on one machine (Linux).

Bytes: the sender creates one anonymous shared-memory file (``memfd``, mode 0600) holding
``slots`` slots of ``slot_bytes``, maps and pre-faults it once, and hands the file
descriptor to each receiver during the handshake (``SCM_RIGHTS``); each receiver maps it once
(pre-faulted with ``MAP_POPULATE``). A bucket is packed straight into a free slot; the
receiver's sink reads a view of that slot. Buffers live as long as the channel, across syncs.

Messages: one unix-domain stream socket per receiver, in the abstract namespace
(``@streamsync-shm/<uid>/NAME``), carrying length-prefixed :class:`~streamsync.wire.WireCodec`
frames: headers out, acks and reports back. Both ends check the peer's uid
(``SO_PEERCRED``): only the owner's processes may join.

Nothing to leak: the segment has no name in ``/dev/shm`` and the socket no file, so a
SIGKILL of either side leaves nothing behind; the kernel frees the memory when the last
mapping goes. A dead peer's socket reads EOF at once, which the other side raises as
:class:`~streamsync.PeerBrokenError`.

URL options: ``receivers`` (default 1), ``slots`` (default 2), ``slot_bytes`` (default 64 MiB).
Keyword arguments: ``secret`` (bytes; default ``$STREAMSYNC_SECRET``), ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import socket
import struct
import sys
from typing import TYPE_CHECKING, Any

import anyio
import torch

from streamsync.errors import (
    AuthenticationError,
    ConfigError,
    PeerBrokenError,
    StreamsyncError,
    WireFormatError,
)
from streamsync.transports._process import LinkLost, Peer, ProcessReceiver, ProcessSender
from streamsync.wire import BucketHeader, Welcome

if TYPE_CHECKING:
    from streamsync.transports import Endpoint

__all__ = ["SharedMemoryReceiver", "SharedMemorySender"]

#: Largest control frame accepted (a bucket header with very many small tensors).
MAX_FRAME_BYTES = 64 << 20
_PREFIX = struct.Struct(">I")
_CRED = struct.Struct("3i")


def _address(scheme: str, name: str) -> str:
    if sys.platform != "linux":
        raise ConfigError(f"{scheme}://{name}: needs Linux (abstract sockets, memfd)")
    address = f"\0streamsync-{scheme}/{os.getuid()}/{name}"
    if not name or "/" in name or len(address.encode()) > 107:
        raise ConfigError(
            f"{scheme}://{name}: the name must be 1 to {107 - len(address) + len(name)} "
            "characters without '/'"
        )
    return address


def _peer_uid_pid(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid, pid


def _check_owner(sock: socket.socket, url: str, role: str) -> int:
    uid, pid = _peer_uid_pid(sock)
    if uid != os.getuid():
        raise AuthenticationError(
            f"{url}: the {role} (pid {pid}) runs as uid {uid}; only uid {os.getuid()} may join"
        )
    return pid


class FramedSocket:
    """Length-prefixed frames over a non-blocking stream socket (file descriptors ride on
    the handshake frame)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._buf = bytearray()
        self._lock = anyio.Lock()

    async def send(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
        data = _PREFIX.pack(len(frame)) + frame
        loop = asyncio.get_running_loop()
        try:
            async with self._lock:
                if fds:
                    while True:
                        try:
                            sent = socket.send_fds(self.sock, [data], list(fds))
                            break
                        except BlockingIOError:
                            await anyio.wait_writable(self.sock)
                    data = data[sent:]
                if data:
                    await loop.sock_sendall(self.sock, data)
        except OSError as exc:
            raise PeerBrokenError(f"the peer's socket is gone ({exc})") from exc

    def _frame(self) -> bytes | None:
        if len(self._buf) < _PREFIX.size:
            return None
        (size,) = _PREFIX.unpack_from(self._buf)
        if size > MAX_FRAME_BYTES:
            raise WireFormatError(f"peer sent a frame of {size} bytes; at most {MAX_FRAME_BYTES}")
        end = _PREFIX.size + size
        if len(self._buf) < end:
            return None
        frame = bytes(self._buf[_PREFIX.size : end])
        del self._buf[:end]
        return frame

    async def receive(self) -> bytes:
        loop = asyncio.get_running_loop()
        while (frame := self._frame()) is None:
            try:
                data = await loop.sock_recv(self.sock, 1 << 16)
            except OSError as exc:
                raise LinkLost(str(exc)) from exc
            if not data:
                raise LinkLost("connection closed")
            self._buf += data
        return frame

    async def receive_with_fds(self) -> tuple[bytes, list[int]]:
        fds: list[int] = []
        try:
            while (frame := self._frame()) is None:
                await anyio.wait_readable(self.sock)
                try:
                    data, more, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise LinkLost(str(exc)) from exc
                fds += more
                if not data:
                    raise LinkLost("connection closed")
                self._buf += data
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return frame, fds

    def close(self) -> None:
        self.sock.close()


class SharedMemorySender(ProcessSender):
    """Sender side of ``shm://NAME``."""

    scheme = "shm"

    def __init__(
        self,
        name: str,
        *,
        receivers: int = 1,
        slots: int = 2,
        slot_bytes: int = 64 << 20,
        secret: bytes | str | None = None,
        connect_timeout: float = 60.0,
    ) -> None:
        super().__init__(
            f"{self.scheme}://{name}",
            receivers=receivers,
            slots=slots,
            slot_bytes=slot_bytes,
            secret=secret,
            connect_timeout=connect_timeout,
        )
        self.name = name
        self._address = _address(self.scheme, name)
        self._listener: socket.socket | None = None
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self._slots: list[torch.Tensor] = []

    # -- slots (overridden by device transports) ------------------------------------------
    def _make_slots(self) -> None:
        size = self.ring.slots * self.slot_bytes
        self._fd = os.memfd_create(f"streamsync-{self.name}", os.MFD_CLOEXEC)
        os.fchmod(self._fd, 0o600)
        os.ftruncate(self._fd, size)
        self._mm = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._slots = [
            torch.frombuffer(
                self._mm, dtype=torch.uint8, count=self.slot_bytes, offset=i * self.slot_bytes
            )
            for i in range(self.ring.slots)
        ]
        for buf in self._slots:
            # Touch every page once now: a first copy into fresh pages runs at a quarter of
            # the speed of a warm one.
            buf.zero_()

    def _handshake_fds(self) -> tuple[int, ...]:
        assert self._fd is not None
        return (self._fd,)

    def _free_slots(self) -> None:
        self._slots = []
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # views still held elsewhere: GC unmaps
                self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    # -- ProcessSender hooks --------------------------------------------------------------
    async def _start(self) -> None:
        self._make_slots()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener = listener
        try:
            listener.bind(self._address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{self.url} already has a sender") from None
            raise
        listener.listen(max(8, self.receivers))
        listener.setblocking(False)
        self._spawn(self._accept_loop(listener))

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError:
                return
            self._spawn(self._serve(FramedSocket(conn)))

    async def _serve(self, link: FramedSocket) -> None:
        who = "a receiver"
        try:
            try:
                who = f"pid {_check_owner(link.sock, self.url, 'receiver')}"
                with anyio.fail_after(self.connect_timeout):
                    hello = await link.receive()
                peer, welcome = self._welcome(hello, who)
            except StreamsyncError as exc:
                with anyio.move_on_after(1.0), contextlib.suppress(StreamsyncError):
                    await link.send(self._refusal(exc))
                self._refused_by(who, exc)
                return
            except (LinkLost, TimeoutError):
                return
            peer.handle = link
            try:
                await link.send(welcome, self._handshake_fds())
            except PeerBrokenError:
                self._joining.discard(peer.index)
                return
            self._joined(peer)
            try:
                while True:
                    self._deliver(peer, await link.receive())
            except LinkLost as exc:
                self._lost(peer, str(exc))
            except StreamsyncError as exc:
                self.on_broken(exc)
        finally:
            link.close()

    async def _send_frame(self, peer: Peer, frame: bytes, payload: torch.Tensor | None) -> None:
        link: FramedSocket = peer.handle
        try:
            await link.send(frame)
        except PeerBrokenError as exc:
            raise PeerBrokenError(f"{self.url}: {peer.describe}: {exc}") from exc

    async def _stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for peer in self.peers.values():
            if isinstance(peer.handle, FramedSocket):
                peer.handle.close()
        self._free_slots()


class SharedMemoryReceiver(ProcessReceiver):
    """Receiver side of ``shm://NAME``."""

    scheme = "shm"

    def __init__(
        self, name: str, *, secret: bytes | str | None = None, connect_timeout: float = 60.0
    ) -> None:
        super().__init__(f"{self.scheme}://{name}", secret=secret, connect_timeout=connect_timeout)
        self.name = name
        self._address = _address(self.scheme, name)
        self._link: FramedSocket | None = None
        self._slots: list[torch.Tensor] = []

    # -- slots (overridden by device transports) ------------------------------------------
    def _attach(self, welcome: Welcome, fds: list[int]) -> None:
        if len(fds) != 1:
            raise WireFormatError(f"{self.url}: the sender passed {len(fds)} descriptors, not 1")
        fd = fds[0]
        try:
            size = welcome.slots * welcome.slot_bytes
            if welcome.slots < 1 or os.fstat(fd).st_size < size:
                raise WireFormatError(
                    f"{self.url}: the segment is smaller than {welcome.slots} slots of "
                    f"{welcome.slot_bytes} bytes"
                )
            # MAP_POPULATE maps every page now rather than at first touch in the first sync.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        # The views keep the mapping alive; it goes when the last of them does.
        self._slots = [
            torch.frombuffer(
                mm, dtype=torch.uint8, count=welcome.slot_bytes, offset=i * welcome.slot_bytes
            )
            for i in range(welcome.slots)
        ]

    def _bucket_data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        if not 0 <= header.slot < len(self._slots):
            raise WireFormatError(
                f"{self.url}: bucket {header.seq} is in slot {header.slot}; the ring has "
                f"{len(self._slots)}"
            )
        return self._slots[header.slot]

    # -- ProcessReceiver hooks ------------------------------------------------------------
    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self._address)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                await anyio.sleep(0.05)  # no sender yet
            except BaseException:
                sock.close()
                raise
        self._link = link = FramedSocket(sock)
        _check_owner(sock, self.url, "sender")
        nonce, hello = self._hello()
        await link.send(hello)
        frame, fds = await link.receive_with_fds()
        try:
            welcome = self._accept(frame, nonce)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._attach(welcome, fds)

    async def _send_frame(self, frame: bytes) -> None:
        assert self._link is not None
        await self._link.send(frame)

    async def _recv_frame(self) -> tuple[bytes, Any]:
        assert self._link is not None
        return await self._link.receive(), None

    async def _stop(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        self._slots = []


def sender_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> SharedMemorySender:
    """``shm://NAME?receivers=&slots=&slot_bytes=``; keyword arguments override."""
    return SharedMemorySender(endpoint.target, **endpoint.sender_options(kwargs))


def receiver_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> SharedMemoryReceiver:
    """``shm://NAME``."""
    return SharedMemoryReceiver(endpoint.target, **kwargs)
