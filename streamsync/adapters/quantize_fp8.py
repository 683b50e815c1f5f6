"""``quantize_fp8(block=(128, 128), skip=...)``: block-wise FP8 weights, quantized once at the
sender, not on every tensor-parallel rank and drafter.

Each eligible weight becomes ``float8_e4m3fn`` plus a ``float32`` per-block multiplier
``<module>.weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` (block amax / 448): DeepSeek-V3's
FP8 checkpoint layout, which vLLM's block-FP8 linear layers load.

Eligible: 2-D ``*.weight`` tensors of dtype float64/32/16 or bfloat16, and packed 3-D expert
tensors (``*.experts.gate_up_proj`` / ``down_proj``, with or without ``.weight``), quantized
per expert (their scale is ``<name>_scale_inv``, ``[E, ceil(N/128), ceil(K/128)]``). Skipped,
and passed through untouched: embeddings, ``lm_head``, norms, biases, 1-D tensors, MoE
routers (``mlp.gate``, ``block_sparse_moe.gate``, ``router``, ``shared_expert_gate``) and
whatever ``skip`` matches.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any, Final

import torch
import torch.nn.functional as F

from streamsync._dtypes import CASTABLE
from streamsync._moe_names import PACKED, ROUTER, ROUTER_MODULES
from streamsync.boxes import Sharded
from streamsync.errors import ConfigError
from streamsync.facts import Box
from streamsync.pipeline import NamedTensor, adapter

FP8_DTYPE: Final = torch.float8_e4m3fn
#: The largest finite ``float8_e4m3fn``.
FP8_MAX: Final = float(torch.finfo(torch.float8_e4m3fn).max)
#: The suffix of the ``float32`` scale emitted after each quantized weight.
SCALE_SUFFIX: Final = "_scale_inv"
# A block's amax is clamped to at least this (vLLM and DeepGEMM do the same), so an all-zero
# block gets a tiny finite scale instead of a division by zero, and its zeros stay zeros.
_MIN_AMAX: Final = 1e-4

_DEFAULT_SKIP = re.compile(
    r"(?:^|\.)(?:[^.]*embed[^.]*|wte|wpe|lm_head|[^.]*norm[^.]*|"
    + "|".join(ROUTER_MODULES)
    + r")(?:\.|$)|(?:\.|_)bias$"
)

Block = tuple[int, int]


def _check_block(block: Any) -> Block:
    try:
        rows, cols = block
        ok = isinstance(rows, int) and isinstance(cols, int) and rows > 0 and cols > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"quantize_fp8(block={block!r}): use a pair of positive ints, e.g. (128, 128)"
        )
    return rows, cols


def quantize_block_fp8(
    weight: torch.Tensor, block: Block = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` → ``(float8_e4m3fn [..., N, K], float32 [..., ceil(N/bn),
    ceil(K/bk)])`` such that ``weight ≈ fp8 * scale_inv`` block by block.

    Leading dimensions (experts) are independent; dimensions that are not multiples of the
    block are padded with zeros in the computation only. vLLM's ``per_block_cast_to_fp8``
    arithmetic, in a handful of whole-tensor operations.
    """
    bn, bk = _check_block(block)
    if weight.dim() < 2:
        raise ValueError(f"quantize_block_fp8 needs a tensor of 2 or more dims, not {weight.dim()}")
    *lead, n, k = weight.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    x = weight.float()
    if nb * bn != n or kb * bk != k:
        x = F.pad(x, (0, kb * bk - k, 0, nb * bn - n))
    blocks = x.reshape(*lead, nb, bn, kb, bk)
    # max(|x|) as max(max x, -min x): two reductions, no |x| temporary of the whole tensor.
    amax = torch.maximum(
        blocks.amax(dim=(-3, -1), keepdim=True), blocks.amin(dim=(-3, -1), keepdim=True).neg()
    ).clamp_(min=_MIN_AMAX)
    scale = amax / FP8_MAX
    # Scale in place when ``x`` is already our own fp32 copy: one whole-tensor temporary less.
    scaled = blocks.mul_(scale.reciprocal()) if x is not weight else blocks * scale.reciprocal()
    fp8 = scaled.to(FP8_DTYPE).view(*lead, nb * bn, kb * bk)
    if nb * bn != n or kb * bk != k:
        fp8 = fp8[..., :n, :k].contiguous()
    return fp8, scale.view(*lead, nb, kb)


