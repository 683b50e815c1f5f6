"""Transports, chosen by URL so that swapping one is a configuration string.

===========================  ============================================================
``memory://NAME``            in-process, for tests (:mod:`streamsync.transports.memory`)
``shm://NAME``               shared-memory ring between processes on one Linux machine
                             (:mod:`streamsync.transports.shm`)
``zmq+tcp://HOST:PORT``      ZeroMQ over TCP, across machines; HOST defaults to 127.0.0.1,
                             ``*`` binds every interface (:mod:`streamsync.transports.zeromq`)
``zmq+ipc://PATH``           ZeroMQ over a unix socket: an absolute path, ``@name`` (abstract)
                             or a bare name (in a per-user 0700 directory)
``cuda-ipc://NAME``          a ring of CUDA buffers shared between processes on one machine
                             (:mod:`streamsync.transports.cuda_ipc`)
``torch+gloo://HOST:PORT``   each bucket broadcast once to every receiver in a private
                             ``torch.distributed`` gloo group (:mod:`.torch_dist`)
``torch+nccl://HOST:PORT``   the same over NCCL, the ring on the GPU
===========================  ============================================================

Every transport, built-in or not, is an entry point in the ``streamsync.transports`` group
named by its URL scheme, whose object is a :class:`Transport` (imported on first use);
:func:`register` adds one at run time. A URL's query and keyword arguments hold the
transport's declared options (``shm://demo?receivers=2&slots=3``), checked by
:mod:`streamsync.transports.options`, which also states the one timeout rule. Secrets are
never URL options: pass ``secret=`` to both sides, or set ``$STREAMSYNC_SECRET``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from streamsync.errors import ConfigError
from streamsync.transports.base import Receiver, Sender
from streamsync.transports.options import RECEIVER_OPTIONS, SENDER_OPTIONS, Option, resolve

__all__ = ["Endpoint", "Option", "Transport"]

#: The entry-point group transports are found in (name: the URL scheme).
ENTRY_POINT_GROUP = "streamsync.transports"


@dataclass(frozen=True)
class Endpoint:
    """A parsed transport URL."""

    scheme: str
    target: str
    #: The URL's query, as text (checked against the transport's declared options).
    query: dict[str, str]

    @property
    def url(self) -> str:
        """``scheme://target`` (without the query)."""
        return f"{self.scheme}://{self.target}"


#: ``(endpoint, options)`` to an unopened sender or receiver; ``options`` holds every
#: declared option's value.
SenderFactory = Callable[[Endpoint, dict[str, Any]], Sender]
ReceiverFactory = Callable[[Endpoint, dict[str, Any]], Receiver]


@dataclass(frozen=True)
class Transport:
    """What a transport's entry point names: a factory per side and the options each side
    takes (by default the options every transport takes,
    :data:`~streamsync.transports.options.SENDER_OPTIONS` and
    :data:`~streamsync.transports.options.RECEIVER_OPTIONS`)."""

    sender: SenderFactory
    receiver: ReceiverFactory
    sender_options: tuple[Option, ...] = SENDER_OPTIONS
    receiver_options: tuple[Option, ...] = RECEIVER_OPTIONS


class _Registry:
    """Schemes to transports: entry points, loaded on first use, and run-time additions."""

    def __init__(self) -> None:
        self._found: dict[str, EntryPoint] | None = None
        self._loaded: dict[str, Transport] = {}

    def found(self) -> dict[str, EntryPoint]:
        if self._found is None:
            self._found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        return self._found

    def schemes(self) -> list[str]:
        return sorted({*self.found(), *self._loaded})

    def get(self, scheme: str, url: str) -> Transport:
        transport = self._loaded.get(scheme)
        if transport is not None:
            return transport
        ep = self.found().get(scheme)
        if ep is None:
            raise ConfigError(
                f"unknown transport {scheme!r} in {url!r}; known: {', '.join(self.schemes())}"
            )
        loaded = ep.load()
        if not isinstance(loaded, Transport):
            raise ConfigError(
                f"the {ENTRY_POINT_GROUP} entry point {scheme!r} ({ep.value}) is a "
                f"{type(loaded).__name__}, not a streamsync.transports.Transport"
            )
        self._loaded[scheme] = loaded
        return loaded


