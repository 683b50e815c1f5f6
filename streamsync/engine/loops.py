"""Event loops that streamsync owns: a channel's sockets and readers belong to the loop
that opened them, and a trainer that runs each step in a fresh loop, or none, cannot keep
them. :class:`EventLoopThread` is a long-lived anyio loop in a daemon thread;
:class:`HostedSender` a :class:`~streamsync.transports.Sender` that lives on one and is
awaited from any loop.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch
from anyio.from_thread import BlockingPortal

from streamsync.errors import ClosedError, SyncTimeoutError
from streamsync.transports import open_sender
from streamsync.transports.base import Attendance, Sender, SenderStatistics
from streamsync.wire.frames import Abort, Done, End
from streamsync.wire.pack import Bucket

T = TypeVar("T")


def caller_cuda() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The calling thread's current CUDA stream (and so device), as a context manager to
    enter on another thread: a hosted transport then allocates, packs and records its
    events where the caller would have (a trainer's ``torch.cuda.set_device`` and stream
    are per thread). A no-op where CUDA is not initialised."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return contextlib.nullcontext
    stream = torch.cuda.current_stream()
    return lambda: torch.cuda.stream(stream)


class EventLoopThread:
    """One long-lived anyio event loop in a daemon thread, for synchronous callers and for
    callers on other loops.

    Built on a :class:`~anyio.from_thread.BlockingPortal` but not on
    ``start_blocking_portal``, whose context manager joins the thread when it is collected:
    at interpreter exit that join would wait forever on a daemon thread already frozen.
    """

    def __init__(
        self, name: str = "streamsync-loop", *, setup: Callable[[], object] | None = None
    ) -> None:
        """``setup``: run first on the loop's thread (per-thread state such as the CUDA
        device); its error is raised here."""
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def main() -> None:
            if setup is not None:
                try:
                    setup()
                except BaseException as exc:
                    ready.set_exception(exc)
                    return
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        self._thread = threading.Thread(target=anyio.run, args=(main,), name=name, daemon=True)
        self._thread.start()
        self._portal: BlockingPortal | None = ready.result(timeout=30)

    @property
    def name(self) -> str:
        return self._thread.name

    def is_current(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def _require_portal(self) -> BlockingPortal:
        if self._portal is None:
            raise ClosedError(f"{self._thread.name}: the event loop thread was stopped")
        return self._portal

    def run(self, fn: Callable[[], Awaitable[T]], *, timeout: float, what: str = "call") -> T:
        """Run ``fn()`` on the loop and block until its result (at most ``timeout`` seconds;
        then it is cancelled). Not from this loop's own thread."""
        return self.wait(self.start(fn), timeout=timeout, what=what)

    def start(self, fn: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Start ``fn()`` on the loop without waiting for it; :meth:`wait` takes its result."""
        return self._require_portal().start_task_soon(fn)

    def wait(
        self, future: concurrent.futures.Future[T], *, timeout: float, what: str = "call"
    ) -> T:
        """Block until ``future`` (of :meth:`start`) is done, at most ``timeout`` seconds
        (then it is cancelled); its result. Not from this loop's own thread."""
        if self.is_current():
            raise RuntimeError(f"{self.name}: waiting from the loop's own thread would deadlock")
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:
            future.cancel()
            raise SyncTimeoutError(f"{what} did not finish within {timeout:g} s")
        return future.result()

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` running on this loop, from any event loop (or this one).

        The caller's loop waits in a worker thread; cancelling the caller cancels ``fn``.
        """
        if self.is_current():
            return await fn(*args)
        future = self._require_portal().start_task_soon(fn, *args)
        try:
            return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
        except concurrent.futures.CancelledError:
            raise ClosedError(f"{self.name}: the event loop thread was stopped") from None
        finally:
            future.cancel()  # no-op once done; cancels fn if the caller was cancelled

    def stop(self, timeout: float = 10) -> None:
        """Cancel what still runs on the loop and end its thread."""
        portal, self._portal = self._portal, None
        if portal is not None:
            portal.start_task_soon(portal.stop, True)
            if not self.is_current():
                self._thread.join(timeout)

    def close_soon(self, *closers: Callable[[], Awaitable[object]]) -> None:
        """Run ``closers`` on the loop (errors ignored), then stop it; returns at once, so it
        is safe from any thread, a finalizer or the loop's own."""
        portal, self._portal = self._portal, None
        if portal is None:
            return

        async def close_then_stop() -> None:
            for close in closers:
                # Best effort: nobody is left to tell.
                with contextlib.suppress(Exception), anyio.fail_after(10):
                    await close()
            await portal.stop(cancel_remaining=True)

        with contextlib.suppress(RuntimeError):  # the loop already ended (interpreter exit)
            portal.start_task_soon(close_then_stop)


class HostedSender(Sender):
    """A :class:`~streamsync.transports.Sender` that lives on an :class:`EventLoopThread`:
    every call is awaited from the caller's loop (any loop), and runs on the host's, under
    the caller's CUDA stream (:func:`caller_cuda`). The source, the adapters and the
    bucketer stay on the caller's loop; the transport's sockets, slots and readers stay on
    the host's for as long as the sender is open."""

    def __init__(self, sender: Sender, loop: EventLoopThread) -> None:
        """``sender``: open, on ``loop`` (:meth:`open_on`)."""
        self.sender = sender
        self.loop = loop
        self.slot_bytes = sender.slot_bytes
        self._running = 0  # calls running on the host's loop (touched only there)

    @classmethod
    async def open_on(
        cls, loop: EventLoopThread, endpoint: str, options: dict[str, Any]
    ) -> HostedSender:
        """A sender for ``endpoint``, made and opened on ``loop`` (which keeps its sockets
        and readers), on the caller's CUDA device (a cuda-ipc ring is allocated there)."""
        cuda = caller_cuda()

        async def opened() -> Sender:
            with cuda():
                sender = open_sender(endpoint, **options)
                await sender.open()
            return sender

        return cls(await loop.call(opened), loop)

    async def _hosted(self, fn: Callable[[], Awaitable[T]]) -> T:
        cuda = caller_cuda()

        async def run() -> T:
            self._running += 1
            try:
                with cuda():
                    return await fn()
            finally:
                self._running -= 1

        return await self.loop.call(run)

    async def settle(self, timeout: float = 10.0) -> bool:
        """Wait until no call runs on the host's loop any more (a caller that was cancelled
        returns before its call has unwound there); False if one still runs after
        ``timeout`` seconds."""

        async def idle() -> bool:
            with anyio.move_on_after(timeout):
                while self._running:
                    await anyio.sleep(0.005)
            return not self._running

        return await self.loop.call(idle)

    async def aclose(self) -> None:
        self._closed = True
        await self._hosted(self.sender.aclose)

    async def wait_ready(self, *, timeout: float) -> None:
        await self._hosted(partial(self.sender.wait_ready, timeout=timeout))

    def statistics(self) -> SenderStatistics | None:
        return self.sender.statistics()  # a snapshot of plain numbers

    def attendance(self) -> Attendance:
        return self.sender.attendance()  # frozen

    @property
    def receivers(self) -> int:
        return self.sender.receivers  # learned from its first receiver, with receivers=0

    @receivers.setter
    def receivers(self, count: int) -> None:
        self.sender.receivers = count

    def introductions(self) -> dict[int, bytes]:
        return self.sender.introductions()  # copies made without yielding the GIL

    @property
    def present(self) -> int:
        return self.sender.present

    def seal(self) -> None:
        self.sender.seal()  # a flag its loop reads at the next newcomer

    async def begin(self, sync_id: int, *, timeout: float) -> dict[int, int | None]:
        return await self._hosted(partial(self.sender.begin, sync_id, timeout=timeout))

    async def forget(self, sync_id: int) -> None:
        await self._hosted(partial(self.sender.forget, sync_id))

    async def send(
        self, sync_id: int, seq: int, bucket: Bucket, *, timeout: float, checksum: bool = False
    ) -> None:
        await self._hosted(
            partial(self.sender.send, sync_id, seq, bucket, timeout=timeout, checksum=checksum)
        )

    async def end(self, end: End, *, timeout: float) -> list[Done]:
        return await self._hosted(partial(self.sender.end, end, timeout=timeout))

    async def abort(self, abort: Abort) -> None:
        await self._hosted(partial(self.sender.abort, abort))

    def __repr__(self) -> str:
        return f"HostedSender({self.sender!r}, loop={self.loop.name!r})"
