"""The processes of ``test_strangers.py``: the channel's one legitimate receiver, and a
round of strangers that reach the sender's address one after another. They report plain
dicts (never tensors) to the test.

Every stranger is bounded: sockets have timeouts, ZeroMQ sockets linger a bounded time, and
a stranger never waits for the sender to answer beyond that (it may well never answer).
The strangers' own ZeroMQ sockets do not heartbeat, so nothing in this process runs the
heartbeat timer that libzmq 4.3.5 may abort on (see ``zeromq._open``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
import time
from typing import Any

import torch
from fault_peers import built_with
from loop_peers import Keep, digest

import streamsync as ss
from streamsync.transports import open_receiver
from streamsync.transports.link import unix_address
from streamsync.transports.zeromq import zmq_address
from streamsync.wire.frames import PROTOCOL_VERSION, WireCodec

#: The channel's secret (the strangers that look like receivers use another one).
SECRET = b"strangers-test"
#: Seconds any one wait may take (generous: the machine may be loaded).
TIMEOUT = 30.0
#: Buckets small enough that a sync is many frames: strangers interleave with them.
BUCKET_BYTES = 64 << 10
#: The strangers that look like receivers: the sender refuses them with an answer.
REFUSED = ("wrong secret", "other version")


def weights(sync: int) -> dict[str, torch.Tensor]:
    """What the sender sends at ``sync``: different every time; the first tensor alone
    fills several buckets (so a sync is under way before the rest is read)."""
    gen = torch.Generator().manual_seed(1000 + sync)
    return {
        "first.weight": torch.randn(256, 256, generator=gen),  # 256 KiB: 4 buckets
        "embed.weight": torch.randn(96, 256, generator=gen).to(torch.bfloat16),
        "layer.bias": torch.full((64,), float(sync)),
        "layer.index": torch.arange(sync, sync + 100, dtype=torch.int64),
    }


def receiver(url: str, syncs: int, results: Any) -> None:
    """The legitimate receiver: joins once, then receives ``syncs`` syncs, each verified."""

    async def run() -> None:
        async with open_receiver(url, secret=SECRET, connect_timeout=TIMEOUT) as rx:
            results.put({"role": "receiver", "joined": True})
            for sync in range(syncs):
                sink = Keep()
                await ss.receive(rx, sink, timeout=2 * TIMEOUT)
                same = digest(sink.tensors) == digest(weights(sync))
                results.put({"role": "receiver", "sync": sync, "verified": same})

    try:
        asyncio.run(run())
    except Exception as exc:
        results.put({"role": "receiver", "error": repr(exc)})


# -- strangers ------------------------------------------------------------------------------
def _raw(transport: str, url: str) -> socket.socket:
    """A plain stream socket connected to the sender's address (no ZeroMQ, no streamsync)."""
    target = url.split("://", 1)[1]
    if transport == "zmq+tcp":
        host, _, port = target.rpartition(":")
        return socket.create_connection((host, int(port)), timeout=TIMEOUT)
    if transport == "zmq+ipc":
        path = zmq_address("zmq+ipc", target, bind=False).removeprefix("ipc://")
        address = "\0" + path[1:] if path.startswith("@") else path
    else:
        address = unix_address("shm", target)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    sock.connect(address)
    return sock


def _write_then_hang_up(transport: str, url: str, data: bytes) -> None:
    """Write ``data``, say we are done, and wait (bounded) for the sender to hang up, so
    that what was written is read (closing with unread data could reset it away)."""
    with contextlib.closing(_raw(transport, url)) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            # The sender hung up first (ZeroMQ drops a peer whose first bytes are no
            # greeting, a reset that can land before our shutdown): it read enough.
            if exc.errno in (errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE):
                return
            raise
        deadline = time.monotonic() + 5.0
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                if not sock.recv(1 << 16):
                    break