def eligible(name: str, tensor: torch.Tensor, skip: Callable[[str], bool] | None = None) -> bool:
    """Whether ``quantize_fp8`` quantizes ``(name, tensor)`` (``skip``: its extra skips)."""
    if tensor.dtype not in CASTABLE or tensor.numel() == 0:
        return False
    if _DEFAULT_SKIP.search(name) or ROUTER.match(name) or (skip is not None and skip(name)):
        return False
    if tensor.dim() == 2:
        return name.endswith(".weight")
    return tensor.dim() == 3 and PACKED.match(name) is not None


def _quantize_sharded(name: str, tensor: Sharded, block: Block) -> tuple[Any, Any]:
    """A collective sync's shards of ``tensor`` quantized where each rank holds them, and
    the shards of its scale: a :class:`ConfigError` naming the tensor when a rank's shard
    cuts a block (its scale would need elements another rank holds)."""
    (bn, bk), (n, k) = block, tuple(tensor.shape[-2:])
    scale_boxes: list[Box | None] = []
    for r, held in enumerate(tensor.boxes):
        if held is None:
            scale_boxes.append(None)
            continue
        for what, d, size, step in (("rows", -2, n, bn), ("columns", -1, k, bk)):
            a, z = held.start[d], held.stop[d]
            if a % step or (z % step and z != size):
                raise ConfigError(
                    f"quantize_fp8: tensor {name!r}: trainer rank {r} holds {what} {a}:{z} of "
                    f"{size}, which cuts a {bn}x{bk} block; shard it on block boundaries, or "
                    "quantize on one trainer"
                )
        scale_boxes.append(
            Box(
                (*held.start[:-2], held.start[-2] // bn, held.start[-1] // bk),
                (*held.stop[:-2], -(-held.stop[-2] // bn), -(-held.stop[-1] // bk)),
            )
        )
    lead = tuple(tensor.shape[:-2])
    if tensor.boxes[tensor.rank] is None:
        fp8 = torch.empty((0,) * tensor.dim(), dtype=FP8_DTYPE)
        scale = torch.empty((0,) * tensor.dim(), dtype=torch.float32)
    else:
        fp8, scale = quantize_block_fp8(tensor.local, block)
    scale_shape = (*lead, -(-n // bn), -(-k // bk))
    return (
        Sharded(name, fp8, tensor.boxes, tuple(tensor.shape), tensor.rank),
        Sharded(f"{name}{SCALE_SUFFIX}", scale, scale_boxes, scale_shape, tensor.rank),
    )


def _configure(
    block: Block = (128, 128),
    skip: Callable[[str], bool] | str | Iterable[str] | None = None,
) -> dict[str, Any]:
    if skip is None or callable(skip):
        return {"block": _check_block(block), "skip": skip}
    patterns = [skip] if isinstance(skip, str) else list(skip)
    if not all(isinstance(p, str) for p in patterns):
        raise ConfigError(
            f"quantize_fp8(skip={skip!r}): use a predicate on names, a regex, or regexes"
        )
    compiled = [re.compile(p) for p in patterns]
    return {"block": _check_block(block), "skip": lambda n: any(p.search(n) for p in compiled)}


@adapter(configure=_configure)
async def quantize_fp8(
    source: AsyncIterable[NamedTensor], *, block: Block, skip: Callable[[str], bool] | None
) -> AsyncIterator[NamedTensor]:
    """``quantize_fp8(block=(128, 128), skip=None)``: each eligible weight (module docstring),
    then its scale; ``skip``: a predicate on names, or regexes (searched), of more to skip.

    Only for an engine that serves FP8 weights: into one whose weights are bf16 or fp32 the
    sync is refused with :class:`~streamsync.ConfigError` before anything is loaded."""
    async for name, tensor in source:
        if not eligible(name, tensor, skip):
            yield name, tensor
            continue
        if isinstance(tensor, Sharded):
            fp8, scale = _quantize_sharded(name, tensor, block)
        else:
            fp8, scale = quantize_block_fp8(tensor, block)
        del tensor  # the source may free it while its quantized form travels
        yield name, fp8
        del fp8
        yield f"{name}{SCALE_SUFFIX}", scale
        del scale
