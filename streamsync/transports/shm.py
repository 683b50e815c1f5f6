"""``shm://NAME``: a ring of shared-memory slots between processes on one machine (Linux).

Composes :class:`~streamsync.transports.slots.MemfdSlots` (one anonymous 0600 ``memfd``;
its descriptor rides on the ``Welcome``) with :class:`~streamsync.transports.link.UnixLink`
(``@streamsync-shm/<uid>/NAME``). Nothing to leak: no file in ``/dev/shm``, no socket file,
so a SIGKILL of either side leaves nothing behind; a dead peer's socket reads EOF at once.

Options: every transport's (:data:`~streamsync.transports.options.SENDER_OPTIONS`,
:data:`~streamsync.transports.options.RECEIVER_OPTIONS`).
"""

from __future__ import annotations

from typing import Any

from streamsync.transports import Endpoint, Transport
from streamsync.transports.link import UnixDialer, UnixLink
from streamsync.transports.linked import LinkedReceiver, LinkedSender
from streamsync.transports.slots import MemfdSlots, MemfdView


def _sender(endpoint: Endpoint, opts: dict[str, Any]) -> LinkedSender:
    timeout = opts["connect_timeout"]
    link = UnixLink("shm", endpoint.target, receivers=opts["receivers"], timeout=timeout)
    store = MemfdSlots(opts.pop("slots"), opts.pop("slot_bytes"), name=endpoint.target)
    return LinkedSender(link, store, **opts)


def _receiver(endpoint: Endpoint, opts: dict[str, Any]) -> LinkedReceiver:
    return LinkedReceiver(UnixDialer("shm", endpoint.target), MemfdView(), **opts)


#: ``shm://NAME``: the entry point's object.
TRANSPORT = Transport(_sender, _receiver)
