"""The slot-store seam: where a channel's bucket bytes live.

:class:`SlotStore` (sender) allocates the slots once per channel and says what a joining
receiver needs to reach them (:class:`Shared`, sent with the ``Welcome``); with
``payload_frames`` the slots are private and a bucket's bytes follow its header over the
link. :class:`SlotView` (receiver) attaches to what the ``Welcome`` described and returns a
bucket's bytes.

Here: :class:`MemfdSlots`/:class:`MemfdView` (``shm://``) and
:class:`HostSlots`/:class:`PayloadView` (``zmq+*://``); ``cuda-ipc://`` adds its own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from streamsync.errors import WireFormatError
from streamsync.wire.frames import BucketHeader, Welcome
from streamsync.wire.slot import allocate_slot


@dataclass(frozen=True)
class Shared:
    """What a joining receiver is sent to reach the slots (with the ``Welcome``)."""

    segment: str = ""
    layout: bytes = b""
    fds: tuple[int, ...] = ()


class SlotStore(ABC):
    """Sender side: ``slots`` buffers of ``slot_bytes``, allocated once per channel."""

    #: A bucket's bytes travel over the link as a payload frame after its header.
    payload_frames = False

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._bufs: list[torch.Tensor] = []

    @abstractmethod
    def open(self) -> None:
        """Allocate (and pre-fault) the slots."""

    def slot(self, index: int) -> torch.Tensor:
        """The writable uint8 buffer of slot ``index``."""
        return self._bufs[index]

    def shared(self) -> Shared:
        """What a joining receiver needs to reach the slots."""
        return Shared()

    def filled(self, index: int) -> None:  # noqa: B027 - optional hook
        """Slot ``index`` now holds a complete bucket (called before it is announced)."""

    def close(self) -> None:
        """Release the slots (tolerates a store that never opened)."""
        self._bufs = []


class SlotView(ABC):
    """Receiver side of a :class:`SlotStore`."""

    @abstractmethod
    def attach(self, welcome: Welcome, fds: list[int]) -> None:
        """Reach the slots the ``Welcome`` describes; owns (and closes) ``fds``."""

    @abstractmethod
    def data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        """The uint8 bytes of a bucket (``payload``: the link's payload frame, or None)."""

    async def fill(self, header: BucketHeader, payload: Any, *, timeout: float) -> torch.Tensor:
        """The bucket's bytes once they are in this side's slot, called by the link's reader
        in header order: bytes that come by another path (a broadcast) are awaited here,
        within the sync's ``timeout``. By default :meth:`data`."""
        return self.data(header, payload)

    def release(self, header: BucketHeader) -> None:  # noqa: B027 - optional hook
        """The sink is done with the bucket's bytes; its slot is acked next."""

    def lost(self) -> None:  # noqa: B027 - optional hook
        """The sender went away without closing the channel (its process may have died)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Let go of the slots."""


class HostSlots(SlotStore):
    """Private, page-aligned host buffers (bytes travel as payload frames)."""

    payload_frames = True

    def __init__(self, slots: int, slot_bytes: int, *, prefault: bool = True) -> None:
        super().__init__(slots, slot_bytes)
        self.prefault = prefault

    def open(self) -> None:
        self._bufs = [allocate_slot(self.slot_bytes) for _ in range(self.slots)]
        for buf in self._bufs if self.prefault else ():
            buf.zero_()  # fault the pages in now, not during the first sync


class PayloadView(SlotView):
    """A bucket's bytes are the payload frame that followed its header (no copy)."""

    def attach(self, welcome: Welcome, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if fds:
            raise WireFormatError(f"the sender passed {len(fds)} descriptors, expected none")

    def data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        if payload is None:
            raise WireFormatError(f"bucket {header.seq} arrived without its bytes")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only frames: we never write
            data = torch.frombuffer(payload, dtype=torch.uint8)
        if data.numel() != header.nbytes:
            raise WireFormatError(
                f"bucket {header.seq} has {data.numel()} bytes; its header says {header.nbytes}"
            )
        if data.data_ptr() % 8:
            data = data.clone()  # views of 8-byte dtypes need 8-byte alignment
        return data


class MemfdSlots(SlotStore):
    """One anonymous 0600 ``memfd`` holding every slot, mapped and pre-faulted once."""

    def __init__(self, slots: int, slot_bytes: int, *, name: str) -> None:
        super().__init__(slots, slot_bytes)
        self.name = name
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None

    def open(self) -> None:
        size = self.slots * self.slot_bytes
        self._fd = os.memfd_create(f"streamsync-{self.name}", os.MFD_CLOEXEC)
        os.fchmod(self._fd, 0o600)
        os.ftruncate(self._fd, size)
        self._mm = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._bufs = _views(self._mm, self.slots, self.slot_bytes)
        for buf in self._bufs:
            # Touch every page once now: a first copy into fresh pages runs at a quarter of
            # the speed of a warm one.
            buf.zero_()

    def shared(self) -> Shared:
        assert self._fd is not None
        return Shared(fds=(self._fd,))

    def close(self) -> None:
        self._bufs = []
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # views still held elsewhere: GC unmaps
                self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MemfdView(SlotView):
    """Maps the sender's memfd once (``MAP_POPULATE``); a bucket is a view of its slot."""

    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []

    def attach(self, welcome: Welcome, fds: list[int]) -> None:
        try:
            if len(fds) != 1:
                raise WireFormatError(f"the sender passed {len(fds)} descriptors, not 1")
            size = welcome.slots * welcome.slot_bytes
            if welcome.slots < 1 or os.fstat(fds[0]).st_size < size:
                raise WireFormatError(
                    f"the segment is smaller than {welcome.slots} slots of "
                    f"{welcome.slot_bytes} bytes"
                )
            mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            for fd in fds:
                os.close(fd)
        # The views keep the mapping alive; it goes when the last of them does.
        self._slots = _views(mm, welcome.slots, welcome.slot_bytes)

    def data(self, header: BucketHeader, payload: Any) -> torch.Tensor:
        return _slot(self._slots, header)

    def close(self) -> None:
        self._slots = []


def _slot(slots: list[torch.Tensor], header: BucketHeader) -> torch.Tensor:
    if not 0 <= header.slot < len(slots):
        raise WireFormatError(
            f"bucket {header.seq} is in slot {header.slot}; the ring has {len(slots)}"
        )
    return slots[header.slot]


def _views(mm: mmap.mmap, slots: int, slot_bytes: int) -> list[torch.Tensor]:
    return [
        torch.frombuffer(mm, dtype=torch.uint8, count=slot_bytes, offset=i * slot_bytes)
        for i in range(slots)
    ]
