"""``named_tensors(obj)``: turn a model, a mapping or an iterable of pairs into the core
stream type, lazily, one tensor at a time."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import torch

from streamsync._peft import base_name, is_peft_model
from streamsync.errors import ConfigError
from streamsync.pipeline import NamedTensor, reading

#: Tensor classes that are whole as they are (asking them for ``full_tensor`` costs a
#: failed attribute lookup per tensor).
_WHOLE = (torch.Tensor, torch.nn.Parameter)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole and detached: a DTensor (FSDP2, tensor parallel) is gathered here,
    one parameter at a time."""
    if type(tensor) not in _WHOLE:
        gather = getattr(tensor, "full_tensor", None)
        if gather is not None:
            tensor = gather()
    return tensor.detach() if tensor.requires_grad else tensor


async def _from_module(module: torch.nn.Module) -> AsyncIterator[NamedTensor]:
    # state_dict(keep_vars=True) only collects references: parameters and persistent
    # buffers by their state-dict names, nothing is copied until a tensor is consumed.
    for name, tensor in module.state_dict(keep_vars=True).items():
        yield name, full_tensor(tensor)


def _from_peft(model: Any, merged: bool) -> Iterator[NamedTensor]:
    # The base model's tensors under the base checkpoint's names; merged: each LoRA layer's
    # weight plus its active adapter's delta (computed one layer at a time, the model
    # untouched).
    active = model.active_adapter
    layers = {
        prefix: module
        for prefix, module in model.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
    }
    for prefix, module in layers.items():
        if getattr(module, "merged", False) and not merged:
            raise ConfigError(
                f"peft layer {prefix!r} has its adapter merged into the base weights: "
                "unmerge_adapter() first, or pass merged=True"
            )
    for key, tensor in model.state_dict(keep_vars=True).items():
        name = base_name(key)
        if name is None:
            continue
        tensor = full_tensor(tensor)
        if merged and key.endswith(".base_layer.weight"):
            layer = layers.get(key.removesuffix(".base_layer.weight"))
            if (
                layer is not None
                and not getattr(layer, "merged", False)
                and active in getattr(layer, "lora_A", {})
            ):
                with torch.no_grad():
                    delta = full_tensor(layer.get_delta_weight(active))
                    tensor = (tensor + delta.to(tensor.dtype)).to(tensor.dtype)
        yield name, tensor


async def _from_iterable(pairs: Iterator[Any]) -> AsyncIterator[NamedTensor]:
    tensor_type = torch.Tensor
    try:
        for item in pairs:
            # The common case checked in line: a (str, plain tensor) pair, nothing to detach.
            if type(item) is not tuple or len(item) != 2:
                item = _check(item)
            else:
                name, tensor = item
                if type(name) is not str or type(tensor) is not tensor_type or tensor.requires_grad:
                    item = _check(item)
                del name, tensor
            yield item
            del item  # hold nothing of it while the next is made (a gather, a merged weight)
    finally:
        close = getattr(pairs, "close", None)  # a generator's ``finally`` runs now
        if close is not None:
            close()


async def _from_async(pairs: AsyncIterable[Any]) -> AsyncIterator[NamedTensor]:
    async with reading(pairs) as items:
        async for item in items:
            yield _check(item)


def _check(item: Any) -> NamedTensor:
    try:
        name, tensor = item
    except (TypeError, ValueError):
        raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}") from None
    if not isinstance(name, str):
        raise TypeError(f"tensor name {name!r} is a {type(name).__name__}, not a str")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return name, full_tensor(tensor)


async def _on_rank(stream: AsyncIterator[NamedTensor], rank: int) -> AsyncIterator[NamedTensor]:
    # Every rank walks the same tensors in the same order, so the gathers inside the stream
    # (DTensor.full_tensor, a collective) match up; only the sending rank passes them on.
    sending = torch.distributed.get_rank() == rank
    async with reading(stream) as items:
        async for name, tensor in items:
            if sending:
                yield name, tensor
            # Release this full tensor before the next one is gathered: at most one at a time.
            del tensor


def named_tensors(
    obj: Any, *, rank: int | None = None, merged: bool = False
) -> AsyncIterator[NamedTensor]:
    """An async stream of ``(name, tensor)`` from:

    - an ``nn.Module``: parameters and persistent buffers, by state-dict name
      (DTensor parameters are gathered one at a time);
    - a ``peft.PeftModel``: its base model's weights under the base checkpoint's names (no
      ``base_model.model.``, no ``.base_layer``, no adapter tensors), so the base syncs as
      the plain model would; with ``merged=True``, each adapted weight with its active
      adapter merged in (for an engine without LoRA), the model itself left as it is;
    - a mapping of names to tensors;
    - a sync or async iterable of ``(name, tensor)`` pairs.

    With ``rank=k`` (FSDP2 and other DTensor-sharded models) the stream is a collective:
    every rank of the default process group must iterate it to the end, since each DTensor is
    gathered with ``full_tensor()`` on all ranks, one at a time; only rank ``k`` yields, and
    on the other ranks the stream yields nothing. Rank ``k`` sends
    (``ss.send(named_tensors(model, rank=k), ...)``); the others drain it
    (``async for _ in named_tensors(model, rank=k): pass``).
    """
    if rank is not None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"named_tensors(rank={rank}) is a collective call: initialise the default "
                "process group first, or pass rank=None in a single process"
            )
        world = dist.get_world_size()
        if not (isinstance(rank, int) and 0 <= rank < world):
            raise ConfigError(f"named_tensors(rank={rank!r}): use a rank in 0..{world - 1}")
        return _on_rank(named_tensors(obj, merged=merged), rank)
    if isinstance(obj, AsyncIterable) and not merged:
        return _from_async(obj)
    return _pairs(obj, merged=merged)


def _pairs(obj: Any, *, merged: bool) -> AsyncIterator[NamedTensor]:
    if is_peft_model(obj):
        return _from_iterable(_from_peft(obj, merged))
    if merged:
        raise ConfigError(
            f"named_tensors(merged=True) merges a peft model's adapter; "
            f"{type(obj).__name__} is not a peft model"
        )
    if isinstance(obj, torch.nn.Module):
        return _from_module(obj)
    if isinstance(obj, Mapping):
        return _from_iterable(iter(obj.items()))
    if isinstance(obj, Iterable) and not isinstance(obj, str | bytes | torch.Tensor):
        return _from_iterable(iter(obj))
    raise TypeError(
        f"named_tensors() takes an nn.Module, a mapping of tensors or an iterable of "
        f"(name, tensor) pairs, not {type(obj).__name__}"
    )
