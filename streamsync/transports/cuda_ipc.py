"""``cuda-ipc://NAME``: a ring of CUDA buffers shared between processes on one machine.

The sender allocates and exports one device buffer of every slot once; only the handle's
fields travel, as a msgspec struct in the authenticated ``Welcome`` (never pickle). Each
receiver rebuilds it on the local index of the same physical device (matched by UUID).
CUDA events, never a device-wide synchronise: a receiver's stream waits on the slot's
interprocess event before reading it, and acks only after its sink's copies completed.
Messages ride the unix link of ``shm://``. URL options: ``receivers``, ``slots``,
``slot_bytes``; keyword arguments: ``device`` (sender), ``secret``, ``connect_timeout``.
"""

# torch's CUDA IPC helpers are untyped.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch

from streamsync.errors import ConfigError, WireFormatError
from streamsync.transports import Endpoint, Transport
from streamsync.transports.link import UnixDialer, UnixLink
from streamsync.transports.linked import LinkedReceiver, LinkedSender
from streamsync.transports.options import DEVICE, SENDER_OPTIONS
from streamsync.transports.places import cuda_device
from streamsync.transports.slots import Shared, SlotStore, SlotView, _slot
from streamsync.wire.frames import BucketHeader, Welcome

__all__ = [
    "CudaRing",
    "CudaSlots",
    "CudaView",
    "local_device",
    "TRANSPORT",
]


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
        self, slots: int, slot_bytes: int, *, url: str, device: int | str | torch.device | None
    ) -> None:
        super().__init__(slots, slot_bytes)
        self.url = url
        self._device_arg = device
        self.device: torch.device | None = None
        self._ring: torch.Tensor | None = None
        self._events: list[Any] = []
        self._handle = b""

    def open(self) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.device = cuda_device(self.url, self._device_arg, instead="shm://")
        index = self.device.index
        ring = torch.zeros(self.slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self._ring = ring
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

    def shared(self) -> Shared:
        return Shared(segment="cuda", layout=self._handle)

    def filled(self, index: int) -> None:
        # Receivers' streams wait on this before reading the slot.
        self._events[index].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self._bufs = []
        self._events = []
        self._ring = None


class CudaView(SlotView):
    """Receiver side: the sender's ring rebuilt on the same physical device."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.device: torch.device | None = None
        self._slots: list[torch.Tensor] = []
        self._events: list[Any] = []

    def attach(self, welcome: Welcome, fds: list[int]) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        for fd in fds:
            os.close(fd)
        cuda_device(self.url, None, instead="shm://")  # CUDA is there
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
        uuids = [_uuid(i) for i in range(torch.cuda.device_count())]
        index = local_device(ring.device_uuid, uuids, ring.device_index)
        self.device = torch.device("cuda", index)
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

    def close(self) -> None:
        self._slots = []
        self._events = []


def _sender(endpoint: Endpoint, opts: dict[str, Any]) -> LinkedSender:
    timeout = opts["connect_timeout"]
    link = UnixLink("cuda-ipc", endpoint.target, receivers=opts["receivers"], timeout=timeout)
    device = opts.pop("device")
    store = CudaSlots(opts.pop("slots"), opts.pop("slot_bytes"), url=link.url, device=device)
    return LinkedSender(link, store, **opts)


def _receiver(endpoint: Endpoint, opts: dict[str, Any]) -> LinkedReceiver:
    link = UnixDialer("cuda-ipc", endpoint.target)
    return LinkedReceiver(link, CudaView(link.url), **opts)


#: ``cuda-ipc://NAME``: the entry point's object; the sender also takes ``device`` (its
#: GPU, default the current one).
TRANSPORT = Transport(_sender, _receiver, sender_options=(*SENDER_OPTIONS, DEVICE))
