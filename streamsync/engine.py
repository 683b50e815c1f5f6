"""The engine seam: how a trainer-side channel drives the workers of an inference engine.

An engine is reached through an :class:`EngineClient`: how many receivers it has, how to run
the receive on every worker (beside the send), what to do after a sync (drop what the old
weights computed, such as a prefix cache) and how to close the workers' receivers. Workers
answer with one :class:`WorkerResult` each; the options they get are a
:class:`WorkerOptions`. Both are versioned msgspec structs that cross the engine's RPC as
plain values (``to_wire`` / ``from_wire``), never pickled.

:class:`WeightSync` is the engine-agnostic channel: it runs the send beside the client's
receive, merges the workers' reports and re-raises a worker's error under its own name. The
worker side keeps its receivers in a :class:`streamsync.worker.WorkerReceivers`. A second
engine is one client plus one sink; vLLM's are :mod:`streamsync.vllm.client` and
:class:`streamsync.vllm.sink.VllmSink`.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.lowlevel
import msgspec

from streamsync._log import log, warn
from streamsync.adapter import AdapterLike
from streamsync.errors import (
    ClosedError,
    ConfigError,
    PeerBrokenError,
    ProtocolVersionError,
    ReceiverFailedError,
    StreamsyncError,
    SyncTimeoutError,
    WireFormatError,
    error_class,
)
from streamsync.report import SyncReport
from streamsync.sync import DEFAULT_TIMEOUT, send
from streamsync.transports import Sender, open_sender

__all__ = [
    "WORKER_PROTOCOL",
    "EngineClient",
    "WeightSync",
    "WorkerOptions",
    "WorkerResult",
    "merge_worker_reports",
    "update_engine",
    "worker_failure",
]

#: Version of :class:`WorkerOptions` and :class:`WorkerResult` on the engine's RPC; a worker
#: and a trainer that disagree fail with :class:`~streamsync.ProtocolVersionError`.
WORKER_PROTOCOL = 1


def _check_version(kind: str, data: object) -> None:
    version = data.get("version", WORKER_PROTOCOL) if isinstance(data, Mapping) else None
    if version != WORKER_PROTOCOL:
        raise ProtocolVersionError(
            f"{kind} of protocol version {version!r}; this streamsync speaks "
            f"{WORKER_PROTOCOL}: install the same streamsync on the trainer and the engine"
        )


class WorkerOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the trainer tells every worker for one sync (``worker_options=`` of
    :class:`WeightSync`, as this struct or as a mapping of its fields)."""

    version: int = WORKER_PROTOCOL
    #: Seconds for each wait of the receive; ``None``: the channel's ``timeout``.
    timeout: float | None = None
    #: Keyword arguments of :func:`~streamsync.open_receiver` on the worker.
    transport: dict[str, Any] = {}
    #: The sink's lifecycle by registered name; ``None``: the best the engine offers.
    lifecycle: str | None = None
    #: The sink's quirks by registered name; ``None``: those the engine needs, ``()``: none.
    quirks: tuple[str, ...] | None = None
    #: Only these model instances (``"main"``, ``"drafter"``); ``None``: all of them.
    instances: tuple[str, ...] | None = None

    @classmethod
    def coerce(cls, options: WorkerOptions | Mapping[str, Any] | None) -> WorkerOptions:
        """``options`` as a struct: a mapping must name only this struct's fields."""
        if isinstance(options, WorkerOptions):
            return options
        try:
            return msgspec.convert(dict(options or {}), cls)
        except msgspec.ValidationError as exc:
            fields = ", ".join(f for f in cls.__struct_fields__ if f != "version")
            raise ConfigError(f"worker_options: {exc}; valid options: {fields}") from None

    def to_wire(self) -> dict[str, Any]:
        """Plain values for the engine's RPC."""
        return msgspec.to_builtins(self, builtin_types=(bytes, bytearray))  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls, data: object) -> WorkerOptions:
        """The struct a worker received (``None``: the defaults)."""
        if isinstance(data, WorkerOptions) or data is None:
            return data or cls()
        _check_version("worker options", data)
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise WireFormatError(f"worker options from the trainer: {exc}") from None


