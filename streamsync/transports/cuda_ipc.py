"""``cuda-ipc://NAME``: a ring of CUDA buffers shared between processes on one machine.

The sender allocates and exports one device buffer holding every slot, once; the handle's
fields travel as a msgspec struct in the authenticated ``Welcome`` (never pickle), and each
receiver rebuilds it on its local index of the same physical device (matched by UUID). A
receiver's stream waits on the slot's interprocess event before reading it and acks only
after its sink's copies completed: CUDA events, never a device-wide synchronise. Messages
ride the unix link of ``shm://``. Options: every transport's, and ``device`` (the sender's
GPU, default the current one).

A receiver in the sender's own process uses the sender's ring as it is: CUDA opens no
handle in the process that exported it.

Files in ``/dev/shm``: torch and the driver keep the ring's reference count
(``torch_<pid>_*``) and its events (``cuda.shm.*.<pid in hex>.*``) there, and a sender
killed outright cannot remove them: a receiver that finds the sender's process gone when
it closes does. The driver never removes its event files, even at a normal exit, so a
process that opened a ``cuda-ipc://`` side removes its own as it exits (multiprocessing's
exit hook, which also runs in its children, which end with ``os._exit``).
"""

# torch's CUDA IPC helpers are untyped.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import contextlib
import glob
import os
import select
from multiprocessing import util
from typing import Any

import msgspec
import torch

from streamsync._log import log
from streamsync.errors import ConfigError, WireFormatError
from streamsync.transports import Endpoint, Transport
from streamsync.transports.link import UnixDialer, UnixLink
from streamsync.transports.linked import LinkedReceiver, LinkedSender
from streamsync.transports.options import DEVICE, SENDER_OPTIONS
from streamsync.transports.places import cuda_device
from streamsync.transports.slots import Shared, SlotStore, SlotView, _slot
from streamsync.wire.frames import BucketHeader, Welcome


class CudaRing(msgspec.Struct, frozen=True, array_like=True):
    """What a receiver needs to rebuild the sender's device ring: the fields of
    ``reduce_tensor``'s CUDA handle, the device's UUID and one event handle per slot."""

    device_uuid: str
    device_index: int
    numel: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    slot_events: tuple[bytes, ...]


#: How long a receiver whose sender vanished waits for that process to end (it is exiting).
_ENDING_S = 5.0


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie, not yet reaped by its parent, has)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False  # cannot tell: leave its files alone
    return state in ("Z", "X")


