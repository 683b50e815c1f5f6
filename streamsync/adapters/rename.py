"""``rename(mapping_or_fn)``: change tensor names on the way."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Any

from streamsync.pipeline import NamedTensor, adapter


def _configure(how: Mapping[str, str] | Callable[[str], str]) -> dict[str, Any]:
    if isinstance(how, Mapping):
        table = dict(how)
        return {"how": lambda name: table.get(name, name)}
    if callable(how):
        return {"how": how}
    raise TypeError(f"rename() takes a mapping or a function, not {type(how).__name__}")


@adapter(configure=_configure)
async def rename(
    source: AsyncIterable[NamedTensor], *, how: Callable[[str], str]
) -> AsyncIterator[NamedTensor]:
    """``rename(how)``: renames tensors with a function, or with a mapping (names it lacks
    pass unchanged)."""
    async for name, tensor in source:
        new = how(name)
        if not isinstance(new, str):
            raise TypeError(f"rename() turned tensor {name!r} into {new!r}, not a str")
        yield new, tensor
