"""``torch+gloo://HOST:PORT`` and ``torch+nccl://HOST:PORT``: each bucket broadcast once to
every receiver in a private ``torch.distributed`` process group.

The ring is the linked transports' (:mod:`streamsync.transports.linked`): handshake,
headers, acks and reports travel over a ZeroMQ link; only a bucket's bytes take the group,
one ``broadcast`` from the sender's slot into the same slot of every receiver. A 12-byte
marker (slot, size) follows each header, so each receiver's link reader joins the broadcasts
in the order the sender publishes them while its sink loads earlier slots.

Rendezvous: the sender hosts a ``TCPStore`` at HOST:PORT (port 0 picks one; the sender's
``url`` then names it) and writes its link's port there. The ``Welcome`` names the group (a
random key prefix in the store, its size); the sender is rank 0, receiver ``i`` rank
``i + 1``. The group (:mod:`streamsync.transports.torch_group`) forms on the first bucket.
Nothing is pickled: the store holds bytes only.

Failures: every broadcast has the sync's timeout, and a receiver's death seen on the link
ends the sender's wait at once. A failed or timed-out broadcast leaves the group out of
step, so the channel is broken (:class:`~streamsync.PeerBrokenError` or
:class:`~streamsync.SyncTimeoutError`): a group has a fixed size, and a receiver that
restarts needs a new sender.

``torch+nccl`` keeps the ring on the GPU (``device=``, default the current one). The store
and the link listen on HOST only (127.0.0.1 by default, ``*`` for every interface); gloo
connects over the interface that reaches HOST (``GLOO_SOCKET_IFNAME`` overrides it). The
broadcast bytes are neither encrypted nor authenticated, as ``zmq+tcp`` payloads.

Options: every transport's, ``heartbeat`` (the link's keepalive) and ``device``.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import torch

from streamsync.errors import (
    ConfigError,
    PeerBrokenError,
    StreamsyncError,
    SyncTimeoutError,
    WireFormatError,
)
from streamsync.transports import Endpoint, Transport
from streamsync.transports.link import LinkLost, NotThere, Peer
from streamsync.transports.linked import LinkedReceiver, LinkedSender
from streamsync.transports.options import DEVICE, HEARTBEAT, RECEIVER_OPTIONS, SENDER_OPTIONS
from streamsync.transports.places import cuda_device, host_port, told_host
from streamsync.transports.slots import Shared, SlotStore, SlotView
from streamsync.transports.torch_group import (
    GroupPlan,
    ProcessGroupMember,
    as_timedelta,
    local_address,
)
from streamsync.transports.zeromq import ZmqDialer, ZmqLink, file_id
from streamsync.wire.frames import Abort, BucketHeader, Bye, End, Welcome
from streamsync.wire.slot import allocate_slot

#: Where the sender writes its link's port in the store.
_CONTROL_KEY = "streamsync/control-port"
#: The marker that follows a bucket's header: slot and size of the coming broadcast.
_MARKER = struct.Struct("<IQ")
#: Longest wait for a stuck broadcast to give up its group when a channel closes.
_CLOSE_S = 1.0
#: How long one of a receiver's tries waits for the sender's store to answer.
_STORE_TRY_S = 4.0
#: Seconds a sender's store gets to open (its own client connects to it) however short the
#: sync's timeout.
OPEN_STORE_S = 30.0


BACKENDS = {"torch+gloo": "gloo", "torch+nccl": "nccl"}


async def _in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a worker thread; cancelling the caller abandons the thread (every blocking
    call here carries its own timeout, so the thread ends by itself)."""
    return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)


