"""``zmq+tcp://HOST:PORT`` and ``zmq+ipc://PATH``: the slot ring over ZeroMQ, across machines.

:class:`~streamsync.transports.slots.HostSlots` with a ZeroMQ link: a ROUTER on the sender
(binds; fan-out by identity) and a DEALER per receiver, plain pyzmq sockets woken by anyio
on their ``zmq.FD``. A bucket goes as a header frame and the slot's bytes, uncopied; the
slot is reused once every receiver acked it. Socket monitors see a dead peer: at once for a
killed process, over tcp by keepalive probes for a vanished machine (no ZeroMQ heartbeats:
see :func:`_open`); a frozen peer is what every wait's ``timeout`` is for.

Security: tcp binds 127.0.0.1 unless HOST says otherwise (``*``: every interface); a secret
authenticates every message by HMAC (payloads are not encrypted). An ipc socket file is 0600
and removed when its sender closes; a bare name lives in a 0700 per-user directory,
``@name`` is abstract. Whatever a stranger sends (random bytes, malformed frames, a wrong
secret) is refused at the handshake and logged, and never ends the channel. ZeroMQ itself
drops a peer whose greeting is not ZMTP or whose message exceeds ``MAXMSGSIZE``.

Options: every transport's, and ``heartbeat`` on both sides (seconds, whole and at least 1
on the wire: a tcp connection silent that long is probed, and dropped after 3 unanswered
probes). Port 0 binds a free port; the sender's ``url`` then names it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from streamsync._log import log
from streamsync.errors import ConfigError, PeerBrokenError, WireFormatError
from streamsync.transports import Endpoint, Transport
from streamsync.transports.link import (
    LAST_WORD_S,
    MAX_FRAME_BYTES,
    RETRY_MAX_S,
    RETRY_MIN_S,
    Fds,
    LinkEvents,
    LinkLost,
    Peer,
    ReceiverLink,
    SenderLink,
    map_exceptions,
)
from streamsync.transports.linked import LinkedReceiver, LinkedSender
from streamsync.transports.options import HEARTBEAT, RECEIVER_OPTIONS, SENDER_OPTIONS
from streamsync.transports.places import host_port, told_host
from streamsync.transports.slots import HostSlots, PayloadView

# Longest sleep on a socket's FD: bounds the cost of an edge another call consumed, and how
# often a receiver looks at its disconnect monitor.
_POLL_S = 0.05


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
        host, port = host_port(scheme, target, bind=bind)
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


def _open(
    kind: int, *, hwm: int, heartbeat: float, events: int | None = None
) -> tuple[Any, _Socket, _Socket]:
    """A ZeroMQ context, a tuned socket of ``kind`` in it, and its disconnect monitor.

    No ZeroMQ heartbeats: libzmq 4.3.5 (pyzmq 27) aborts the process when a heartbeat
    timer fires on a connection whose peer hung up while its inbound pipe was full or gone
    (``out_event`` asserts ``!_io_error``, src/stream_engine_base.cpp:310;
    zeromq/libzmq#3937, #4364, #4767). A stranger claiming a taken routing id sets that up
    on a sender (``tests/test_strangers.py``), a receiver closing as its sender says
    goodbye on a receiver (``tests/test_one_shot_loops.py``). TCP keepalive, in the
    kernel, finds a vanished machine instead: probes after ``heartbeat`` seconds of silence,
    every ``heartbeat`` seconds, 3 unanswered drop the connection, which the monitor
    reports. Over ipc a dead process's socket closes at once.
    """
    import zmq

    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    seconds = max(1, round(heartbeat))
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, seconds)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, seconds)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.LINGER, 1000)
    watched = zmq.EVENT_DISCONNECTED if events is None else events
    return ctx, _Socket(sock), _Socket(sock.get_monitor_socket(watched))


class _Socket:
    """A plain zmq socket driven by anyio: non-blocking calls, and waits on its
    edge-triggered ``zmq.FD`` that re-check ``zmq.EVENTS`` before sleeping (and after any
    send, which may have consumed the edge, by waking the sleeper)."""

    def __init__(self, sock: Any) -> None:
        import zmq

        self.zmq = zmq
        self.sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)
        self._sleep: anyio.CancelScope | None = None

    def _ready(self) -> bool:
        return bool(self.sock.getsockopt(self.zmq.EVENTS) & self.zmq.POLLIN)

    def try_recv(self) -> list[Any] | None:
        try:
            return list(self.sock.recv_multipart(self.zmq.NOBLOCK, copy=False))
        except self.zmq.Again:
            return None

    async def wait(self) -> None:
        """Until the socket may have a message (or ``_POLL_S`` passed)."""
        if self._ready():
            await anyio.sleep(0)
            return
        with anyio.move_on_after(_POLL_S) as scope:
            self._sleep = scope
            await anyio.wait_readable(self._fd)
        self._sleep = None

    async def recv(self) -> list[Any]:
        while (parts := self.try_recv()) is None:
            await self.wait()
        return parts

    async def send(self, parts: list[Any]) -> None:
        while True:
            try:
                self.sock.send_multipart(parts, self.zmq.NOBLOCK, copy=False)
                break
            except self.zmq.Again:  # the peer's high-water mark (rare: the ring bounds it)
                await anyio.sleep(0.001)
        if self._sleep is not None and self._ready():
            self._sleep.cancel()


def _peer_address(frame: Any) -> str | None:
    return str(_metadata(frame, "Peer-Address") or "") or None


def _metadata(frame: Any, key: Any) -> Any:
    import zmq

    try:
        return frame.get(key)
    except zmq.ZMQError:  # EINVAL: a message without metadata (a ZMTP 1.0 peer's)
        return None


def file_id(where: int | str) -> tuple[int, int] | None:
    """Which file a descriptor or path is now (a closed descriptor's number is soon
    reused); ``None``: none."""
    try:
        st = os.stat(where)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _refuse_if_served(url: str, path: str) -> None:
    """Raise ``ConfigError`` if a sender listens on the unix socket file ``path`` (a file
    that refuses connections is a dead sender's, for the new one to replace)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)  # a full backlog: someone serves it
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError, PermissionError):
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise ConfigError(f"{url} already has a sender (listening on {path})")


class ZmqLink(SenderLink):
    """Sender end: one ROUTER socket and its disconnect monitor."""

    def __init__(self, scheme: str, target: str, *, hwm: int, heartbeat: float) -> None:
        self.url = f"{scheme}://{target}"
        self._scheme, self._target = scheme, target
        self.address = zmq_address(scheme, target, bind=True)
        self.hwm = hwm
        self.heartbeat = heartbeat
        self._ctx: Any = None
        self._sock: _Socket | None = None
        self._monitor: _Socket | None = None
        self._peers: dict[bytes, Peer] = {}
        # Joined receivers by their connection's descriptor (the latest on each), and each
        # one's descriptor and which socket it was (see _drop_later).
        self._by_fd: dict[int, Peer] = {}
        self._sockets: dict[bytes, tuple[int, tuple[int, int] | None]] = {}
        self._file: str | None = None
        self._bound_id: tuple[int, int] | None = None

    async def open(self) -> None:
        import zmq

        self._ctx, self._sock, self._monitor = _open(
            zmq.ROUTER, hwm=self.hwm, heartbeat=self.heartbeat
        )
        sock = self._sock.sock
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable receiver raises
        # Anyone who can reach the port can send: a peer announcing a bigger message is
        # dropped before ZeroMQ allocates it (receivers only send hellos, acks and reports).
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        path = self.address.removeprefix("ipc://")
        if self.address.startswith("ipc://") and not path.startswith("@"):
            # ZeroMQ binds an ipc path by removing whatever file is there: a live sender's
            # socket would be taken over, its sender orphaned.
            _refuse_if_served(self.url, path)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:
            raise ConfigError(f"{self.url}: cannot bind {self.address}: {exc}") from exc
        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        if bound.startswith("ipc://") and not bound.startswith("ipc://@"):
            self._file = bound.removeprefix("ipc://")
            os.chmod(self._file, 0o600)
            self._bound_id = file_id(self._file)
        if self._scheme == "zmq+tcp":
            # The port bound (for :0) on the host receivers can reach (for a wildcard).
            host = told_host(self._target.rpartition(":")[0])
            self.url = f"zmq+tcp://{host}:{bound.rpartition(':')[2]}"

    async def serve(self, events: LinkEvents) -> None:
        import zmq

        assert self._sock is not None
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch, events, group)
            while True:
                try:
                    parts = await self._sock.recv()
                except zmq.ZMQError as exc:  # the socket itself, not what a peer sent
                    events.on_broken(PeerBrokenError(f"{self.url}: socket failed: {exc}"))
                    group.cancel_scope.cancel()
                    return
                try:
                    await self._on_message(parts, events, group)
                except Exception as exc:
                    # Whatever one message does, the channel goes on: it was a stranger's
                    # (a peer's own failures are handled in on_frame).
                    log(
                        "channel.stranger",
                        url=self.url,
                        peer=_peer_address(parts[-1]) or self.address,
                        error=f"{type(exc).__name__}: {exc}",
                    )

    async def _watch(self, events: LinkEvents, group: TaskGroup) -> None:
        from zmq.utils.monitor import parse_monitor_message

        assert self._monitor is not None
        while True:
            parts = await self._monitor.recv()
            event = parse_monitor_message([p.bytes for p in parts])
            peer = self._by_fd.get(int(event["value"]))
            if peer is not None:
                group.start_soon(self._drop_later, peer, events)

    async def _drop_later(self, peer: Peer, events: LinkEvents) -> None:
        await anyio.sleep(LAST_WORD_S)  # a goodbye precedes the drop it causes
        if self._peers.get(peer.handle) is not peer:
            return
        fd, socket_id = self._sockets[peer.handle]
        # ZeroMQ closes a dropped connection's socket right after reporting it: one still
        # open (given a moment more) means the drop reported was of an earlier connection
        # with this descriptor (a stranger's, say), read after the receiver reused it.
        for _ in range(5):
            if socket_id is None or file_id(fd) != socket_id:
                break
            await anyio.sleep(LAST_WORD_S)
        else:
            return
        if self._peers.get(peer.handle) is not peer:
            return
        self._forget(peer.handle)
        events.on_lost(peer, "connection dropped")

    def _forget(self, identity: bytes) -> None:
        peer = self._peers.pop(identity, None)
        self._sockets.pop(identity, None)
        for fd in [fd for fd, p in self._by_fd.items() if p is peer]:
            del self._by_fd[fd]

    async def _on_message(self, parts: list[Any], events: LinkEvents, group: TaskGroup) -> None:
        import zmq

        identity, frame = parts[0].bytes, parts[-1].bytes
        peer = self._peers.get(identity)
        if peer is not None:
            if len(parts) != 2:
                events.on_lost(peer, f"it sent {len(parts)} frames")
                keep = False
            else:
                keep = await events.on_frame(peer, frame)
            if not keep:  # it left, or must: what else comes from it is a stranger's
                self._forget(identity)
            return
        peer = Peer(f"a receiver at {_peer_address(parts[-1]) or self.address}", identity)
        fd = _metadata(parts[-1], zmq.SRCFD)  # the descriptor of its connection
        if fd is None:
            # Only a ZMTP 3 peer's messages carry metadata (random bytes on the port read as
            # ZMTP 1.0 messages): without its descriptor the peer could not be watched.
            exc = WireFormatError("does not speak ZMTP 3 (its message has no metadata)")
            await events.on_refused(peer, exc)
        elif len(parts) != 2:
            exc = WireFormatError(f"sent {len(parts) - 1} frames as its Hello")
            await events.on_refused(peer, exc)
        elif await events.on_frame(peer, frame):
            self._peers[identity] = peer
            fd = int(fd)
            self._sockets[identity] = (fd, file_id(fd))
            earlier = self._by_fd.get(fd)
            self._by_fd[fd] = peer
            if earlier is not None:
                # Its descriptor was reused: its connection is gone, even if the monitor has
                # not said so yet (or said so while this one was registered).
                group.start_soon(self._drop_later, earlier, events)

    async def send(
        self, peer: Peer, frame: bytes, payload: torch.Tensor | None = None, fds: Fds = ()
    ) -> None:
        assert self._sock is not None
        parts: list[Any] = [peer.handle, frame]
        if payload is not None:
            parts.append(memoryview(payload.numpy()))  # type: ignore[arg-type]
        unreachable = f"{self.url}: {peer.describe or peer.who} is unreachable"
        with map_exceptions({self._sock.zmq.ZMQError: PeerBrokenError}, unreachable):
            await self._sock.send(parts)

    async def aclose(self) -> None:
        await _close(self._sock, self._monitor, self._ctx)
        self._sock = self._monitor = self._ctx = None
        # Only the file this sender bound: one another sender made since is not ours.
        if self._file is not None and file_id(self._file) == self._bound_id:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file)
        self._file = None


