"""The worker side of the engine seam: receivers an engine worker keeps across syncs.

Engine workers are called synchronously, once per sync (vLLM's ``collective_rpc``).
Transports keep sockets and slots open across syncs and those belong to one event loop, so
every receive of a worker runs on the same long-lived loop, in a daemon thread behind an
anyio blocking portal (:class:`EventLoopThread`). The sink's phases run on that thread, so it
selects the worker's device first: CUDA's current device is per thread, and a copy made on
a thread that never chose one lands on device 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import msgspec
import torch

from streamsync._channel import DEFAULT_TIMEOUT, receiver_state
from streamsync._log import log, warn
from streamsync.engine.loops import EventLoopThread
from streamsync.engine.messages import Route, WorkerOptions, WorkerResult
from streamsync.errors import (
    ConfigError,
    EndOfStream,
    PeerBrokenError,
    ReceiverFailedError,
    StreamsyncError,
)
from streamsync.receiving import receive
from streamsync.report import SyncReport
from streamsync.sink import AbortableSink, Sink
from streamsync.staging import StagingSink
from streamsync.transports import open_receiver
from streamsync.transports.base import Receiver

__all__ = ["WorkerReceivers"]


def select_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device (CUDA's is per thread; a CPU
    device needs nothing)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass
class _Receive:
    """One receive started on a worker's loop."""

    endpoint: str
    sink: Sink
    timeout: float
    future: concurrent.futures.Future[SyncReport]
    sync_id: int | None


