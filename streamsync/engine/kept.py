"""``update_engine``: one call per sync, through a channel kept for the engine.

The channels are kept by endpoint, in this process's :data:`KEPT`: an endpoint is bound by
one channel at a time, so it names the channel. An entry holds its engines weakly (its
channel reaches them through weak proxies) and goes when the first of them does, so the
channel (and its loop thread) goes with the engine; nothing is written onto the engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync._log import log
from streamsync.engine.channel import EngineChannel
from streamsync.engine.clients import EngineClient
from streamsync.engine.messages import WorkerOptions
from streamsync.engine.rounds import several
from streamsync.errors import ConfigError
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES


@dataclass
class _Kept:
    channel: EngineChannel
    engines: tuple[weakref.ref[Any], ...]
    #: What the channel was opened with (``bucket_bytes``, ``delta``, ``secret``, the
    #: transport's options...): a call with other values needs another channel.
    opened_with: dict[str, Any]

    def serves(self, engines: tuple[Any, ...], fanout: bool, opened_with: dict[str, Any]) -> bool:
        return (
            len(self.engines) == len(engines)
            and all(ref() is e for ref, e in zip(self.engines, engines, strict=True))
            and self.channel.fanout == fanout
            and self.opened_with == opened_with
        )


class KeptChannels:
    """The channels :func:`update_engine` keeps, by endpoint (see :data:`KEPT`)."""

    def __init__(self) -> None:
        self._by_endpoint: dict[str, _Kept] = {}

    def get(self, endpoint: str) -> EngineChannel | None:
        """The channel kept for ``endpoint``, if any."""
        kept = self._by_endpoint.get(endpoint)
        return kept.channel if kept is not None else None

    async def channel(
        self,
        engines: tuple[Any, ...],
        endpoint: str,
        *,
        fanout: bool,
        opened_with: Mapping[str, Any],
        make: Callable[[tuple[Any, ...]], EngineChannel],
    ) -> EngineChannel:
        """The channel kept for ``endpoint`` if it serves these engines alike and was opened
        with the same ``opened_with`` options; else a new one, ``make(proxies)`` for weak
        proxies of ``engines`` (the old one closed first: it holds the endpoint)."""
        wanted = dict(opened_with)
        kept = self._by_endpoint.get(endpoint)
        if kept is not None and not kept.serves(engines, fanout, wanted):
            log("engine.channel_replaced", endpoint=endpoint)
            self._by_endpoint.pop(endpoint, None)  # (its engine's going may have dropped it)
            await kept.channel.aclose()
            kept = None
        if kept is None:
            kept = _Kept(make(tuple(weakref.proxy(e) for e in engines)), (), wanted)
            entry = weakref.ref(kept)  # the entry's engines must not keep it alive

            def gone(_: object) -> None:
                # An engine of the entry went: drop it, unless another replaced it.
                alive = entry()
                if alive is not None and self._by_endpoint.get(endpoint) is alive:
                    del self._by_endpoint[endpoint]

            kept.engines = tuple(weakref.ref(e, gone) for e in engines)
            self._by_endpoint[endpoint] = kept
        return kept.channel


#: The channels :func:`update_engine` keeps in this process, by endpoint.
KEPT = KeptChannels()


def _weakly_referable(engines: tuple[Any, ...]) -> bool:
    try:
        for e in engines:
            weakref.ref(e)
    except TypeError:
        return False
    return True


async def update_engine(
    engine: Any,
    weights: Any,
    *,
    client: Callable[[Any], EngineClient],
    endpoint: str,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
    worker_options: WorkerOptions | Mapping[str, Any] | None = None,
    **options: Any,
) -> SyncReport:
    """Sync ``weights`` into ``engine`` (or into every engine of a list, from one stream:
    see :class:`~streamsync.engine.channel.EngineChannel`) through a channel on
    ``client(engine)`` kept open for later calls with the same engines and ``endpoint``, so
    its slots and sockets are reused.

    Any event loop may call it, a fresh one per step (``asyncio.run`` per step) included:
    the channel lives on a loop of its own. Engine packages wrap it as their
    ``update_weights``. Calling with other engines, or with other channel options
    (``bucket_bytes``, ``delta``, ``checksum``, ``secret`` or another transport option), on
    the same endpoint replaces it; ``timeout``, ``pipeline`` and ``worker_options`` are the
    call's own. ``client`` is given a weak proxy of each engine (so the kept channel does not
    keep the engine alive), or the engine itself where it cannot be weakly referenced (the
    channel is then for this call only).
    """
    fanout = several(engine)
    engines = tuple(engine) if fanout else (engine,)
    if not engines:
        raise ConfigError("update_weights: no engine given; pass one engine or several")

    def make(targets: tuple[Any, ...]) -> EngineChannel:
        clients = [client(e) for e in targets] if fanout else client(targets[0])
        return EngineChannel(
            clients, endpoint, bucket_bytes=bucket_bytes, timeout=timeout, **options
        )

    keep = _weakly_referable(engines)
    if not keep:  # cannot tell when the engine goes: a channel for this call only
        channel = make(engines)
    else:
        opened_with = {**options, "bucket_bytes": bucket_bytes}
        channel = await KEPT.channel(
            engines, endpoint, fanout=fanout, opened_with=opened_with, make=make
        )
    channel.timeout = timeout
    channel.worker_options = WorkerOptions.coerce(worker_options)
    if not keep:
        async with channel:
            return await channel.update(weights, pipeline=pipeline)
    return await channel.update(weights, pipeline=pipeline)
