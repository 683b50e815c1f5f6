"""``cast(dtype)``: convert floating-point tensors to another dtype on the way."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import torch

from streamsync.adapter import Adapter, NamedTensor, reading

__all__ = ["Cast", "cast"]

# Casting fp8 or integer tensors would destroy quantized weights and indices.
_CASTABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
# ...and so would casting their float32 block scales (``quantize_fp8`` emits ``*_scale_inv``).
_SCALE_SUFFIX = "_scale_inv"


class Cast(Adapter):
    """Casts every tensor of dtype float64/32/16 or bfloat16 whose name ``only`` accepts
    (all, by default) to ``dtype``. Integer, bool and fp8 tensors pass untouched, and so do
    quantization scales (names ending in ``_scale_inv``), which must stay float32.

    Followed directly by the bucketer (``cast(...) | bucket(...)``, or ``pipeline=`` of
    :func:`streamsync.send`), the conversion is fused into the packing copy.
    """

    def __init__(self, dtype: torch.dtype, *, only: Callable[[str], bool] | None = None) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"cast(dtype): {dtype!r} is not a torch.dtype")
        self.dtype = dtype
        self.only = only

    def target(self, name: str, tensor: torch.Tensor) -> torch.dtype | None:
        """The dtype ``tensor`` should travel as, or ``None`` to leave it alone."""
        if tensor.dtype not in _CASTABLE or tensor.dtype == self.dtype:
            return None
        if name.endswith(_SCALE_SUFFIX):
            return None
        if self.only is not None and not self.only(name):
            return None
        return self.dtype

    async def _run(self, source: AsyncIterable[NamedTensor]) -> AsyncIterator[NamedTensor]:
        async with reading(source) as items:
            async for name, tensor in items:
                dtype = self.target(name, tensor)
                yield name, tensor if dtype is None else tensor.to(dtype)

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return self._run(source)

    def fuse(self, following: Adapter) -> Adapter | None:
        from streamsync.adapters.bucket import Bucketer

        if isinstance(following, Bucketer):
            return following.with_cast(self.target)
        return None


def cast(dtype: torch.dtype, *, only: Callable[[str], bool] | None = None) -> Cast:
    """Cast floating-point tensors (those ``only`` accepts) to ``dtype``."""
    return Cast(dtype, only=only)
