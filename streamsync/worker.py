"""The worker side of the engine seam: receivers an engine worker keeps across syncs.

Engine workers are called synchronously, once per sync (vLLM's ``collective_rpc``).
Transports keep sockets and slots open across syncs and those belong to one event loop, so
every receive of a worker runs on the same long-lived loop, in a daemon thread behind an
anyio blocking portal (:class:`EventLoopThread`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from streamsync._log import log
from streamsync.engine import WorkerOptions, WorkerResult
from streamsync.errors import EndOfStream, PeerBrokenError, StreamsyncError, SyncTimeoutError
from streamsync.report import SyncReport
from streamsync.sink import Sink
from streamsync.sync import DEFAULT_TIMEOUT, receive
from streamsync.transports import Receiver, open_receiver

T = TypeVar("T")

__all__ = ["EventLoopThread", "WorkerReceivers"]


class EventLoopThread:
    """One long-lived anyio event loop in a daemon thread, for synchronous callers.

    Built on a :class:`~anyio.from_thread.BlockingPortal` but not on
    ``start_blocking_portal``, whose context manager joins the thread when it is collected:
    at interpreter exit that join would wait forever on a daemon thread already frozen.
    """

    def __init__(self, name: str = "streamsync-loop") -> None:
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def main() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        self._thread = threading.Thread(target=anyio.run, args=(main,), name=name, daemon=True)
        self._thread.start()
        self._portal: BlockingPortal | None = ready.result(timeout=30)

    def run(self, fn: Callable[[], Awaitable[T]], *, timeout: float, what: str = "call") -> T:
        """Run ``fn()`` on the loop and wait for its result (at most ``timeout`` seconds;
        then it is cancelled)."""
        if self._portal is None:
            raise RuntimeError(f"{self._thread.name}: the event loop thread was stopped")
        future = self._portal.start_task_soon(fn)
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:
            future.cancel()
            raise SyncTimeoutError(f"{what} did not finish within {timeout:g} s")
        return future.result()

    def stop(self, timeout: float = 10) -> None:
        """Cancel what still runs on the loop and end its thread."""
        portal, self._portal = self._portal, None
        if portal is not None:
            portal.start_task_soon(portal.stop, True)
            self._thread.join(timeout)


class WorkerReceivers:
    """One receiver per endpoint for one engine worker, all on one
    :class:`EventLoopThread`.

    :meth:`receive` and :meth:`close` are plain (blocking) methods for the worker's RPC
    handlers; :meth:`shutdown` closes everything and stops the loop.
    """

    def __init__(self, name: str = "streamsync-worker") -> None:
        self._loop = EventLoopThread(name)
        self._receivers: dict[str, Receiver] = {}

    def receive(self, endpoint: str, options: WorkerOptions, sink: Sink) -> WorkerResult:
        """Receive one sync from ``endpoint`` into ``sink``. A streamsync error is returned in
        the result (with its partial report), not raised: the engine stays up."""
        timeout = options.timeout if options.timeout is not None else DEFAULT_TIMEOUT

        async def once() -> SyncReport:
            receiver = self._receivers.get(endpoint)
            if receiver is None:
                receiver = open_receiver(endpoint, **options.transport)
                await receiver.open()
                self._receivers[endpoint] = receiver
            return await receive(receiver, sink, timeout=timeout)

        async def run() -> SyncReport:
            try:
                return await once()
            except (EndOfStream, PeerBrokenError) as exc:
                # The trainer reopened its side since our last sync: reconnect once, unless
                # this sync had already started applying weights.
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
            return WorkerResult.failed(exc)
        return WorkerResult.succeeded(report)

    def close(self, endpoint: str | None = None) -> int:
        """Close the receiver for ``endpoint`` (or all); returns how many were open."""
        names = [endpoint] if endpoint is not None else list(self._receivers)
        closed = 0
        for name in names:
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
