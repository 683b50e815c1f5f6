"""The task group a channel owns for its background readers.

A channel outlives the task that opened it (a vLLM worker opens a receiver in one call and
closes it in another), while an anyio task group must be exited by the task that entered
it; so the group is hosted by a task of its own, the one thing anyio has no primitive for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.abc


class ChannelTasks:
    """A task group owned by one channel: ``start()`` it in ``open``, ``start_soon`` the
    readers, ``aclose()`` it in ``aclose`` (from any task). Readers must not raise."""

    def __init__(self) -> None:
        self._group: anyio.abc.TaskGroup | None = None
        self._host: asyncio.Task[None] | None = None
        self._done = anyio.Event()

    async def start(self) -> None:
        """Open the group (its host task runs until :meth:`aclose`)."""
        started = anyio.Event()

        async def host() -> None:
            try:
                async with anyio.create_task_group() as group:
                    self._group = group
                    started.set()
                    await anyio.sleep_forever()
            finally:
                self._group = None
                self._done.set()

        self._host = asyncio.get_running_loop().create_task(host())
        await started.wait()

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the group; dropped if the group is closing."""
        if self._group is not None:
            self._group.start_soon(fn, *args)

    async def aclose(self) -> None:
        """Cancel every task in the group and wait (up to 5 s) until they are gone."""
        if self._host is None:
            return
        if self._group is not None:
            self._group.cancel_scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
            await self._done.wait()