_registry = _Registry()


def register(scheme: str, transport: Transport) -> None:
    """Make ``scheme://`` URLs open ``transport`` in this process (an installed
    distribution declares an entry point in :data:`ENTRY_POINT_GROUP` instead)."""
    _registry._loaded[scheme] = transport


def schemes() -> list[str]:
    """The URL schemes that can be opened (installed entry points are read again)."""
    _registry._found = None
    return _registry.schemes()


def parse_endpoint(url: str) -> Endpoint:
    """Split a transport URL into scheme, target and query."""
    parts = urlsplit(url)
    if not parts.scheme or "://" not in url:
        raise ConfigError(f"endpoint {url!r} is not a URL; valid forms: {_forms()}")
    target = parts.netloc + parts.path
    if not target:
        raise ConfigError(f"endpoint {url!r} names no channel; valid forms: {_forms()}")
    return Endpoint(parts.scheme, target, dict(parse_qsl(parts.query, keep_blank_values=True)))


def _forms() -> str:
    return ", ".join(f"{s}://..." for s in _registry.schemes())


def check_options(
    url: str,
    options: Mapping[str, Any],
    *,
    side: str = "sender",
    caller: tuple[str, Sequence[str]] | None = None,
) -> None:
    """Raise the :class:`ConfigError` that opening ``url``'s ``side`` with ``options``
    would: for callers that take transport options with keywords of their own (``send``,
    ``WeightSync``), at the call; ``caller`` (name and keywords) is listed in the message."""
    _resolve(url, options, side=side, caller=caller)


def _resolve(
    url: str,
    options: Mapping[str, Any],
    *,
    side: str,
    caller: tuple[str, Sequence[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[Transport, Endpoint, dict[str, Any]]:
    """``url``'s transport, its parsed endpoint and every option of ``side``'s, checked."""
    endpoint = parse_endpoint(url)
    transport = _registry.get(endpoint.scheme, url)
    if side == "sender":
        declared, query = transport.sender_options, endpoint.query
    else:
        # The sender's URL serves both sides: its sender options mean nothing here.
        declared = transport.receiver_options
        mine = {o.name for o in declared}
        senders = {o.name for o in transport.sender_options if o.in_url and o.name not in mine}
        query = {k: v for k, v in endpoint.query.items() if k not in senders}
    values = resolve(endpoint.url, declared, query, options, caller=caller, defaults=defaults)
    return transport, endpoint, values


def one_shot_options(
    url: str,
    options: Mapping[str, Any],
    *,
    timeout: float,
    side: str = "sender",
    caller: tuple[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """``options`` for a call that opens ``url`` for one sync with a ``timeout`` of its own
    (``send``, ``receive``), checked as :func:`check_options` does: ``connect_timeout``
    is set, to the keyword's value, else the URL's, else ``timeout``."""
    *_, values = _resolve(
        url, options, side=side, caller=caller, defaults={"connect_timeout": timeout}
    )
    if "connect_timeout" not in values:
        return dict(options)  # a transport that takes no connect_timeout
    return {**options, "connect_timeout": values["connect_timeout"]}


def open_sender(url: str, **options: Any) -> Sender:
    """A sender for ``url`` (not yet opened: use ``async with``). ``options`` are the
    transport's declared options; they override the URL's query, except
    ``connect_timeout`` (default 60 s, each wait for the receivers to join), which must
    agree with it."""
    transport, endpoint, values = _resolve(url, options, side="sender")
    return transport.sender(endpoint, values)


def open_receiver(url: str, **options: Any) -> Receiver:
    """A receiver for ``url`` (not yet opened: use ``async with``). The sender's URL serves
    both sides: its sender options in the query are accepted and ignored here.
    ``connect_timeout`` (default 60 s) bounds the wait for the sender to be there."""
    transport, endpoint, values = _resolve(url, options, side="receiver")
    return transport.receiver(endpoint, values)
