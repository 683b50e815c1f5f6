"""``shm://NAME``: a ring of shared-memory slots between processes on one machine (Linux).

Composes :class:`~streamsync.transports.slots.MemfdSlots` (one anonymous 0600 ``memfd``
holding every slot, mapped once on each side; its descriptor rides on the ``Welcome``) with
:class:`~streamsync.transports.link.UnixLink` (a stream socket per receiver in the abstract
namespace, ``@streamsync-shm/<uid>/NAME``, owner-only by ``SO_PEERCRED``). A bucket is
packed straight into a free slot; the receiver's sink reads a view of it.

Nothing to leak: the segment has no name in ``/dev/shm`` and the socket no file, so a
SIGKILL of either side leaves nothing behind. A dead peer's socket reads EOF at once, which
the other side raises as :class:`~streamsync.PeerBrokenError`.

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

__all__ = ["receiver_from_url", "sender_from_url"]


def sender_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> LinkedSender:
    """``shm://NAME?receivers=&slots=&slot_bytes=``; keyword arguments override."""
    opts = endpoint.sender_options(kwargs)
    timeout = opts.get("connect_timeout", 60.0)
    address = unix_address("shm", endpoint.target)
    link = UnixLink(
        f"shm://{endpoint.target}", address, receivers=opts["receivers"], timeout=timeout
    )
    store = MemfdSlots(opts.pop("slots"), opts.pop("slot_bytes"), name=endpoint.target)
    return LinkedSender(link, store, **opts)


def receiver_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> LinkedReceiver:
    """``shm://NAME``."""
    link = UnixDialer(f"shm://{endpoint.target}", unix_address("shm", endpoint.target))
    return LinkedReceiver(link, MemfdView(), **kwargs)
