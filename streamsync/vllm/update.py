"""The trainer side: ``update_weights(llm, weights, endpoint=..., pipeline=...)``.

It starts the receive on every worker through ``collective_rpc`` (in a thread for ``LLM``,
as a task for ``AsyncLLM``, so the sender is not blocked), streams the weights, waits for
every worker's report, and resets the prefix cache (what the old weights computed).
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

import streamsync.errors as errors
from streamsync.adapter import AdapterLike
from streamsync.errors import ConfigError, ReceiverFailedError, StreamsyncError
from streamsync.report import LoadResult, SyncReport
from streamsync.sync import DEFAULT_TIMEOUT, send
from streamsync.transports import Sender, open_sender

__all__ = ["WeightSync", "update_weights", "world_size"]

_RPC = "streamsync_receive"


def _vllm_config(llm: Any) -> Any:
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "vllm_config", None) or getattr(llm, "vllm_config", None)
    if config is None:
        raise ConfigError(f"{type(llm).__name__} is not a vLLM LLM or AsyncLLM (no vllm_config)")
    return config


def world_size(llm: Any) -> int:
    """How many workers (receivers) an engine has."""
    return int(_vllm_config(llm).parallel_config.world_size)


def _is_async(llm: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(llm, "collective_rpc", None))


class WeightSync:
    """A persistent trainer-side channel into one engine: the transport's slots and sockets
    are created once and reused by every :meth:`update`."""

    def __init__(
        self,
        llm: Any,
        endpoint: str,
        *,
        pipeline: AdapterLike | None = None,
        bucket_bytes: int = 64 << 20,
        timeout: float = DEFAULT_TIMEOUT,
        checksum: bool = False,
        worker_options: dict[str, Any] | None = None,
        **transport_options: Any,
    ) -> None:
        self.llm = llm
        self.endpoint = endpoint
        self.pipeline = pipeline
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.checksum = checksum
        self.worker_options = dict(worker_options or {})
        self._transport_options = transport_options
        self._sender: Sender | None = None

    async def __aenter__(self) -> WeightSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the trainer side; workers reconnect on the next sync."""
        if self._sender is not None:
            sender, self._sender = self._sender, None
            await sender.aclose()

    async def _ensure_sender(self) -> Sender:
        if self._sender is None:
            opts = dict(self._transport_options)
            opts.setdefault("receivers", world_size(self.llm))
            opts.setdefault("slot_bytes", self.bucket_bytes)
            sender = open_sender(self.endpoint, **opts)
            await sender.open()
            self._sender = sender
        return self._sender

    async def _rpc(self) -> list[Any]:
        options = {"timeout": self.timeout, **self.worker_options}
        args = (self.endpoint, options)
        if _is_async(self.llm):
            return list(await self.llm.collective_rpc(_RPC, args=args))
        return list(
            await anyio.to_thread.run_sync(
                lambda: self.llm.collective_rpc(_RPC, args=args), abandon_on_cancel=True
            )
        )

    async def update(self, weights: Any, *, pipeline: AdapterLike | None = None) -> SyncReport:
        """Stream ``weights`` into every worker; returns the sender's report with one
        :class:`LoadResult` per worker and model instance in ``instances``. ``pipeline``
        overrides the channel's for this sync."""
        sender = await self._ensure_sender()
        results: list[Any] = []
        send_error: BaseException | None = None

        async def run_rpc() -> None:
            with anyio.fail_after(self.timeout * 5):
                results.extend(await self._rpc())

        report: SyncReport | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_rpc)
            try:
                report = await send(
                    weights,
                    sender,
                    pipeline=pipeline if pipeline is not None else self.pipeline,
                    bucket_bytes=self.bucket_bytes,
                    timeout=self.timeout,
                    checksum=self.checksum,
                )
            except StreamsyncError as exc:
                send_error = exc
                if isinstance(exc, errors.PeerBrokenError | errors.ClosedError):
                    await self.aclose()
        failure = _worker_failure(results)
        if failure is not None:
            raise failure from send_error
        if send_error is not None:
            raise send_error
        assert report is not None
        await self._reset_prefix_cache()
        instances: dict[str, LoadResult] = {}
        for rank, result in enumerate(results):
            for name, inst in (result["report"].get("instances") or {}).items():
                instances[f"worker{rank}.{name}"] = LoadResult(
                    loaded=tuple(inst.get("loaded", ())), missing=tuple(inst.get("missing", ()))
                )
        import msgspec

        return msgspec.structs.replace(report, instances=instances)

    async def _reset_prefix_cache(self) -> None:
        if _is_async(self.llm):
            await self.llm.reset_prefix_cache()
        else:
            await anyio.to_thread.run_sync(self.llm.reset_prefix_cache)


def _worker_failure(results: list[Any]) -> StreamsyncError | None:
    for rank, result in enumerate(results):
        if not result.get("ok"):
            cls = getattr(errors, str(result.get("error")), None)
            if not (isinstance(cls, type) and issubclass(cls, StreamsyncError)):
                cls = ReceiverFailedError
            exc = cls(f"worker {rank} (pid {result.get('pid')}): {result.get('message')}")
            partial = result.get("report")
            if partial is not None:
                import msgspec

                exc.report = msgspec.convert(partial, SyncReport)
            return exc
    return None


@dataclass
class _Cached:
    channel: WeightSync
    loop: weakref.ReferenceType[asyncio.AbstractEventLoop]


# Per engine (dropped with it), per endpoint.
_channels: weakref.WeakKeyDictionary[Any, dict[str, _Cached]] = weakref.WeakKeyDictionary()


async def update_weights(
    llm: Any,
    weights: Any,
    *,
    endpoint: str,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int = 64 << 20,
    timeout: float = DEFAULT_TIMEOUT,
    **options: Any,
) -> SyncReport:
    """Sync ``weights`` into every worker (and model instance) of ``llm``.

    The channel for (``llm``, ``endpoint``) is kept open for later calls, so its slots and
    sockets are reused: call it from one long-lived event loop. To manage the channel
    yourself (or to run each step in a fresh loop), use :class:`WeightSync`.
    """
    worker_options = dict(options.pop("worker_options", None) or {})
    loop = asyncio.get_running_loop()
    per_engine = _channels.setdefault(llm, {})
    cached = per_engine.get(endpoint)
    if cached is not None and cached.loop() is not loop:
        # Its sockets belong to another event loop (a caller that runs each step in a fresh
        # loop): they cannot be closed or used from here.
        raise ConfigError(
            f"update_weights: the channel to {endpoint} was opened in another event loop. "
            "Call update_weights from one long-lived loop, or use "
            "'async with WeightSync(llm, endpoint) as sync: await sync.update(weights)' "
            "inside each loop (it closes the channel; workers reconnect)."
        )
    if cached is not None and cached.channel.bucket_bytes != bucket_bytes:
        await cached.channel.aclose()  # its slots have another size
        cached = None
    if cached is None:
        channel = WeightSync(llm, endpoint, bucket_bytes=bucket_bytes, timeout=timeout, **options)
        cached = per_engine[endpoint] = _Cached(channel, weakref.ref(loop))
    cached.channel.timeout = timeout
    cached.channel.worker_options = worker_options
    return await cached.channel.update(weights, pipeline=pipeline)