def wait_ended(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for process ``pid`` to end; whether it has. A process
    that was killed closes its sockets before it ends: a peer that saw the socket close
    waits here for the rest."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        return _gone(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # readable once the process has ended
        return bool(poller.poll(int(timeout * 1000))) or _gone(pid)
    finally:
        os.close(fd)


def _remove_owned(paths: list[str]) -> list[str]:
    removed = []
    for path in paths:
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
    return removed


def _event_files(pid: int, shm_dir: str) -> list[str]:
    return glob.glob(os.path.join(shm_dir, f"cuda.shm.*.{pid:x}.*"))


def remove_leftovers(pid: int, ref_counter: bytes, shm_dir: str = "/dev/shm") -> list[str]:
    """Remove the ``shm_dir`` files that the ended sender ``pid`` left for its CUDA handles:
    the ring's reference count (``ref_counter``, torch's name for it) and the driver's
    event files. Only this uid's files, and only once ``pid`` has ended; returns the paths
    removed."""
    if pid <= 0 or not _gone(pid):
        return []
    name = os.path.basename(ref_counter.decode(errors="replace"))
    paths = _event_files(pid, shm_dir)
    if name.startswith(f"torch_{pid}_"):
        paths.append(os.path.join(shm_dir, name))
    return _remove_owned(paths)


def remove_own_event_files(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove the driver's event files of this process (this uid's only); what an exiting
    process that used ``cuda-ipc://`` runs last. Returns the paths removed."""
    with contextlib.suppress(Exception):  # torch frees the blocks whose receivers let go
        torch.cuda.ipc_collect()
    return _remove_owned(_event_files(os.getpid(), shm_dir))


class ThisProcess:
    """What ``cuda-ipc://`` keeps for the process it runs in: the rings its senders
    exported, by their description (a receiver in the same process takes the ring and its
    events from here, as CUDA opens no handle in the process that exported it), and the
    pid whose exit hook is registered (a forked child registers its own). Held by the
    factories of :data:`TRANSPORT`, that both sides are made by."""

    def __init__(self) -> None:
        #: The rings (and their slots' events) exported by the senders here, by handle.
        self.exported: dict[bytes, tuple[torch.Tensor, list[Any]]] = {}
        self._hooked_pid = 0

    def remove_files_at_exit(self) -> None:
        """Make sure this process removes its event files when it exits."""
        if self._hooked_pid != os.getpid():
            self._hooked_pid = os.getpid()
            # Lowest priority: after multiprocessing's own finalizers and joins.
            util.Finalize(None, remove_own_event_files, exitpriority=-(2**30))

    def sender(self, endpoint: Endpoint, opts: dict[str, Any]) -> LinkedSender:
        """The transport's sender factory."""
        timeout = opts["connect_timeout"]
        link = UnixLink("cuda-ipc", endpoint.target, receivers=opts["receivers"], timeout=timeout)
        slots, slot_bytes, device = opts.pop("slots"), opts.pop("slot_bytes"), opts.pop("device")
        store = CudaSlots(slots, slot_bytes, url=link.url, device=device, here=self)
        return LinkedSender(link, store, **opts)

    def receiver(self, endpoint: Endpoint, opts: dict[str, Any]) -> LinkedReceiver:
        """The transport's receiver factory."""
        link = UnixDialer("cuda-ipc", endpoint.target)
        return LinkedReceiver(link, CudaView(link, here=self), **opts)

    def transport(self) -> Transport:
        """``cuda-ipc://`` with this process's factories."""
        return Transport(self.sender, self.receiver, sender_options=(*SENDER_OPTIONS, DEVICE))


def local_device(uuid: str, local_uuids: list[str], fallback: int) -> int:
    """The local index of the device with ``uuid``; ``fallback`` (the sender's index) when
    UUIDs are unavailable. Raises ``ConfigError`` if this process cannot see that device."""
    if not uuid:
        return fallback
    if uuid in local_uuids:
        return local_uuids.index(uuid)
    raise ConfigError(
        f"the sender's GPU {uuid} is not visible to this process (visible: "
        f"{', '.join(local_uuids) or 'none'}); check CUDA_VISIBLE_DEVICES"
    )


def _uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


class CudaSlots(SlotStore):
    """Sender side: one exported device buffer of every slot, and an event per slot."""

    def __init__(
        self,
        slots: int,
        slot_bytes: int,
        *,
        url: str,
        device: int | str | torch.device | None,
        here: ThisProcess,
    ) -> None:
        super().__init__(slots, slot_bytes)
        self.url = url
        self._here = here
        self._device_arg = device
        self.device: torch.device | None = None
        self._events: list[Any] = []
        self._handle = b""

    def open(self) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.device = cuda_device(self.url, self._device_arg, instead="shm://")
        self._here.remove_files_at_exit()
        index = self.device.index
        ring = torch.zeros(self.slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self._bufs = list(ring.view(self.slots, self.slot_bytes).unbind(0))
        self._events = [torch.cuda.Event(interprocess=True, blocking=False) for _ in self._bufs]
        with torch.cuda.device(self.device):
            for event in self._events:
                event.record()  # an interprocess event has a handle only once recorded
        _, args = reduce_tensor(ring)
        self._handle = msgspec.msgpack.encode(
            CudaRing(
                device_uuid=_uuid(index),
                device_index=index,
                numel=ring.numel(),
                storage_handle=args[7],
                storage_size_bytes=args[8],
                storage_offset_bytes=args[9],
                ref_counter_handle=args[11],
                ref_counter_offset=args[12],
                event_handle=args[13],
                event_sync_required=bool(args[14]),
                slot_events=tuple(bytes(e.ipc_handle()) for e in self._events),
            )
        )
        torch.cuda.synchronize(self.device)  # the zeroed ring exists before anyone maps it
        self._here.exported[self._handle] = (ring, self._events)

    def shared(self) -> Shared:
        return Shared(segment="cuda", layout=self._handle)

    def filled(self, index: int) -> None:
        # Receivers' streams wait on this before reading the slot.
        self._events[index].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self._here.exported.pop(self._handle, None)
        self._bufs = []
        self._events = []
        if self.device is not None:  # the ring and its count, if no receiver still maps it
            with contextlib.suppress(RuntimeError):
                torch.cuda.ipc_collect()


class CudaView(SlotView):
    """Receiver side: the sender's ring rebuilt on the same physical device."""

    def __init__(self, link: UnixDialer, *, here: ThisProcess) -> None:
        self.url = link.url
        self._link = link
        self._here = here
        self.device: torch.device | None = None
        self._slots: list[torch.Tensor] = []
        self._events: list[Any] = []
        #: Whose ring this is: the sender's pid and torch's name for the ring's count.
        self._owner: tuple[int, bytes] | None = None
        self._lost = False

    def attach(self, welcome: Welcome, fds: list[int]) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        for fd in fds:
            os.close(fd)
        cuda_device(self.url, None, instead="shm://")  # CUDA is there
        self._here.remove_files_at_exit()
        if fds or welcome.segment != "cuda":
            raise WireFormatError("the sender did not describe a CUDA ring")
        try:
            ring = msgspec.msgpack.decode(welcome.layout, type=CudaRing)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireFormatError(f"malformed CUDA ring description: {exc}") from exc
        if (
            ring.numel != welcome.slots * welcome.slot_bytes
            or len(ring.slot_events) != welcome.slots
        ):
            raise WireFormatError("the CUDA ring does not match its slot layout")
        own = self._here.exported.get(welcome.layout)
        if own is not None:
            buf, events = own
            self.device = buf.device
            self._slots = list(buf.view(welcome.slots, welcome.slot_bytes).unbind(0))
            self._events = events
            return
        uuids = [_uuid(i) for i in range(torch.cuda.device_count())]
        index = local_device(ring.device_uuid, uuids, ring.device_index)
        self.device = torch.device("cuda", index)
        self._owner = (self._link.peer_pid, ring.ref_counter_handle)
        buf = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([ring.numel]),
            (1,),
            0,
            torch.storage.UntypedStorage,
            torch.uint8,
            index,
            ring.storage_handle,
            ring.storage_size_bytes,
            ring.storage_offset_bytes,
            False,
            ring.ref_counter_handle,
            ring.ref_counter_offset,
            ring.event_handle,
            ring.event_sync_required,
        )
        self._slots = list(buf.view(welcome.slots, welcome.slot_bytes).unbind(0))
        self._events = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in ring.slot_events]

    def data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        slot = _slot(self._slots, header)
        torch.cuda.current_stream(self.device).wait_event(self._events[header.slot])
        return slot

    def release(self, header: BucketHeader) -> None:
        # Ack only once the sink's copies out of the slot are done (this stream only).
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()

    def lost(self) -> None:
        self._lost = True

    def close(self) -> None:
        self._slots = []
        self._events = []
        owner, self._owner = self._owner, None
        if owner is not None:
            if self._lost:
                wait_ended(owner[0], _ENDING_S)
            removed = remove_leftovers(*owner)
            if removed:
                log("cuda_ipc.leftovers_removed", url=self.url, pid=owner[0], paths=removed)


#: ``cuda-ipc://NAME``: the entry point's object; the sender also takes ``device`` (its
#: GPU, default the current one).
TRANSPORT = ThisProcess().transport()