class WorkerResult(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's outcome of one sync: its receiver's report, or the error it hit (by
    class name, with the partial report), so that a failed sync never takes the engine
    down and the trainer re-raises the worker's own exception class."""

    version: int = WORKER_PROTOCOL
    pid: int
    #: The receiver's report (partial, or ``None`` if nothing was received, on failure).
    report: SyncReport | None = None
    #: Class name of the :class:`~streamsync.StreamsyncError` the worker hit.
    error: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def succeeded(cls, report: SyncReport) -> WorkerResult:
        return cls(pid=os.getpid(), report=report)

    @classmethod
    def failed(cls, exc: StreamsyncError) -> WorkerResult:
        return cls(pid=os.getpid(), report=exc.report, error=type(exc).__name__, message=str(exc))

    def exception(self, rank: int) -> StreamsyncError | None:
        """The worker's error, re-created on this side (``None`` if it succeeded)."""
        if self.error is None:
            return None
        exc = error_class(self.error, ReceiverFailedError)(
            f"worker {rank} (pid {self.pid}): {self.message}"
        )
        exc.report = self.report
        return exc

    def to_wire(self) -> dict[str, Any]:
        """Plain values for the engine's RPC."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls, data: object, *, rank: int = 0) -> WorkerResult:
        """The struct from what the engine's RPC returned for worker ``rank``."""
        if isinstance(data, WorkerResult):
            return data
        _check_version(f"worker {rank}'s result", data)
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise WireFormatError(f"worker {rank}'s result: {exc}") from None


@runtime_checkable
class EngineClient(Protocol):
    """The trainer's handle on one inference engine (see :mod:`streamsync.vllm.client`)."""

    @property
    def receivers(self) -> int:
        """How many receivers (workers) a sync reaches."""

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        """Run one receive from ``endpoint`` on every worker (started beside the send);
        returns each worker's result, by rank."""

    async def after_sync(self) -> None:
        """After a sync that every worker applied: drop what the old weights computed."""

    async def close_receivers(self, endpoint: str) -> int:
        """Close the workers' receivers for ``endpoint``; returns how many were open."""


def worker_failure(results: Sequence[WorkerResult]) -> StreamsyncError | None:
    """The first failed worker's error, by rank, or ``None``."""
    for rank, result in enumerate(results):
        exc = result.exception(rank)
        if exc is not None:
            return exc
    return None


def merge_worker_reports(report: SyncReport, results: Sequence[WorkerResult]) -> SyncReport:
    """The sender's ``report`` with each worker's model instances, as ``worker<rank>.<name>``."""
    instances = {
        f"worker{rank}.{name}": inst
        for rank, result in enumerate(results)
        if result.report is not None
        for name, inst in result.report.instances.items()
    }
    return msgspec.structs.replace(report, instances=instances)


class WeightSync:
    """A persistent trainer-side channel into one engine: the transport's slots and sockets
    are created once and reused by every :meth:`update`; the workers keep theirs too."""

    def __init__(
        self,
        client: EngineClient,
        endpoint: str,
        *,
        pipeline: AdapterLike | None = None,
        bucket_bytes: int = 64 << 20,
        timeout: float = DEFAULT_TIMEOUT,
        checksum: bool = False,
        worker_options: WorkerOptions | Mapping[str, Any] | None = None,
        **transport_options: Any,
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.pipeline = pipeline
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.checksum = checksum
        self.worker_options = WorkerOptions.coerce(worker_options)
        self._transport_options = transport_options
        self._sender: Sender | None = None

    async def __aenter__(self) -> WeightSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the trainer side, then ask the workers to close theirs (best effort: the
        engine may be gone). A later :meth:`update` reopens both."""
        await self._close_sender()
        try:
            with anyio.fail_after(self.timeout):
                closed = await self.client.close_receivers(self.endpoint)
        except Exception as exc:  # the engine shut down first, or its RPC failed
            warn("engine.close_receivers_failed", endpoint=self.endpoint, error=repr(exc))
        else:
            log("engine.close", endpoint=self.endpoint, receivers=closed)

    async def _close_sender(self) -> None:
        if self._sender is not None:
            sender, self._sender = self._sender, None
            await sender.aclose()

    async def _ensure_sender(self) -> Sender:
        if self._sender is None:
            opts = dict(self._transport_options)
            opts.setdefault("receivers", self.client.receivers)
            opts.setdefault("slot_bytes", self.bucket_bytes)
            sender = open_sender(self.endpoint, **opts)
            await sender.open()
            self._sender = sender
        return self._sender

    async def update(self, weights: Any, *, pipeline: AdapterLike | None = None) -> SyncReport:
        """Stream ``weights`` into every worker; returns the sender's report with one
        :class:`~streamsync.LoadResult` per worker and model instance in ``instances``.
        ``pipeline`` overrides the channel's for this sync. A worker's failure is raised
        as the worker's own exception class, with its partial report."""
        sender = await self._ensure_sender()
        options = self.worker_options
        if options.timeout is None:
            options = msgspec.structs.replace(options, timeout=self.timeout)
        results: list[WorkerResult] = []
        report: SyncReport | None = None
        send_error: StreamsyncError | None = None

        async def receive() -> None:
            limit = self.timeout * 5
            try:
                with anyio.fail_after(limit):
                    results.extend(await self.client.start_receive(self.endpoint, options))
            except TimeoutError:
                raise SyncTimeoutError(
                    f"the engine's workers did not report on the sync from {self.endpoint} "
                    f"within {limit:g} s"
                ) from None
            if any(not r.ok and r.report is None for r in results):
                # A worker failed before it applied anything (bad options, no connection):
                # this sync cannot complete, so stop the send instead of letting it time out.
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
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
                if isinstance(exc, PeerBrokenError | ClosedError):
                    await self._close_sender()  # the workers' receive is still running
        if report is None and send_error is None:
            await self._close_sender()  # cancelled mid-sync: its state is unknown
        failure = worker_failure(results)
        if failure is not None:
            raise failure from send_error
        if send_error is not None:
            raise send_error
        assert report is not None
        merged = merge_worker_reports(report, results)
        try:
            with anyio.fail_after(self.timeout):
                await self.client.after_sync()
        except TimeoutError:
            late = SyncTimeoutError(
                f"the engine's after-sync hooks did not finish within {self.timeout:g} s; "
                f"the sync from {self.endpoint} itself completed (exc.report)"
            )
            late.report = merged
            raise late from None
        log("engine.sync", endpoint=self.endpoint, workers=len(results), sync_id=report.sync_id)
        return merged


@dataclass
class _Cached:
    channel: WeightSync
    loop: Callable[[], object | None]


# Per engine, per endpoint: the channels update_engine keeps open. A channel's client refers
# to its engine, so an engine used here stays alive with its channel until the process ends
# (as before this seam); collecting them would need an event loop to close the transport.
_channels: weakref.WeakKeyDictionary[Any, dict[str, _Cached]] = weakref.WeakKeyDictionary()


def _current_loop() -> Callable[[], object | None]:
    """A reference to the running event loop (weak where the loop allows it)."""
    native = anyio.lowlevel.current_token().native_token
    try:
        return weakref.ref(native)
    except TypeError:
        return lambda: native


async def update_engine(
    engine: Any,
    weights: Any,
    *,
    client: Callable[[Any], EngineClient],
    endpoint: str,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int = 64 << 20,
    timeout: float = DEFAULT_TIMEOUT,
    worker_options: WorkerOptions | Mapping[str, Any] | None = None,
    **options: Any,
) -> SyncReport:
    """Sync ``weights`` into ``engine`` through a :class:`WeightSync` on ``client(engine)``
    kept open for (``engine``, ``endpoint``), so its slots and sockets are reused: call it
    from one long-lived event loop (engine packages wrap it as their ``update_weights``)."""
    loop = _current_loop()
    per_engine = _channels.setdefault(engine, {})
    cached = per_engine.get(endpoint)
    if cached is not None and cached.loop() is not loop():
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
        channel = WeightSync(
            client(engine), endpoint, bucket_bytes=bucket_bytes, timeout=timeout, **options
        )
        cached = per_engine[endpoint] = _Cached(channel, loop)
    cached.channel.timeout = timeout
    cached.channel.worker_options = WorkerOptions.coerce(worker_options)
    return await cached.channel.update(weights, pipeline=pipeline)
