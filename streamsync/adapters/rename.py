"""``rename(mapping_or_fn)``: change tensor names on the way."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Any

from streamsync.adapter import Adapter, NamedTensor, reading

__all__ = ["Rename", "rename"]


class Rename(Adapter):
    """Renames tensors with a function, or with a mapping (names it lacks pass unchanged)."""

    def __init__(self, how: Mapping[str, str] | Callable[[str], str]) -> None:
        if isinstance(how, Mapping):
            table = dict(how)
            self.how: Callable[[str], str] = lambda name: table.get(name, name)
        elif callable(how):
            self.how = how
        else:
            raise TypeError(f"rename() takes a mapping or a function, not {type(how).__name__}")

    async def _run(self, source: AsyncIterable[NamedTensor]) -> AsyncIterator[NamedTensor]:
        async with reading(source) as items:
            async for name, tensor in items:
                new = self.how(name)
                if not isinstance(new, str):
                    raise TypeError(f"rename() turned tensor {name!r} into {new!r}, not a str")
                yield new, tensor

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return self._run(source)


def rename(how: Mapping[str, str] | Callable[[str], str]) -> Rename:
    """Rename tensors by a mapping or a function of the name."""
    return Rename(how)
