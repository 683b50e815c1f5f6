"""``zmq+tcp://HOST:PORT`` and ``zmq+ipc://PATH``: the slot ring over ZeroMQ; the transport
that crosses machines.

Bytes: the sender packs a bucket into one of its ``slots`` local buffers (allocated once) and
sends it to every receiver as a two-frame message, metadata frame then the slot's bytes,
without copying (``copy=False``); the slot is reused only after every receiver acked it, so
ZeroMQ has finished with the bytes by then. A receiver hands its sink views of the received
frame (no copy). High-water marks of a few messages per peer add ZeroMQ's own backpressure
under the ring's.

Messages: one ROUTER socket on the sender (binds; fan-out by receiver identity, replies come
back on it) and a DEALER per receiver (connects). A dead peer is seen through socket
monitors (the connection drops: at once for a killed process, after ``heartbeat`` x 3
seconds of ZeroMQ heartbeats for a vanished machine) and raised as
:class:`~streamsync.PeerBrokenError`.

Security: tcp binds 127.0.0.1 unless HOST says otherwise (``*`` for every interface); pass
``secret=`` (or set ``$STREAMSYNC_SECRET``) to authenticate peers with HMAC over every
message; the payload bytes are not encrypted. An ipc socket file is made 0600 and removed as
soon as every receiver joined; a bare name lives in a 0700 per-user directory, ``@name`` is
an abstract socket (no file at all).

URL options: ``receivers`` (default 1), ``slots`` (default 2), ``slot_bytes`` (default
64 MiB). Keyword arguments: ``secret``, ``connect_timeout``, ``heartbeat`` (seconds, default
1.0). Port 0 binds a free port; the sender's ``url`` then names it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from typing import TYPE_CHECKING, Any

import anyio
import torch

from streamsync.bucket import allocate_slot
from streamsync.errors import ConfigError, PeerBrokenError, StreamsyncError, WireFormatError
from streamsync.transports._process import LinkLost, Peer, ProcessReceiver, ProcessSender
from streamsync.wire import BucketHeader

if TYPE_CHECKING:
    from streamsync.transports import Endpoint

__all__ = ["ZmqReceiver", "ZmqSender", "zmq_address"]

# Grace for a goodbye still in the data socket when the monitor reports the drop.
_DRAIN_S = 0.2
# Largest message the sender accepts from a receiver (as ``shm.MAX_FRAME_BYTES``).
_MAX_INBOUND_BYTES = 64 << 20


def _runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"streamsync-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path} must be a directory owned by uid {os.getuid()}, mode 0700")
    return path


def zmq_address(scheme: str, target: str, *, bind: bool) -> str:
    """The ZeroMQ endpoint of a ``zmq+tcp``/``zmq+ipc`` URL target."""
    if scheme == "zmq+tcp":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"zmq+tcp://{target}: expected zmq+tcp://HOST:PORT")
        host = host or "127.0.0.1"
        if host == "*" and not bind:
            raise ConfigError(f"zmq+tcp://{target}: a receiver needs the sender's host, not '*'")
        return f"tcp://{host}:{port}"
    if scheme == "zmq+ipc":
        if target.startswith("@") or target.startswith("/"):
            return f"ipc://{target}"
        if "/" in target:
            raise ConfigError(
                f"zmq+ipc://{target}: use an absolute path, @name or a bare name without '/'"
            )
        return f"ipc://{os.path.join(_runtime_dir(), target + '.sock')}"
    raise ConfigError(f"{scheme}://{target}: not a ZeroMQ scheme; use zmq+tcp or zmq+ipc")


def _ipc_file(address: str) -> str | None:
    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        return address[len("ipc://") :]
    return None


def _tune(sock: Any, zmq: Any, *, hwm: int, heartbeat: float) -> None:
    ms = max(1, int(heartbeat * 1000))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ms)
    sock.setsockopt(zmq.LINGER, 1000)


class ZmqSender(ProcessSender):
    """Sender side of ``zmq+tcp://`` and ``zmq+ipc://``."""

    def __init__(
        self,
        url: str,
        *,
        receivers: int = 1,
        slots: int = 2,
        slot_bytes: int = 64 << 20,
        secret: bytes | str | None = None,
        connect_timeout: float = 60.0,
        heartbeat: float = 1.0,
    ) -> None:
        from streamsync.transports import parse_endpoint

        super().__init__(
            url,
            receivers=receivers,
            slots=slots,
            slot_bytes=slot_bytes,
            secret=secret,
            connect_timeout=connect_timeout,
        )
        endpoint = parse_endpoint(url)
        self._scheme = endpoint.scheme
        self.address = zmq_address(endpoint.scheme, endpoint.target, bind=True)
        self.heartbeat = heartbeat
        self._slots: list[torch.Tensor] = []
        self._ctx: Any = None
        self._sock: Any = None
        self._monitor: Any = None
        self._by_identity: dict[bytes, Peer] = {}
        self._by_fd: dict[int, Peer] = {}
        self._file: str | None = None

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    async def _start(self) -> None:
        import zmq
        import zmq.asyncio

        self._slots = [allocate_slot(self.slot_bytes) for _ in range(self.ring.slots)]
        for buf in self._slots:
            buf.zero_()  # fault the pages in now, not during the first sync
        self._ctx = zmq.asyncio.Context(io_threads=1)
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable receiver raises
        # Anyone who can reach the port can send: a peer announcing a bigger message is
        # dropped before ZeroMQ allocates it (receivers only send hellos, acks and reports).
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_INBOUND_BYTES)
        _tune(sock, zmq, hwm=2 * self.ring.slots + 8, heartbeat=self.heartbeat)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:
            raise ConfigError(f"{self.url}: cannot bind {self.address}: {exc}") from exc
        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._file = _ipc_file(bound)
        if self._file is not None:
            os.chmod(self._file, 0o600)
        if self._scheme == "zmq+tcp" and self.address.endswith(":0"):
            host = self.url.split("://", 1)[1].rpartition(":")[0]
            self.url = f"zmq+tcp://{host}:{bound.rpartition(':')[2]}"
        self._spawn(self._read_loop())

    def _on_all_joined(self) -> None:
        # Nobody else may join: the rendezvous file has done its job.
        if self._file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file)
            self._file = None

    async def _read_loop(self) -> None:
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            try:
                ready = dict(await poller.poll())
                if self._sock in ready:
                    # Data first: a goodbye precedes the drop it causes.
                    while True:
                        try:
                            parts = await self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        await self._on_message(parts)
                if self._monitor in ready:
                    event = await recv_monitor_message(self._monitor)
                    peer = self._by_fd.pop(int(event["value"]), None)
                    if peer is not None:
                        self._spawn(self._drop_later(peer))
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                self.on_broken(PeerBrokenError(f"{self.url}: socket failed: {exc}"))
                return

    async def _drop_later(self, peer: Peer) -> None:
        await anyio.sleep(_DRAIN_S)
        self._lost(peer, "connection dropped")

    async def _on_message(self, parts: list[Any]) -> None:
        import zmq

        identity = parts[0].bytes
        frame = parts[-1].bytes
        peer = self._by_identity.get(identity)
        if peer is not None:
            if len(parts) == 2:
                self._deliver(peer, frame)
            else:
                self.on_broken(
                    WireFormatError(f"{self.url}: {peer.describe} sent {len(parts)} frames")
                )
            return
        who = f"a receiver at {parts[-1].get('Peer-Address') or self.address}"
        try:
            if len(parts) != 2:
                raise WireFormatError(f"sent {len(parts) - 1} frames as its Hello")
            peer, welcome = self._welcome(frame, who)
        except StreamsyncError as exc:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart([identity, self._refusal(exc)])
            self._refused_by(who, exc)
            return
        peer.handle = identity
        self._by_identity[identity] = peer
        self._by_fd[int(parts[-1].get(zmq.SRCFD))] = peer
        await self._sock.send_multipart([identity, welcome])
        self._joined(peer)

    async def _send_frame(self, peer: Peer, frame: bytes, payload: torch.Tensor | None) -> None:
        import zmq

        parts: list[Any] = [peer.handle, frame]
        if payload is not None:
            parts.append(memoryview(payload.numpy()))  # type: ignore[arg-type]
        try:
            await self._sock.send_multipart(parts, copy=False)
        except zmq.ZMQError as exc:
            raise PeerBrokenError(f"{self.url}: {peer.describe} is unreachable: {exc}") from exc

    async def _stop(self) -> None:
        await _close(self._sock, self._monitor, self._ctx)
        self._sock = self._monitor = self._ctx = None
        self._on_all_joined()  # the socket file, if it is still there
        self._slots = []