class WorkerReceivers:
    """One receiver per endpoint for one engine worker, all on one
    :class:`EventLoopThread`.

    :meth:`handle` and :meth:`close` are plain (blocking) methods for the worker's RPC
    handlers; :meth:`shutdown` closes everything and stops the loop. ``device``: the
    worker's device, made current on the loop's thread (by ``select``) before any sink
    runs there. ``rank``: the worker's rank in its engine, which picks its route in a
    sharded sync.
    """

    def __init__(
        self,
        name: str = "streamsync-worker",
        *,
        device: torch.device | None = None,
        select: Callable[[torch.device], None] = select_device,
        rank: int = 0,
    ) -> None:
        self.rank = rank
        setup = None if device is None else partial(select, device)
        self._loop = EventLoopThread(name, setup=setup)
        self._receivers: dict[str, Receiver] = {}
        #: Per endpoint, whose turn it is to receive (made on the loop, at first use).
        self._turns: dict[str, anyio.Lock] = {}
        #: The staged sync's receive (one at a time), until its commit or drop.
        self._staging: _Receive | None = None

    def handle(
        self,
        endpoint: str,
        options: Any,
        make_sink: Callable[[WorkerOptions, Route | None], Sink],
    ) -> WorkerResult:
        """The worker side of one sync, as every engine's RPC handler runs it: ``options``
        from their wire form (a :class:`WorkerOptions` passes as it is), the sink
        ``make_sink`` builds for them and this worker's route (a sharded sync's, else
        ``None``), then one receive from ``endpoint`` (the route's, when there is one) into
        it. A streamsync error in any step is returned in the result (with its partial
        report), not raised: the engine stays up."""
        started = self._start(endpoint, options, make_sink)
        return started if isinstance(started, WorkerResult) else self._finish(started)

    def stage(
        self,
        endpoint: str,
        options: Any,
        make_sink: Callable[[WorkerOptions, Route | None], Sink],
    ) -> WorkerResult:
        """Start a staged sync (:mod:`streamsync.staging`): as :meth:`handle`, into a
        :class:`~streamsync.staging.StagingSink` around the sink ``make_sink`` builds, but
        returning once the receive is started, so the engine serves while the bytes land.
        A version staged before and not committed is dropped first."""
        self.drop()

        def staging(opts: WorkerOptions, route: Route | None) -> Sink:
            return StagingSink(make_sink(opts, route))

        started = self._start(endpoint, options, staging)
        if isinstance(started, WorkerResult):
            return started
        self._staging = started
        return WorkerResult.started()

    def staged(self, sync_id: int, *, wait: bool = True) -> WorkerResult:
        """The end of staged sync ``sync_id`` (waited for, within the receive's limit): the
        receive's report, or its error (the staging is then dropped). ``wait=False``: at
        once, :meth:`WorkerResult.started` while the receive still runs."""
        found = self._staged(sync_id)
        if isinstance(found, WorkerResult):
            return found
        if not wait and not found.future.done():
            return WorkerResult.started()
        result = self._finish(found)
        if not result.ok:
            self._staging = None
        return result

    def commit(self, sync_id: int) -> WorkerResult:
        """Apply staged sync ``sync_id`` to the model (:meth:`StagingSink.commit`, on the
        loop's thread where the sink's phases run); the staging is gone after, applied or
        not."""
        found = self._staged(sync_id)
        if isinstance(found, WorkerResult):
            return found
        if not found.future.done() or found.future.exception() is not None:
            self._staging = None
            return WorkerResult.failed(
                ConfigError(f"sync {sync_id} is not wholly staged on this worker")
            )
        self._staging = None
        sink = found.sink
        assert isinstance(sink, StagingSink)
        report = found.future.result()
        start = time.perf_counter()
        try:
            result = self._loop.run(
                sink.commit, timeout=found.timeout * 4, what=f"commit of sync {sync_id}"
            )
        except StreamsyncError as exc:
            return WorkerResult.failed(exc)
        except Exception as exc:  # the model's own loader: the worker stays up
            return WorkerResult.failed(
                ReceiverFailedError(f"commit of sync {sync_id}: {type(exc).__name__}: {exc}")
            )
        # ``apply``: the staged version's copy into the model, as this worker timed it.
        phases = {**report.phases, "apply": time.perf_counter() - start}
        return WorkerResult.succeeded(
            msgspec.structs.replace(
                report,
                loaded=result.loaded,
                missing=result.missing,
                instances=result.instances,
                phases=phases,
            )
        )

    def drop(self) -> bool:
        """Drop the staged version, if any (a receive still running is waited for first,
        within its limit); whether there was one."""
        found, self._staging = self._staging, None
        if found is None:
            return False
        with contextlib.suppress(Exception):
            self._finish(found)
        sink = found.sink

        async def run() -> None:
            assert isinstance(sink, StagingSink)
            sink.drop()

        self._loop.run(run, timeout=60, what="drop of a staged version")
        return True

    def _staged(self, sync_id: int) -> _Receive | WorkerResult:
        found = self._staging
        if found is None or found.sync_id != sync_id:
            return WorkerResult.failed(
                ConfigError(
                    f"sync {sync_id} is not staged on this worker (staged: "
                    f"{None if found is None else found.sync_id})"
                )
            )
        return found

    def _start(
        self,
        endpoint: str,
        options: Any,
        make_sink: Callable[[WorkerOptions, Route | None], Sink],
    ) -> _Receive | WorkerResult:
        try:
            opts = WorkerOptions.from_wire(options)
            route = self._route(opts)
            if route is not None:
                endpoint = route.endpoint
            sink = make_sink(opts, route)
        except StreamsyncError as exc:
            receiver = self._receivers.get(endpoint)
            if receiver is not None:
                # This worker sits the sync out; the sender, told, gives it up: its abort
                # is not the next sync's.
                receiver_state(receiver).abandoned = True
            return WorkerResult.failed(exc)
        timeout = opts.timeout if opts.timeout is not None else DEFAULT_TIMEOUT

        async def once() -> SyncReport:
            receiver = await self._open(endpoint, opts.transport)
            return await receive(receiver, sink, timeout=timeout, sync_id=opts.sync_id)

        async def run() -> SyncReport:
            # One receive at a time per endpoint: the receive of a sync the trainer gave up
            # (its RPC abandoned) may still wait for that sync's abort, which comes first;
            # this one waits for it instead of failing with SyncInProgressError.
            async with self._turns.setdefault(endpoint, anyio.Lock()):
                try:
                    return await once()
                except (EndOfStream, PeerBrokenError) as exc:
                    # The trainer reopened its side since our last sync: reconnect once,
                    # unless this sync had already started applying weights.
                    if exc.report is not None and exc.report.loaded:
                        raise
                    old = self._receivers.pop(endpoint, None)
                    if old is not None:
                        await old.aclose()
                    log("worker.reconnect", endpoint=endpoint, reason=type(exc).__name__)
                    return await once()

        return _Receive(endpoint, sink, timeout, self._loop.start(run), opts.sync_id)

    def _finish(self, started: _Receive) -> WorkerResult:
        try:
            report = self._loop.wait(
                started.future,
                timeout=started.timeout * 4,
                what=f"worker-side sync from {started.endpoint}",
            )
        except StreamsyncError as exc:
            self._abort(started.sink, started.endpoint)
            return WorkerResult.failed(exc)
        except Exception:
            self._abort(started.sink, started.endpoint)
            raise
        return WorkerResult.succeeded(report)

    def _route(self, options: WorkerOptions) -> Route | None:
        """This worker's route in a sharded sync (``None`` in any other)."""
        if not options.routes:
            return None
        if self.rank >= len(options.routes):
            raise ConfigError(
                f"worker {self.rank}: the trainer planned routes for {len(options.routes)} "
                "workers of this engine; reopen the channel so it learns this engine's workers"
            )
        return options.routes[self.rank]

    def _abort(self, sink: Sink, endpoint: str) -> None:
        # On the loop thread, where the sink's other phases ran.
        if not isinstance(sink, AbortableSink):
            return

        async def run() -> None:
            sink.abort()

        try:
            self._loop.run(run, timeout=60, what=f"worker-side abort of the sync from {endpoint}")
        except Exception as error:
            warn("worker.abort_failed", endpoint=endpoint, error=repr(error))

    def open(
        self,
        endpoint: str,
        transport: Mapping[str, Any] | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        """Connect the receiver for ``endpoint`` now rather than at the first sync (a wrong
        endpoint or secret fails here); ``transport``: keyword arguments of
        :func:`~streamsync.open_receiver`."""
        self._loop.run(
            partial(self._open, endpoint, dict(transport or {})),
            timeout=timeout,
            what=f"worker-side connect to {endpoint}",
        )

    async def _open(self, endpoint: str, transport: Mapping[str, Any]) -> Receiver:
        receiver = self._receivers.get(endpoint)
        if receiver is None:
            receiver = open_receiver(endpoint, **transport)
            await receiver.open()
            self._receivers[endpoint] = receiver
        return receiver

    def close(self, endpoint: str | None = None) -> int:
        """Close the receiver for ``endpoint`` (or all); returns how many were open."""
        names = [endpoint] if endpoint is not None else list(self._receivers)
        closed = 0
        for name in names:
            self._turns.pop(name, None)
            receiver = self._receivers.pop(name, None)
            if receiver is not None:
                self._loop.run(receiver.aclose, timeout=10, what=f"worker-side close of {name}")
                closed += 1
        return closed

    def shutdown(self) -> None:
        """Drop any staged version, close every receiver and stop the loop thread."""
        with contextlib.suppress(StreamsyncError, RuntimeError):
            self.drop()
            self.close()
        self._loop.stop()

    def __repr__(self) -> str:
        return f"WorkerReceivers(endpoints={list(self._receivers)!r})"
