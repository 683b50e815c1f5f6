"""``update_engine``: one call per sync, through a channel kept for the engine.

The channels are owned by a :class:`KeptChannels`, an object of ours that the (first)
engine holds under one attribute, so they go when the engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from streamsync._log import log
from streamsync.engine.channel import EngineChannel
from streamsync.engine.clients import EngineClient
from streamsync.engine.messages import WorkerOptions
from streamsync.engine.rounds import several
from streamsync.errors import ConfigError
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport
from streamsync.sync import DEFAULT_TIMEOUT
from streamsync.wire.bucket import DEFAULT_BUCKET_BYTES


@dataclass
class _Kept:
    channel: EngineChannel
    engines: tuple[Any, ...]
    #: What the channel was opened with (``bucket_bytes``, ``delta``, ``secret``, the
    #: transport's options...): a call with other values needs another channel.
    opened_with: dict[str, Any]

    def serves(self, engines: tuple[Any, ...], fanout: bool, opened_with: dict[str, Any]) -> bool:
        return (
            len(self.engines) == len(engines)
            and all(a is b for a, b in zip(self.engines, engines, strict=True))
            and self.channel.fanout == fanout
            and self.opened_with == opened_with
        )


class KeptChannels:
    """The channels :func:`update_engine` keeps for one engine, by endpoint."""

    #: The one attribute an engine object holds them under.
    ATTRIBUTE = "_streamsync_channels"

    def __init__(self) -> None:
        self._by_endpoint: dict[str, _Kept] = {}

    @classmethod
    def of(cls, engine: Any) -> KeptChannels | None:
        """The engine's kept channels (made on first use); ``None`` for an object that
        cannot hold an attribute."""
        try:
            kept = vars(engine).setdefault(cls.ATTRIBUTE, cls())
        except TypeError:
            return None
        return kept if isinstance(kept, cls) else None

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
        make: Callable[[], EngineChannel],
    ) -> EngineChannel:
        """The channel kept for ``endpoint`` if it serves these engines alike and was opened
        with the same ``opened_with`` options; else a new one from ``make`` (the old one
        closed first: it holds the endpoint)."""
        wanted = dict(opened_with)
        kept = self._by_endpoint.get(endpoint)
        if kept is not None and not kept.serves(engines, fanout, wanted):
            log("engine.channel_replaced", endpoint=endpoint)
            del self._by_endpoint[endpoint]
            await kept.channel.aclose()
            kept = None
        if kept is None:
            kept = self._by_endpoint[endpoint] = _Kept(make(), engines, wanted)
        return kept.channel


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
    call's own.
    """
    fanout = several(engine)
    engines = tuple(engine) if fanout else (engine,)
    if not engines:
        raise ConfigError("update_weights: no engine given; pass one engine or several")

    def make() -> EngineChannel:
        clients = [client(e) for e in engines] if fanout else client(engine)
        return EngineChannel(
            clients, endpoint, bucket_bytes=bucket_bytes, timeout=timeout, **options
        )

    kept = KeptChannels.of(engines[0])
    if kept is None:  # nowhere to keep it: a channel for this call only
        channel = make()
    else:
        opened_with = {**options, "bucket_bytes": bucket_bytes}
        channel = await kept.channel(
            engines, endpoint, fanout=fanout, opened_with=opened_with, make=make
        )
    channel.timeout = timeout
    channel.worker_options = WorkerOptions.coerce(worker_options)
    if kept is None:
        async with channel:
            return await channel.update(weights, pipeline=pipeline)
    return await channel.update(weights, pipeline=pipeline)
