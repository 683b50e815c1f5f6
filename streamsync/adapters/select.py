"""``select(pred)``: keep only the tensors whose names a predicate accepts."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from streamsync.adapter import Adapter, NamedTensor, reading

__all__ = ["Select", "select"]


class Select(Adapter):
    """Keeps the tensors for which ``pred(name)`` is true; the rest are dropped unread."""

    def __init__(self, pred: Callable[[str], bool]) -> None:
        if not callable(pred):
            raise TypeError(f"select() takes a predicate on names, not {type(pred).__name__}")
        self.pred = pred

    async def _run(self, source: AsyncIterable[NamedTensor]) -> AsyncIterator[NamedTensor]:
        async with reading(source) as items:
            async for name, tensor in items:
                if self.pred(name):
                    yield name, tensor

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return self._run(source)


def select(pred: Callable[[str], bool]) -> Select:
    """Keep only the tensors whose name ``pred`` accepts."""
    return Select(pred)
