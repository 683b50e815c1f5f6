"""``quantize_fp8(block=(128, 128), skip=...)``: block-wise FP8 weights, quantized once at the
sender.

For FP8 rollout the engine needs each eligible weight as ``float8_e4m3fn`` plus a ``float32``
per-block multiplier ``<module>.weight_scale_inv`` of shape ``[ceil(N/128), ceil(K/128)]``
(block amax / 448), the layout of DeepSeek-V3's FP8 checkpoints that vLLM's block-FP8 linear
layers load. Quantizing here, once, spares every tensor-parallel rank (and the drafter) from
quantizing the same weight again.

Eligible: 2-D ``*.weight`` tensors of dtype float64/32/16 or bfloat16, and packed 3-D expert
tensors (``*.experts.gate_up_proj`` / ``down_proj``, with or without ``.weight``), quantized
per expert (their scale is ``<name>_scale_inv``, ``[E, ceil(N/128), ceil(K/128)]``). Skipped:
embeddings, ``lm_head``, norms, biases, 1-D tensors, MoE routers (``mlp.gate``,
``block_sparse_moe.gate``, ``router``, ``shared_expert_gate``) and whatever ``skip`` matches.
Every skipped tensor passes through untouched.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any, Final

import torch
import torch.nn.functional as F

from streamsync.adapter import Adapter, NamedTensor, reading
from streamsync.errors import ConfigError

__all__ = [
    "FP8_MAX",
    "QuantizeFp8",
    "dequantize_block_fp8",
    "quantize_block_fp8",
    "quantize_fp8",
    "scale_name",
]

FP8_DTYPE: Final = torch.float8_e4m3fn
#: The largest finite ``float8_e4m3fn``.
FP8_MAX: Final = float(torch.finfo(torch.float8_e4m3fn).max)
# A block's amax is clamped to at least this (vLLM and DeepGEMM do the same), so an all-zero
# block gets a tiny finite scale instead of a division by zero, and its zeros stay zeros.
_MIN_AMAX: Final = 1e-4
_QUANTIZABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})

_DEFAULT_SKIP = re.compile(
    r"(?:^|\.)(?:[^.]*embed[^.]*|wte|wpe|lm_head|[^.]*norm[^.]*|router|shared_expert_gate)(?:\.|$)"
    r"|(?:^|\.)(?:mlp|block_sparse_moe)\.gate\.weight$"
    r"|(?:\.|_)bias$"
)
_PACKED_EXPERTS = re.compile(r"\.experts\.(?:gate_up_proj|down_proj)(?:\.weight)?$")

Block = tuple[int, int]


def _check_block(block: Any) -> Block:
    try:
        rows, cols = block
    except (TypeError, ValueError):
        raise ConfigError(
            f"quantize_fp8(block={block!r}): use a pair of positive ints, e.g. (128, 128)"
        ) from None
    if not (isinstance(rows, int) and isinstance(cols, int) and rows > 0 and cols > 0):
        raise ConfigError(
            f"quantize_fp8(block={block!r}): use a pair of positive ints, e.g. (128, 128)"
        )
    return rows, cols


def quantize_block_fp8(
    weight: torch.Tensor, block: Block = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` → ``(float8_e4m3fn [..., N, K], float32 [..., ceil(N/bn),
    ceil(K/bk)])`` such that ``weight ≈ fp8 * scale_inv`` block by block.

    Leading dimensions (experts) are independent: no block spans two of them. Dimensions that
    are not multiples of the block are padded with zeros in the computation only. The same
    arithmetic as vLLM's ``per_block_cast_to_fp8``, in a handful of whole-tensor operations.
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


def dequantize_block_fp8(
    fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: Block = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The inverse of :func:`quantize_block_fp8`: ``fp8 * scale_inv``, block by block."""
    bn, bk = _check_block(block)
    *_, n, k = fp8.shape
    scale = scale_inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return (fp8.float() * scale[..., :n, :k].float()).to(dtype)


def scale_name(name: str) -> str:
    """The name of the scale emitted after weight ``name``: ``<module>.weight_scale_inv``
    for ``<module>.weight``, ``<name>_scale_inv`` otherwise (packed experts)."""
    return f"{name}_scale_inv"


def _skip_rule(skip: Callable[[str], bool] | str | Iterable[str] | None) -> Callable[[str], bool]:
    if skip is None:
        return lambda name: False
    if callable(skip):
        return skip
    patterns = [skip] if isinstance(skip, str) else list(skip)
    if not all(isinstance(p, str) for p in patterns):
        raise ConfigError(
            f"quantize_fp8(skip={skip!r}): use a predicate on names, a regex, or regexes"
        )
    compiled = [re.compile(p) for p in patterns]
    return lambda name: any(p.search(name) for p in compiled)


class QuantizeFp8(Adapter):
    """Replaces each eligible weight by its block-FP8 form followed directly by its
    ``float32`` scale; everything else passes through untouched (see the module docstring).
    """

    def __init__(
        self,
        block: Block = (128, 128),
        skip: Callable[[str], bool] | str | Iterable[str] | None = None,
    ) -> None:
        self.block = _check_block(block)
        self.skip = skip
        self._skip = _skip_rule(skip)

    def eligible(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``(name, tensor)`` is quantized."""
        if tensor.dtype not in _QUANTIZABLE or tensor.numel() == 0:
            return False
        if _DEFAULT_SKIP.search(name) or self._skip(name):
            return False
        if tensor.dim() == 2:
            return name.endswith(".weight")
        return tensor.dim() == 3 and _PACKED_EXPERTS.search(name) is not None

    async def _run(self, source: AsyncIterable[NamedTensor]) -> AsyncIterator[NamedTensor]:
        async with reading(source) as items:
            async for name, tensor in items:
                if not self.eligible(name, tensor):
                    yield name, tensor
                    continue
                fp8, scale = quantize_block_fp8(tensor, self.block)
                del tensor  # the source may free it while its quantized form travels
                yield name, fp8
                del fp8
                yield scale_name(name), scale
                del scale

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return self._run(source)


def quantize_fp8(
    block: Block = (128, 128),
    skip: Callable[[str], bool] | str | Iterable[str] | None = None,
) -> QuantizeFp8:
    """Quantize eligible weights to block-wise ``float8_e4m3fn``, each followed by its
    ``float32`` ``..._scale_inv``. ``skip``: a predicate on names, a regex or regexes
    (searched) naming more tensors to leave alone, on top of the default skips."""
    return QuantizeFp8(block, skip)
