"""``shm://NAME``: a ring of shared-memory slots between processes on one machine (Linux).

Composes :class:`~streamsync.transports.slots.MemfdSlots` with the unix link
(:class:`~streamsync.transports.link.UnixLink`):

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

from typing import TYPE_CHECKING, Any

from streamsync.transports.link import UnixDialer, UnixLink, unix_address
from streamsync.transports.linked import LinkedReceiver, LinkedSender
from streamsync.transports.slots import MemfdSlots, MemfdView

if TYPE_CHECKING:
    from streamsync.transports import Endpoint

__all__ = ["SharedMemoryReceiver", "SharedMemorySender"]


class SharedMemorySender(LinkedSender):
    """Sender side of ``shm://NAME``."""

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
        link = UnixLink(
            f"shm://{name}",
            unix_address("shm", name),
            receivers=receivers,
            connect_timeout=connect_timeout,
        )
        store = MemfdSlots(slots, slot_bytes, name=name)
        super().__init__(
            link, store, receivers=receivers, secret=secret, connect_timeout=connect_timeout
        )


class SharedMemoryReceiver(LinkedReceiver):
    """Receiver side of ``shm://NAME``."""

    def __init__(
        self, name: str, *, secret: bytes | str | None = None, connect_timeout: float = 60.0
    ) -> None:
        url = f"shm://{name}"
        link = UnixDialer(url, unix_address("shm", name))
        super().__init__(url, link, MemfdView(), secret=secret, connect_timeout=connect_timeout)


def sender_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> SharedMemorySender:
    """``shm://NAME?receivers=&slots=&slot_bytes=``; keyword arguments override."""
    return SharedMemorySender(endpoint.target, **endpoint.sender_options(kwargs))


def receiver_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> SharedMemoryReceiver:
    """``shm://NAME``."""
    return SharedMemoryReceiver(endpoint.target, **kwargs)