def _port_scan(transport: str, url: str) -> None:
    _raw(transport, url).close()  # connect, close
    sock = _raw(transport, url)  # connect, reset
    if transport == "zmq+tcp":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _zmtp_greeting() -> bytes:
    """A ZMTP 3.0 greeting (NULL mechanism) and a READY command for a DEALER."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
    greeting += b"\x00" + bytes(31)
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    return greeting + b"\x04" + bytes([len(body)]) + body


def _huge_length(transport: str, url: str) -> str:
    """Claim a frame far larger than a Hello, send a little of it, and keep the connection
    open: "ok" if the sender hangs up at once, from the claim alone (not waiting out its
    timeout for the rest, nor reading that much)."""
    if transport == "shm":
        # 16 MiB: a frame a receiver may send once joined, but never as its first.
        claim = struct.pack(">I", 16 << 20)
    else:
        claim = _zmtp_greeting() + b"\x02" + struct.pack(">Q", 1 << 40)  # a 1 TiB message
    with contextlib.closing(_raw(transport, url)) as sock:
        sock.sendall(claim + os.urandom(1024))
        sock.settimeout(10.0)
        try:
            while sock.recv(1 << 16):
                pass  # the sender's greeting (zmq)
        except TimeoutError:
            return "still connected after 10 s"
        except OSError:
            pass  # reset: hung up too
    return "ok"


def _framed_garbage(transport: str, url: str) -> None:
    """A same-user process writing well-framed garbage (and an empty frame) to the socket."""
    for payload in (os.urandom(200), b""):
        _write_then_hang_up(transport, url, struct.pack(">I", len(payload)) + payload)


def _zmq_malformed(url: str) -> None:
    """A ZeroMQ DEALER sending a garbage frame, a 3-frame message, an empty frame."""
    import zmq

    address = zmq_address(url.split("://", 1)[0], url.split("://", 1)[1], bind=False)
    for parts in ([os.urandom(100)], [b"a", b"b", os.urandom(50)], [b""]):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)  # delivered if the sender is there; bounded
        try:
            sock.connect(address)
            sock.send_multipart(parts)
        finally:
            sock.close()
            ctx.term()


def _taken_routing_id(url: str) -> None:
    """Two DEALERs claiming one routing id, the second flooding the sender, then hanging up.

    A ROUTER never reads a peer whose routing id is taken: its pipe fills to ``RCVHWM`` and
    libzmq stops reading that connection. A sender that heartbeats would then abort in
    libzmq 4.3.5 once the connection resets (see ``zeromq._open``): this stranger checks
    that it does not (the test's sender process would die).
    """
    import zmq

    address = zmq_address(url.split("://", 1)[0], url.split("://", 1)[1], bind=False)
    ctx = zmq.Context()
    try:
        first, second = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (first, second):
            sock.setsockopt(zmq.ROUTING_ID, b"taken")
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)
        for sock in (first, second):
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(address)
            sock.send(os.urandom(64))  # the first's takes the id: a stranger's frame
            if not monitor.poll(10_000):
                raise TimeoutError("no ZMTP handshake with the sender within 10 s")
            sock.disable_monitor()
            monitor.close()
        for _ in range(200):  # far beyond the sender's RCVHWM; never read
            second.send(os.urandom(1024))
        second.setsockopt(zmq.LINGER, 0)
        second.close()
        first.close()
    finally:
        ctx.destroy(linger=0)


async def _looks_like_a_receiver(url: str, kind: str) -> str:
    """A streamsync receiver the sender must refuse (and say so); what it raised."""
    secret = b"wrong" if kind == "wrong secret" else SECRET
    speaking = {}
    if kind == "other version":
        speaking["codec"] = WireCodec(SECRET, version=PROTOCOL_VERSION + 1)
    try:
        with built_with(url, receiver=speaking):
            rx = open_receiver(url, secret=secret, connect_timeout=TIMEOUT)
        async with rx:
            return "joined"
    except ss.StreamsyncError as exc:
        return type(exc).__name__


def strangers(transport: str, url: str, tag: str, results: Any) -> None:
    """One round: every stranger in turn; reports what each did (or how it failed)."""
    done: dict[str, str] = {}
    try:
        _port_scan(transport, url)
        done["port scan"] = "ok"
        _write_then_hang_up(transport, url, os.urandom(4096))
        done["random bytes"] = "ok"
        done["huge length"] = _huge_length(transport, url)
        if transport == "shm":
            _framed_garbage(transport, url)
            done["framed garbage"] = "ok"
        else:
            _zmq_malformed(url)
            done["malformed zmq"] = "ok"
            _taken_routing_id(url)
            done["taken routing id"] = "ok"
        for kind in REFUSED:
            done[kind] = asyncio.run(_looks_like_a_receiver(url, kind))
    except Exception as exc:
        results.put({"role": "strangers", "tag": tag, "done": done, "error": repr(exc)})
        return
    results.put({"role": "strangers", "tag": tag, "done": done, "pid": os.getpid()})