class ZmqReceiver(ProcessReceiver):
    """Receiver side of ``zmq+tcp://HOST:PORT`` and ``zmq+ipc://PATH``."""

    def __init__(
        self,
        url: str,
        *,
        secret: bytes | str | None = None,
        connect_timeout: float = 60.0,
        heartbeat: float = 1.0,
    ) -> None:
        from streamsync.transports import parse_endpoint

        super().__init__(url, secret=secret, connect_timeout=connect_timeout)
        endpoint = parse_endpoint(url)
        self.address = zmq_address(endpoint.scheme, endpoint.target, bind=False)
        self.heartbeat = heartbeat
        self._ctx: Any = None
        self._sock: Any = None
        self._monitor: Any = None
        self._poller: Any = None
        self._dropped = False

    async def _connect(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context(io_threads=1)
        sock = self._sock = self._ctx.socket(zmq.DEALER)
        _tune(sock, zmq, hwm=64, heartbeat=self.heartbeat)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        sock.connect(self.address)  # queued until the sender binds
        nonce, hello = self._hello()
        await sock.send(hello)
        frame, _ = await self._recv_frame()
        self._accept(frame, nonce)

    async def _recv_frame(self) -> tuple[bytes, Any]:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            timeout = _DRAIN_S * 1000 if self._dropped else None
            ready = dict(await self._poller.poll(timeout))
            if self._sock in ready:
                parts = await self._sock.recv_multipart(copy=False)
                if len(parts) not in (1, 2):
                    raise WireFormatError(f"{self.url}: sender sent {len(parts)} frames")
                return parts[0].bytes, parts[1] if len(parts) == 2 else None
            if self._dropped:
                raise LinkLost("connection dropped")
            if self._monitor in ready:
                with contextlib.suppress(zmq.ZMQError):
                    await recv_monitor_message(self._monitor)
                self._dropped = True  # drain what is already here, then report

    def _bucket_data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        if payload is None:
            raise WireFormatError(f"{self.url}: bucket {header.seq} arrived without its bytes")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only frames: we never write
            data = torch.frombuffer(payload.buffer, dtype=torch.uint8)
        if data.numel() != header.nbytes:
            raise WireFormatError(
                f"{self.url}: bucket {header.seq} has {data.numel()} bytes; its header says "
                f"{header.nbytes}"
            )
        if data.data_ptr() % 8:
            data = data.clone()  # views of 8-byte dtypes need 8-byte alignment
        return data

    async def _send_frame(self, frame: bytes) -> None:
        import zmq

        try:
            await self._sock.send(frame)
        except zmq.ZMQError as exc:
            raise PeerBrokenError(f"{self.url}: cannot reach the sender: {exc}") from exc

    async def _stop(self) -> None:
        await _close(self._sock, self._monitor, self._ctx)
        self._sock = self._monitor = self._ctx = None


async def _close(sock: Any, monitor: Any, ctx: Any) -> None:
    """Close a socket, its disconnect monitor and their context (either side's)."""
    if sock is not None:
        with contextlib.suppress(Exception):
            sock.disable_monitor()
        if monitor is not None:
            monitor.close(linger=0)
        sock.close()  # lingers up to 1 s for a goodbye still queued
    if ctx is not None:
        await anyio.to_thread.run_sync(ctx.term)


def sender_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> ZmqSender:
    """``zmq+tcp://HOST:PORT?receivers=&slots=&slot_bytes=`` or ``zmq+ipc://PATH?...``."""
    return ZmqSender(f"{endpoint.scheme}://{endpoint.target}", **endpoint.sender_options(kwargs))


def receiver_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> ZmqReceiver:
    """``zmq+tcp://HOST:PORT`` or ``zmq+ipc://PATH``."""
    return ZmqReceiver(f"{endpoint.scheme}://{endpoint.target}", **kwargs)