class ZmqDialer(ReceiverLink):
    """Receiver end: a DEALER socket and a monitor of its connections.

    A DEALER reconnects by itself, so one socket may see several connections: to a
    sender that was closing as it arrived, then to the next sender on the same address.
    The monitor tracks which connection is live (``CONNECTED`` events carry its
    descriptor); the session belongs to the connection its ``Welcome`` came over, and only
    that connection's ``DISCONNECTED`` ends the link: a drop reported for an earlier one is
    not this channel's."""

    def __init__(self, scheme: str, target: str, *, heartbeat: float) -> None:
        self.url = f"{scheme}://{target}"
        self.address = zmq_address(scheme, target, bind=False)
        self.heartbeat = heartbeat
        self._ctx: Any = None
        self._sock: _Socket | None = None
        self._monitor: _Socket | None = None
        self._dropped_at: float | None = None
        #: The descriptor of the live connection, and of the session's (once joined).
        self._live: int | None = None
        self._session: int | None = None
        #: A connection came up after the drop ``_dropped_at`` records.
        self._reconnected = False

    async def connect(self) -> None:
        import zmq

        self._dropped_at = None
        self._live = self._session = None
        self._reconnected = False
        self._ctx, self._sock, self._monitor = _open(
            zmq.DEALER,
            hwm=64,
            heartbeat=self.heartbeat,
            events=zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED,
        )
        # ZeroMQ tries again until the sender binds: paced as a linked receiver's own tries
        # (link.Tries), from the shortest pause doubling to the longest, not its 100 ms.
        self._sock.sock.setsockopt(zmq.RECONNECT_IVL, round(RETRY_MIN_S * 1000))
        self._sock.sock.setsockopt(zmq.RECONNECT_IVL_MAX, round(RETRY_MAX_S * 1000))
        self._sock.sock.connect(self.address)  # queued until the sender binds

    async def handshake(self, hello: bytes) -> tuple[bytes, list[int]]:
        await self.send(hello)
        frame, _ = await self.receive()
        self._welcomed()
        return frame, []

    def _welcomed(self) -> None:
        """The Welcome came over the live connection: the session is that one's. A drop
        seen while waiting for it, followed by a new connection, was of an earlier one (the
        monitor reports a connection before anything arrives over it)."""
        self._watch()
        if self._dropped_at is not None and self._reconnected:
            self._dropped_at = None
        self._session = self._live

    def _watch(self) -> None:
        """Read the monitor's events: a drop of the connection that matters (the session's
        once joined, else the live one) starts the link's last word."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        assert self._monitor is not None
        while (event := self._monitor.try_recv()) is not None:
            info = parse_monitor_message([bytes(part) for part in event])
            fd = int(info["value"])
            if info["event"] == zmq.EVENT_CONNECTED:
                self._live = fd
                self._reconnected = self._dropped_at is not None
            elif info["event"] == zmq.EVENT_DISCONNECTED and self._dropped_at is None:
                mine = self._session if self._session is not None else self._live
                if fd == mine or mine is None:
                    self._dropped_at = anyio.current_time()
                    self._reconnected = False

    async def send(self, frame: bytes) -> None:
        assert self._sock is not None
        errors = {self._sock.zmq.ZMQError: PeerBrokenError}
        with map_exceptions(errors, f"{self.url}: cannot reach the sender"):
            await self._sock.send([frame])

    async def receive(self) -> tuple[bytes, Any]:
        assert self._sock is not None and self._monitor is not None
        while (parts := self._sock.try_recv()) is None:
            if self._dropped_at is None:
                self._watch()  # a drop: drain what is already here, then report
            elif anyio.current_time() - self._dropped_at > LAST_WORD_S:
                raise LinkLost("connection dropped")
            await self._sock.wait()
        if len(parts) not in (1, 2):
            raise WireFormatError(f"{self.url}: sender sent {len(parts)} frames")
        return parts[0].bytes, parts[1].buffer if len(parts) == 2 else None

    async def aclose(self) -> None:
        await _close(self._sock, self._monitor, self._ctx)
        self._sock = self._monitor = self._ctx = None


async def _close(sock: _Socket | None, monitor: _Socket | None, ctx: Any) -> None:
    """Close a socket, its disconnect monitor and their context (either side's)."""
    if sock is not None:
        with contextlib.suppress(Exception):
            sock.sock.disable_monitor()
        if monitor is not None:
            monitor.sock.close(linger=0)
        sock.sock.close()  # lingers up to 1 s for a goodbye still queued
    if ctx is not None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(ctx.term)


def _sender(endpoint: Endpoint, opts: dict[str, Any]) -> LinkedSender:
    heartbeat = opts.pop("heartbeat")
    link = ZmqLink(endpoint.scheme, endpoint.target, hwm=2 * opts["slots"] + 8, heartbeat=heartbeat)
    return LinkedSender(link, HostSlots(opts.pop("slots"), opts.pop("slot_bytes")), **opts)


def _receiver(endpoint: Endpoint, opts: dict[str, Any]) -> LinkedReceiver:
    link = ZmqDialer(endpoint.scheme, endpoint.target, heartbeat=opts.pop("heartbeat"))
    return LinkedReceiver(link, PayloadView(), **opts)


#: ``zmq+tcp://HOST:PORT`` and ``zmq+ipc://PATH``: the entry points' object. Both sides
#: take ``heartbeat`` too.
TRANSPORT = Transport(
    _sender,
    _receiver,
    sender_options=(*SENDER_OPTIONS, HEARTBEAT),
    receiver_options=(*RECEIVER_OPTIONS, HEARTBEAT),
)
