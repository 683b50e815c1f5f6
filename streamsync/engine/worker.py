"""The worker side of the engine seam: receivers an engine worker keeps across syncs.

Engine workers are called synchronously, once per sync (vLLM's ``collective_rpc``).
Transports keep sockets and slots open across syncs and those belong to one event loop, so
every receive of a worker runs on the same long-lived loop, in a daemon thread behind an
anyio blocking portal (:class:`EventLoopThread`). The sink's phases run on that thread, so it
selects the worker's device first: CUDA's current device is per thread, and a copy made on
a thread that never chose one lands on device 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import anyio
import torch

from streamsync._log import log, warn
from streamsync.engine.loops import EventLoopThread
from streamsync.engine.messages import Route, WorkerOptions, WorkerResult
from streamsync.errors import ConfigError, EndOfStream, PeerBrokenError, StreamsyncError
from streamsync.report import SyncReport
from streamsync.sink import AbortableSink, Sink
from streamsync.sync import DEFAULT_TIMEOUT, receive
from streamsync.transports import open_receiver
from streamsync.transports.base import Receiver

__all__ = ["WorkerReceivers"]


def select_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device (CUDA's is per thread; a CPU
    device needs nothing)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


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
                receiver.state.abandoned = True
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

        try:
            report = self._loop.run(
                run, timeout=timeout * 4, what=f"worker-side sync from {endpoint}"
            )
        except StreamsyncError as exc:
            self._abort(sink, endpoint)
            return WorkerResult.failed(exc)
        except Exception:
            self._abort(sink, endpoint)
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
        """Close every receiver and stop the loop thread."""
        with contextlib.suppress(StreamsyncError, RuntimeError):
            self.close()
        self._loop.stop()

    def __repr__(self) -> str:
        return f"WorkerReceivers(endpoints={list(self._receivers)!r})"
