"""``select(pred)``: keep only the tensors whose names a predicate accepts."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from streamsync.pipeline import NamedTensor, adapter


def _configure(pred: Callable[[str], bool]) -> dict[str, Any]:
    if not callable(pred):
        raise TypeError(f"select() takes a predicate on names, not {type(pred).__name__}")
    return {"pred": pred}


@adapter(configure=_configure)
async def select(
    source: AsyncIterable[NamedTensor], *, pred: Callable[[str], bool]
) -> AsyncIterator[NamedTensor]:
    """``select(pred)``: keeps the tensors for which ``pred(name)`` is true; the rest are
    dropped unread."""
    async for name, tensor in source:
        if pred(name):
            yield name, tensor