# -- sender -------------------------------------------------------------------------------
class GroupSlots(SlotStore):
    """Sender side: the slots (host memory for gloo, one device ring for nccl); a joining
    receiver is told the group's plan."""

    payload_frames = True  # a marker, not the bytes, follows each header (see GroupSender)

    def __init__(self, slots: int, slot_bytes: int, member: ProcessGroupMember) -> None:
        super().__init__(slots, slot_bytes)
        self.member = member

    def open(self) -> None:
        self._bufs = _allocate(self.slots, self.slot_bytes, self.member.device)

    def shared(self) -> Shared:
        assert self.member.plan is not None
        return Shared(layout=msgspec.msgpack.encode(self.member.plan))


def _listen(url: str, host: str, port: int) -> socket.socket:
    """A listening TCP socket on HOST:PORT for the rendezvous store (``*``: every interface)."""
    address = "" if host in ("*", "0.0.0.0") else host
    try:
        family = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"{url}: cannot listen on {host}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{url}: port {port} is taken; is another sender there?") from None
        raise ConfigError(f"{url}: cannot listen on {host}:{port}: {exc}") from None
    return sock


def _allocate(slots: int, slot_bytes: int, device: torch.device) -> list[torch.Tensor]:
    if device.type == "cpu":
        bufs = [allocate_slot(slot_bytes) for _ in range(slots)]
        for buf in bufs:
            buf.zero_()  # fault the pages in now, not during the first sync
        return bufs
    ring = torch.zeros(slots * slot_bytes, dtype=torch.uint8, device=device)
    return list(ring.view(slots, slot_bytes).unbind(0))


class GroupLink(ZmqLink):
    """Sender end: the rendezvous store at HOST:PORT, and the ring's frames over a ZeroMQ
    link on HOST whose port is written to the store."""

    def __init__(
        self, endpoint: Endpoint, member: ProcessGroupMember, *, timeout: float, **link: Any
    ) -> None:
        self.scheme = endpoint.scheme
        self.host, self.port = host_port(endpoint.scheme, endpoint.target, bind=True)
        super().__init__("zmq+tcp", f"{self.host}:0", **link)
        self.url = endpoint.url
        self.member = member
        self.timeout = timeout

    async def open(self) -> None:
        from torch._C._distributed_c10d import TCPStore

        # The store listens on a socket bound here, on HOST only (TCPStore itself would
        # listen on every interface).
        listener = _listen(self.url, self.host, self.port)
        self.port = listener.getsockname()[1]
        fd = listener.detach()
        ours = file_id(fd)
        host = "127.0.0.1" if self.host in ("*", "0.0.0.0") else self.host

        def serve_store() -> Any:
            # The master's own client connects to the server it starts: setup, not a wait
            # for a peer, so it gets at least OPEN_STORE_S (a loaded machine can take more
            # than a short sync timeout); then the store waits as long as the sync would.
            store = TCPStore(
                host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=as_timedelta(max(self.timeout, OPEN_STORE_S)),
                master_listen_fd=fd,
            )
            store.set_timeout(as_timedelta(self.timeout))
            return store

        try:
            store = await _in_thread(serve_store)
        except BaseException as exc:
            if file_id(fd) == ours:  # else the store closed it already
                os.close(fd)
            if isinstance(exc, RuntimeError):  # DistNetworkError, DistStoreError
                raise PeerBrokenError(
                    f"{self.url}: could not open its rendezvous store on {host}:{self.port} ({exc})"
                ) from None
            raise
        self.member.store = store
        self.port = int(store.port)
        self.member.local_host = self.host
        await super().open()  # names the link's own port in self.url
        control_port = self.url.rpartition(":")[2]
        told = told_host(self.host)  # a wildcard: the host receivers can reach
        self.url = self.member.url = f"{self.scheme}://{told}:{self.port}"
        await _in_thread(lambda: store.set(_CONTROL_KEY, control_port.encode()))


@dataclass
class _Broadcast:
    sync_id: int
    nbytes: int
    deadline: float
    done: bool = False
    error: BaseException | None = None


