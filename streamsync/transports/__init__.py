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

Further schemes register themselves with :func:`register`; a URL's query string holds the
transport's options (``shm://demo?receivers=2&slots=3``). Secrets are never URL options:
pass ``secret=`` to the sender and receivers, or set ``$STREAMSYNC_SECRET``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from streamsync.errors import ConfigError
from streamsync.transports.base import (
    Attendance,
    Incoming,
    Receiver,
    ReceiverState,
    Sender,
    SenderStatistics,
)

__all__ = [
    "Attendance",
    "Endpoint",
    "Incoming",
    "Receiver",
    "ReceiverState",
    "Sender",
    "SenderStatistics",
    "open_receiver",
    "open_sender",
    "parse_endpoint",
    "register",
    "schemes",
]


@dataclass(frozen=True)
class Endpoint:
    """A parsed transport URL."""

    scheme: str
    target: str
    options: dict[str, str]

    def sender_options(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """The ring options every sender takes, from the URL's query (``receivers``, default
        1; ``slots``, default 2; ``slot_bytes``, default 64 MiB); keyword arguments win."""
        options: dict[str, Any] = {
            "receivers": self.int_option("receivers", 1),
            "slots": self.int_option("slots", 2),
            "slot_bytes": self.int_option("slot_bytes", 64 << 20),
        }
        options.update(overrides)
        return options

    def int_option(self, key: str, default: int) -> int:
        raw = self.options.get(key)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(
                f"{self.scheme}://{self.target}: option {key}={raw!r} is not an integer"
            ) from None


SenderFactory = Callable[[Endpoint, dict[str, Any]], Sender]
ReceiverFactory = Callable[[Endpoint, dict[str, Any]], Receiver]

_registry: dict[str, tuple[SenderFactory, ReceiverFactory]] = {}


def register(scheme: str, sender: SenderFactory, receiver: ReceiverFactory) -> None:
    """Make ``scheme://`` URLs open ``sender``/``receiver`` (a user's own transport too)."""
    _registry[scheme] = (sender, receiver)


def schemes() -> list[str]:
    """The URL schemes that can be opened."""
    _load_builtin()
    return sorted(_registry)


def parse_endpoint(url: str) -> Endpoint:
    """Split a transport URL into scheme, target and options."""
    parts = urlsplit(url)
    if not parts.scheme or "://" not in url:
        raise ConfigError(f"endpoint {url!r} is not a URL; valid forms: {_forms()}")
    target = parts.netloc + parts.path
    if not target:
        raise ConfigError(f"endpoint {url!r} names no channel; valid forms: {_forms()}")
    return Endpoint(parts.scheme, target, dict(parse_qsl(parts.query)))


def _forms() -> str:
    return ", ".join(f"{s}://..." for s in schemes())


def _factories(url: str) -> tuple[Endpoint, tuple[SenderFactory, ReceiverFactory]]:
    _load_builtin()
    endpoint = parse_endpoint(url)
    try:
        return endpoint, _registry[endpoint.scheme]
    except KeyError:
        raise ConfigError(
            f"unknown transport {endpoint.scheme!r} in {url!r}; known: {', '.join(schemes())}"
        ) from None


def open_sender(url: str, **kwargs: Any) -> Sender:
    """A sender for ``url`` (not yet opened: use ``async with``)."""
    endpoint, (factory, _) = _factories(url)
    return factory(endpoint, kwargs)


def open_receiver(url: str, **kwargs: Any) -> Receiver:
    """A receiver for ``url`` (not yet opened: use ``async with``)."""
    endpoint, (_, factory) = _factories(url)
    return factory(endpoint, kwargs)


_loaded = False


def _load_builtin() -> None:
    # A built-in transport's module is imported when a channel of it is opened; it imports
    # only the standard library and torch then (pyzmq and CUDA when the channel opens).
    global _loaded
    if _loaded:
        return
    _loaded = True
    modules = {
        "zmq+tcp": "zeromq",
        "zmq+ipc": "zeromq",
        "cuda-ipc": "cuda_ipc",
        "torch+gloo": "torch_dist",
        "torch+nccl": "torch_dist",
    }
    for scheme in ("memory", "shm", *modules):
        module = modules.get(scheme, scheme)
        register(scheme, _lazy(module, "sender_from_url"), _lazy(module, "receiver_from_url"))


def _lazy(module: str, factory: str) -> Callable[[Endpoint, dict[str, Any]], Any]:
    """A factory that imports ``streamsync.transports.<module>`` on first use."""

    def make(endpoint: Endpoint, kwargs: dict[str, Any]) -> Any:
        import importlib

        mod = importlib.import_module(f"streamsync.transports.{module}")
        return getattr(mod, factory)(endpoint, kwargs)

    make.__name__ = f"{module}.{factory}"
    return make
