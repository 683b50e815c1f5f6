"""``shm://NAME``: a ring of shared-memory slots between processes on one machine (Linux).

Composes :class:`~streamsync.transports.slots.MemfdSlots` (one anonymous 0600 ``memfd``;
its descriptor rides on the ``Welcome``) with :class:`~streamsync.transports.link.UnixLink`
(``@streamsync-shm/<uid>/NAME``). Nothing to leak: no file in ``/dev/shm``, no socket file,
so a SIGKILL of either side leaves nothing behind; a dead peer's socket reads EOF at once.

URL options: ``receivers``, ``slots``, ``slot_bytes``. Keyword arguments: ``secret``
(default ``$STREAMSYNC_SECRET``), ``connect_timeout``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamsync.transports.link import UnixDialer, UnixLink
from streamsync.transports.linked import LinkedReceiver, LinkedSender
from streamsync.transports.slots import MemfdSlots, MemfdView

if TYPE_CHECKING:
    from streamsync.transports import Endpoint

__all__ = ["receiver_from_url", "sender_from_url"]


def sender_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> LinkedSender:
    """``shm://NAME?receivers=&slots=&slot_bytes=``; keyword arguments override."""
    opts = endpoint.sender_options(kwargs)
    timeout = opts.get("connect_timeout", 60.0)
    link = UnixLink("shm", endpoint.target, receivers=opts["receivers"], timeout=timeout)
    store = MemfdSlots(opts.pop("slots"), opts.pop("slot_bytes"), name=endpoint.target)
    return LinkedSender(link, store, **opts)


def receiver_from_url(endpoint: Endpoint, kwargs: dict[str, Any]) -> LinkedReceiver:
    """``shm://NAME``."""
    return LinkedReceiver(UnixDialer("shm", endpoint.target), MemfdView(), **kwargs)