class GroupSender(LinkedSender):
    """The ring over a :class:`GroupLink`: headers over the link, each bucket's bytes in
    one broadcast of its slot."""

    def __init__(self, link: GroupLink, store: GroupSlots, **kwargs: Any) -> None:
        if kwargs.get("require_all") is False:
            raise ConfigError(
                f"{link.url}: require_all=False; a process group has a fixed size, so every "
                "receiver takes part in every broadcast (use zmq+tcp:// to go on without one)"
            )
        super().__init__(link, store, **kwargs)
        self.member = store.member
        self.member.rank = 0
        self.member.plan = GroupPlan(
            self.member.backend, f"streamsync/{os.urandom(8).hex()}/", self.receivers + 1
        )
        self._marker = torch.zeros(_MARKER.size, dtype=torch.uint8)
        self._pending: _Broadcast | None = None

    def count(self, who: str, group: int, team: str = "") -> StreamsyncError | None:
        learning = self.receivers == 0
        if self._learning and not learning and team not in self._teams:
            return ConfigError(
                f"{self.url}: {who} is of another team than the receivers counted; a "
                "process group has a fixed size (use zmq+tcp:// for several engines)"
            )
        refused = super().count(who, group, team)
        if learning and refused is None:  # the group's size, told in every Welcome
            plan = self.member.plan
            assert plan is not None
            self.member.plan = GroupPlan(plan.backend, plan.prefix, self.receivers + 1)
        return refused

    async def _post_all(
        self, msg: BucketHeader | End | Abort | Bye, payload: torch.Tensor | None
    ) -> None:
        # One broadcast in flight at a time: the next bucket is packed while it runs (its
        # slot is not reused before every receiver acked it, hence after it completed).
        await self._settle(quiet=isinstance(msg, Abort | Bye))
        if not isinstance(msg, BucketHeader) or payload is None:
            await super()._post_all(msg, None)
            return
        self._marker = torch.frombuffer(
            bytearray(_MARKER.pack(msg.slot, msg.nbytes)), dtype=torch.uint8
        )
        await super()._post_all(msg, payload)
        self._launch(msg.sync_id, payload)

    async def _send_frame(self, peer: Peer, frame: bytes, payload: torch.Tensor | None) -> None:
        # The header goes with the marker; the bytes go once, by broadcast.
        await self.link.send(peer, frame, self._marker if payload is not None else None)

    def _launch(self, sync_id: int, data: torch.Tensor) -> None:
        timeout = 60.0 if self._sync is None else self._sync.timeout
        # The group forms on the first bucket, within the sync's timeout too: every
        # receiver is on the link by then.
        form = 0.0 if self.member.formed else timeout
        pending = _Broadcast(sync_id, data.numel(), time.monotonic() + timeout + form + 1.0)
        self._pending = pending
        packed = self.member.ready_event()  # nccl: the slot's packing, queued on this stream

        async def run() -> None:
            try:
                await _in_thread(
                    lambda: self.member.broadcast(data, timeout, form_timeout=form, after=packed)
                )
            except Exception as exc:
                pending.error = exc
            pending.done = True
            self._signal.notify()

        self._tasks.start_soon(run)

    async def _settle(self, *, quiet: bool = False) -> None:
        """Wait for the broadcast in flight; a failed one breaks the channel (``quiet``:
        without raising, for an abort or a goodbye)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            # A receiver's death seen on the link ends the wait before the broadcast's own
            # timeout does.
            await self._signal.wait_until(
                lambda: pending.done or self._broken is not None,
                timeout=max(0.0, pending.deadline - time.monotonic()),
                what=f"the broadcast of {pending.nbytes} bytes",
            )
        except SyncTimeoutError as exc:
            pending.error = exc
        if pending.done and pending.error is None:
            return
        # The group is out of step now (or its thread still runs): no later broadcast.
        self.member.poison()
        error = pending.error
        await self._hear(
            lambda: (
                (sync := self._sync) is not None
                and (
                    sync.lost is not None
                    or bool(sync.absent)
                    or (sync.failed is not None and not self._failed_as_consequence())
                )
            )
        )
        if not isinstance(error, StreamsyncError):
            error = PeerBrokenError(
                f"{self.url}: a receiver left during a broadcast; open a new channel"
            )
        # The receivers still there would wait out their timeout for a bucket that never
        # comes: they hear now that this sync is over (a dead one's link just fails).
        if quiet:
            self.on_broken(error)
            return
        abort = Abort(pending.sync_id, f"{type(error).__name__}: {error}")
        for peer in list(self.peers.values()):
            if peer.codec is not None and not peer.said_bye:
                await self._tell(peer, peer.codec.encode(abort), within=0.5)
        try:
            self._check()  # what a receiver said, if it said why
        finally:
            self.on_broken(error)
        self._check()

    async def _shutdown(self) -> None:
        await super()._shutdown()
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_S):
            await _in_thread(self.member.close)


def _sender(endpoint: Endpoint, opts: dict[str, Any]) -> GroupSender:
    member = _member(endpoint, opts.pop("device"))
    link = GroupLink(
        endpoint,
        member,
        hwm=2 * opts["slots"] + 8,
        heartbeat=opts.pop("heartbeat"),
        timeout=opts["connect_timeout"],
    )
    store = GroupSlots(opts.pop("slots"), opts.pop("slot_bytes"), member)
    return GroupSender(link, store, **opts)


def _member(endpoint: Endpoint, device: Any) -> ProcessGroupMember:
    """This side's seat in the channel's group, on the device its backend sends from."""
    import torch.distributed as dist

    backend = BACKENDS[endpoint.scheme]
    if backend == "gloo":
        if device is not None and torch.device(device).type != "cpu":
            raise ConfigError(f"{endpoint.scheme}: device={device}; gloo sends from host memory")
        return ProcessGroupMember(endpoint.url, backend)
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise ConfigError(
            f"{endpoint.url}: NCCL needs CUDA and a torch built with NCCL in this process; "
            "use torch+gloo:// instead"
        )
    device = cuda_device(endpoint.url, device, instead="torch+gloo://")
    return ProcessGroupMember(endpoint.url, backend, device=device)


# -- receiver ------------------------------------------------------------------------------
class GroupView(SlotView):
    """Receiver side: this rank's own slots, into which the link reader broadcasts."""

    def __init__(self, member: ProcessGroupMember) -> None:
        self.member = member
        self.slots: list[torch.Tensor] = []
        self._released: dict[int, Any] = {}

    def attach(self, welcome: Welcome, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        try:
            plan = msgspec.msgpack.decode(welcome.layout, type=GroupPlan)
        except msgspec.DecodeError as exc:
            raise WireFormatError(f"the Welcome names no process group: {exc}") from None
        if plan.backend != self.member.backend:
            raise ConfigError(
                f"the sender broadcasts with {plan.backend}, this receiver joined with "
                f"{self.member.backend}; use torch+{plan.backend}://"
            )
        if not 0 <= welcome.index < plan.world_size - 1:
            raise WireFormatError(f"receiver index {welcome.index} in a group of {plan.world_size}")
        self.member.plan = plan
        self.member.rank = welcome.index + 1
        self.slots = _allocate(welcome.slots, welcome.slot_bytes, self.member.device)

    def release(self, header: BucketHeader) -> None:
        # nccl: the next broadcast into this slot waits until the sink's copies are done.
        self._released[header.slot] = self.member.ready_event()

    def data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        raise WireFormatError(f"bucket {header.seq}: its bytes come by broadcast (see fill)")

    async def fill(self, header: BucketHeader, payload: Any, *, timeout: float) -> torch.Tensor:
        """Take part in the broadcast the header's marker announces, into the slot it
        names (after the sink's last use of that slot). It is given twice the sync's
        ``timeout``: a sender gone silent is then reported by the receive's own timeout
        (``SyncTimeoutError``), which fires first, not as a broken group."""
        if not isinstance(payload, tuple):
            raise WireFormatError(f"bucket {header.seq} arrived without its broadcast marker")
        slot, nbytes = payload
        if slot != header.slot or nbytes != header.nbytes:
            raise WireFormatError(
                f"bucket {header.seq} is {header.nbytes} bytes in slot {header.slot}; its "
                f"broadcast is {nbytes} bytes into slot {slot}"
            )
        if not 0 <= slot < len(self.slots) or not 0 <= nbytes <= self.slots[slot].numel():
            raise WireFormatError(
                f"a broadcast of {nbytes} bytes into slot {slot}; the ring has "
                f"{len(self.slots)} slots of {self.slots[0].numel() if self.slots else 0}"
            )
        data = self.slots[slot][:nbytes]
        released = self._released.pop(slot, None)  # the sink's last use of the slot
        limit = 2 * timeout
        try:
            await _in_thread(
                lambda: self.member.broadcast(data, limit, form_timeout=limit, after=released)
            )
        except StreamsyncError as exc:
            raise LinkLost(str(exc)) from None
        return data

    def close(self) -> None:
        self.slots = []
        self._released = {}


class GroupDialer(ZmqDialer):
    """Receiver end: reads the link's port from the store and joins the link; each
    header's marker names the slot its broadcast fills (:meth:`GroupView.fill`)."""

    def __init__(
        self, endpoint: Endpoint, member: ProcessGroupMember, *, heartbeat: float, timeout: float
    ) -> None:
        super().__init__("zmq+tcp", endpoint.target, heartbeat=heartbeat)
        self.url = endpoint.url
        self.host, self.port = host_port(endpoint.scheme, endpoint.target, bind=False)
        self.member = member
        self.timeout = timeout

    async def connect(self) -> None:
        """One try at the store (the receiver paces its tries, :class:`~.link.Tries`)."""
        from torch._C._distributed_c10d import TCPStore

        def rendezvous() -> tuple[Any, bytes]:
            store = TCPStore(
                self.host, self.port, is_master=False, timeout=as_timedelta(_STORE_TRY_S)
            )
            port = store.get(_CONTROL_KEY)
            store.set_timeout(as_timedelta(self.timeout))  # the group forms through it
            return store, port

        try:
            store, port = await _in_thread(rendezvous)
        except (RuntimeError, OSError) as exc:
            raise NotThere(str(exc)) from None
        self.member.store = store
        self.member.url = self.url
        self.member.local_host = local_address(self.host, self.port)
        self.address = f"tcp://{self.host}:{port.decode()}"
        await super().connect()

    async def receive(self) -> tuple[bytes, Any]:
        frame, marker = await super().receive()
        if marker is None:
            return frame, None
        if len(marker) != _MARKER.size:
            raise WireFormatError(f"{self.url}: a bucket marker of {len(marker)} bytes")
        return frame, _MARKER.unpack(bytes(marker))  # (slot, nbytes): the view's to fill

    async def aclose(self) -> None:
        await super().aclose()
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_S):
            await _in_thread(self.member.close)


def _receiver(endpoint: Endpoint, opts: dict[str, Any]) -> LinkedReceiver:
    member = _member(endpoint, opts.pop("device"))
    link = GroupDialer(
        endpoint, member, heartbeat=opts.pop("heartbeat"), timeout=opts["connect_timeout"]
    )
    return LinkedReceiver(link, GroupView(member), **opts)


#: ``torch+gloo://HOST:PORT`` and ``torch+nccl://HOST:PORT``: the entry points' object.
#: Both sides take ``heartbeat`` (the zmq control link) and ``device`` (NCCL: the GPU,
#: default the current one; gloo: host memory only).
TRANSPORT = Transport(
    _sender,
    _receiver,
    sender_options=(*SENDER_OPTIONS, HEARTBEAT, DEVICE),
    receiver_options=(*RECEIVER_OPTIONS, HEARTBEAT, DEVICE),
)
