"""Adapters: callables from an async iterable of items to an async iterator of items.

``a | b`` composes (``a`` first) and the result is itself an adapter; a plain function with
the adapter signature composes too, on either side of ``|``. Every adapter reads its source
through :func:`reading`, which closes the source when the adapter stops early, so an
abandoned pipeline releases what its source holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import torch

__all__ = ["Adapter", "AdapterLike", "Chain", "NamedTensor", "NamedTensors", "reading"]

NamedTensor: TypeAlias = tuple[str, torch.Tensor]
#: The one core type: an async stream of named tensors.
NamedTensors: TypeAlias = AsyncIterator[NamedTensor]
AdapterLike: TypeAlias = Callable[[AsyncIterable[Any]], AsyncIterator[Any]]


@asynccontextmanager
async def reading(source: AsyncIterable[Any]) -> AsyncIterator[AsyncIterator[Any]]:
    """Iterate ``source`` and close it on the way out, however the way out is taken."""
    iterator = aiter(source)
    try:
        yield iterator
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


class Adapter:
    """Base class of adapters: subclasses keep their configuration from ``__init__`` and do
    the work in ``__call__(source)``."""

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        raise NotImplementedError

    def fuse(self, following: Adapter) -> Adapter | None:
        """An adapter doing the work of ``self | following`` in one pass, if this adapter
        knows one; ``None`` otherwise."""
        return None

    def __or__(self, other: AdapterLike) -> Chain:
        return Chain(self, other)

    def __ror__(self, other: AdapterLike) -> Chain:
        return Chain(other, self)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class Chain(Adapter):
    """Adapters applied in order; adjacent ones that can fuse are fused."""

    def __init__(self, *stages: AdapterLike) -> None:
        flat: list[AdapterLike] = []
        for stage in stages:
            if not callable(stage):
                raise TypeError(f"{stage!r} is not an adapter (a callable on an async iterable)")
            flat.extend(stage.stages if isinstance(stage, Chain) else (stage,))
        fused: list[AdapterLike] = []
        for stage in flat:
            if fused and isinstance(fused[-1], Adapter) and isinstance(stage, Adapter):
                merged = fused[-1].fuse(stage)
                if merged is not None:
                    fused[-1] = merged
                    continue
            fused.append(stage)
        self.stages: tuple[AdapterLike, ...] = tuple(fused)

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        stream: AsyncIterable[Any] = source
        for stage in self.stages:
            stream = stage(stream)
        return aiter(stream)

    def __repr__(self) -> str:
        return " | ".join(repr(s) for s in self.stages)
