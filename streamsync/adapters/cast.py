"""``cast(dtype)``: convert floating-point tensors to another dtype on the way."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from streamsync._dtypes import CASTABLE
from streamsync.adapters.bucket import Bucketer
from streamsync.adapters.quantize_fp8 import SCALE_SUFFIX
from streamsync.pipeline import Adapter, NamedTensor, Stage, adapter
from streamsync.wire.pack import CastRule


@dataclass(frozen=True, slots=True)
class _Rule:
    """The dtype to send a tensor as, from its name and dtype alone, or ``None``; equal for
    equal arguments, so a sender recognises the same cast from one sync to the next."""

    dtype: torch.dtype
    only: Callable[[str], bool] | None

    def __call__(self, name: str, source: torch.dtype) -> torch.dtype | None:
        # Block scales (``*_scale_inv``) must stay float32 for their fp8 weights.
        if source not in CASTABLE or source == self.dtype or name.endswith(SCALE_SUFFIX):
            return None
        return None if self.only is not None and not self.only(name) else self.dtype


def _configure(dtype: torch.dtype, *, only: Callable[[str], bool] | None = None) -> dict[str, Any]:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"cast(dtype): {dtype!r} is not a torch.dtype")
    return {"rule": _Rule(dtype, only)}


def _into_bucket(stage: Stage, following: Adapter) -> Adapter | None:
    return following.casting(stage.rule) if isinstance(following, Bucketer) else None


@adapter(configure=_configure, fuse=_into_bucket)
async def cast(source: AsyncIterable[NamedTensor], *, rule: CastRule) -> AsyncIterator[NamedTensor]:
    """``cast(dtype, *, only=None)``: casts every tensor of dtype float64/32/16 or bfloat16
    whose name ``only`` accepts (all, by default) to ``dtype``. Integer, bool and fp8 tensors
    pass untouched, and so do quantization scales (names ending in ``_scale_inv``), which
    must stay float32.

    Followed directly by the bucketer (``cast(...) | bucket(...)``, or ``pipeline=`` of
    :func:`streamsync.send`), the conversion is fused into the packing copy, with the same
    bytes as unfused.
    """
    async for name, tensor in source:
        dtype = rule(name, tensor.dtype)
        yield name, tensor if dtype is None else tensor.to(dtype)
