"""A persistent event loop in a daemon thread, for sync callers such as vLLM workers.

Transports keep sockets and slots open across syncs; those belong to one event loop, so a
worker that is called synchronously once per sync runs every receive on this same loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from streamsync.errors import SyncTimeoutError

T = TypeVar("T")

__all__ = ["LoopThread"]


class LoopThread:
    """Runs coroutines on one long-lived asyncio loop owned by a daemon thread."""

    def __init__(self, name: str = "streamsync-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], Awaitable[T]], *, timeout: float) -> T:
        """Run ``fn()`` on the loop and wait for its result (at most ``timeout`` seconds)."""

        async def main() -> T:
            return await fn()

        future = asyncio.run_coroutine_threadsafe(main(), self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise SyncTimeoutError(
                f"worker-side sync did not finish within {timeout:g} s"
            ) from None

    def close(self) -> None:
        """Stop the loop and its thread."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()
