"""``named_tensors(obj)``: turn a model, a mapping or an iterable of pairs into the core
stream type, lazily, one tensor at a time."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

import torch

from streamsync.adapter import NamedTensor

__all__ = ["named_tensors"]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2, tensor parallel) is gathered here, one parameter at a time.
    full_tensor = getattr(tensor, "full_tensor", None)
    if full_tensor is not None:
        tensor = full_tensor()
    return tensor.detach() if tensor.requires_grad else tensor


async def _from_module(module: torch.nn.Module) -> AsyncIterator[NamedTensor]:
    # state_dict(keep_vars=True) only collects references: parameters and persistent
    # buffers by their state-dict names, nothing is copied until a tensor is consumed.
    for name, tensor in module.state_dict(keep_vars=True).items():
        yield name, _full(tensor)


async def _from_iterable(pairs: Iterable[Any]) -> AsyncIterator[NamedTensor]:
    for item in pairs:
        yield _check(item)


async def _from_async(pairs: AsyncIterable[Any]) -> AsyncIterator[NamedTensor]:
    iterator = aiter(pairs)
    try:
        async for item in iterator:
            yield _check(item)
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


def _check(item: Any) -> NamedTensor:
    try:
        name, tensor = item
    except (TypeError, ValueError):
        raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}") from None
    if not isinstance(name, str):
        raise TypeError(f"tensor name {name!r} is a {type(name).__name__}, not a str")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return name, _full(tensor)


def named_tensors(obj: Any) -> AsyncIterator[NamedTensor]:
    """An async stream of ``(name, tensor)`` from:

    - an ``nn.Module``: parameters and persistent buffers, by state-dict name
      (DTensor parameters are gathered one at a time);
    - a mapping of names to tensors;
    - a sync or async iterable of ``(name, tensor)`` pairs.
    """
    if isinstance(obj, torch.nn.Module):
        return _from_module(obj)
    if isinstance(obj, Mapping):
        return _from_iterable(obj.items())
    if isinstance(obj, AsyncIterable):
        return _from_async(obj)
    if isinstance(obj, Iterable) and not isinstance(obj, str | bytes | torch.Tensor):
        return _from_iterable(obj)
    raise TypeError(
        f"named_tensors() takes an nn.Module, a mapping of tensors or an iterable of "
        f"(name, tensor) pairs, not {type(obj).__name__}"
    )
