"""Sizes, and the benchmark's synthetic models: Qwen3-shaped layer stacks of a given size,
with deterministic weights that are cheap to make and to check."""

from __future__ import annotations

import argparse
import itertools
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from streamsync.testing.shapes import checkpoint_experts, qwen3_layer

GiB = 1 << 30
MiB = 1 << 20
#: The dtype of a model as trained and on the wire.
WIRE_DTYPE = torch.bfloat16
# Length of the random block every tensor repeats: prime, so no power-of-two boundary
# (a bucket, a chunk) lines up with it and a misplaced block fails the check.
_BLOCK = 65521
_ROUTER_BIAS = "e_score_correction_bias"
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


# -- sizes ------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"16MiB"``, ``"1GiB"``, ``"512M"``, ``"1.5g"`` or plain bytes, as an int."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 16MiB, 1GiB, 4096")
    return int(float(match[1]) * _UNITS[match[2]])


def human(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``"16.00 MiB"``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


# -- the synthetic model ----------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticModel:
    """Names, shapes and dtypes of a model as trained (bf16, router buffers fp32)."""

    shapes: Layout
    buffers: frozenset[str] = frozenset()
    moe: bool = False

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.shapes.values())

    def source_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of :meth:`weights` made in ``dtype``."""
        return sum(
            math.prod(s) * (d if n in self.buffers else dtype).itemsize
            for n, (s, d) in self.shapes.items()
        )

    def weights(self, dtype: torch.dtype = WIRE_DTYPE, seed: int = 0) -> dict[str, torch.Tensor]:
        """Deterministic tensors; floating-point weights made in ``dtype`` (buffers stay
        in theirs)."""
        return {
            name: _filled(shape, d if name in self.buffers else dtype, _seed(name, seed))
            for name, (shape, d) in self.shapes.items()
        }

    def zeros(self, *, expanded: bool = False) -> dict[str, torch.Tensor]:
        """A receiver's model, every page touched (so loading it does not grow RSS)."""
        return {n: torch.zeros(s, dtype=d) for n, (s, d) in self.layout(expanded=expanded).items()}

    def largest_tensor_bytes(self, *, expanded: bool = False) -> int:
        return max(math.prod(s) * d.itemsize for s, d in self.layout(expanded=expanded).values())

    def expected(
        self, source: torch.dtype = WIRE_DTYPE, *, expanded: bool = False, seed: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What a receiver should hold after a sync of ``weights(source)``, tensor by
        tensor (generated one at a time, so checking costs one tensor of memory)."""
        for name, (shape, d) in self.shapes.items():
            made = d if name in self.buffers else source
            tensor = _filled(shape, made, _seed(name, seed)).to(d)
            parts = checkpoint_experts(name, tensor) if expanded else None
            yield from parts if parts is not None else [(name, tensor)]

    def layout(self, *, expanded: bool = False) -> Layout:
        """Names, shapes and dtypes as the receiver holds them: as trained, or with the
        experts per expert (what ``expand_moe`` makes)."""
        if not expanded:
            return dict(self.shapes)
        out: Layout = {}
        for name, (shape, d) in self.shapes.items():
            parts = checkpoint_experts(name, torch.empty(shape, dtype=d, device="meta"))
            for part, view in parts if parts is not None else [(name, None)]:
                out[part] = (shape, d) if view is None else (tuple(view.shape), d)
        return out

    def module(self, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """An ``nn.Module`` whose state dict is ``tensors``, this model's buffers registered
        as buffers."""
        root = torch.nn.Module()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                child = mod._modules.get(part)
                if child is None:
                    child = torch.nn.Module()
                    mod.add_module(part, child)
                mod = child
            if name in self.buffers:
                mod.register_buffer(leaf, tensor)
            else:
                mod.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
        return root


def _seed(name: str, seed: int) -> int:
    return zlib.crc32(name.encode()) ^ seed


def _filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values repeating with a prime period: random enough to catch misplaced bytes,
    cheap enough (copies doubling in length) that a GiB takes a fraction of a second."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    n = flat.numel()
    block = torch.randn(min(n, _BLOCK), generator=torch.Generator().manual_seed(seed))
    flat[: block.numel()].copy_(block)
    done = block.numel()
    while done < n:
        step = min(done, n - done)
        flat[done : done + step].copy_(flat[:step])
        done += step
    return out


def synthetic_model(nbytes: int, *, moe: bool = False) -> SyntheticModel:
    """A model of at most ``nbytes`` (bf16) shaped like Qwen3: Qwen3-1.7B's dense layers
    (hidden 2048, GQA 16/8 heads of 128, MLP 6144) or Qwen3-30B-A3B's MoE layers (32/4
    heads, 16 of its 128 experts of 768, a router with an fp32 ``e_score_correction_bias``
    buffer as DeepSeek-V3 has), layers until the size is reached, an embedding of about an
    eighth of it (larger than a bucket: it travels chunked). Smaller sizes scale every width
    down by a power of two so that at least four layers fit."""
    scale = 1
    while scale < 64:
        if _layer_bytes(2048 // scale, moe) * 4 <= nbytes * 7 // 8:
            break
        scale *= 2
    hidden = 2048 // scale
    vocab = max(64, nbytes // 8 // (2 * hidden) // 64 * 64)
    shapes: Layout = {"model.embed_tokens.weight": ((vocab, hidden), WIRE_DTYPE)}
    buffers: set[str] = set()
    total = vocab * hidden * 2
    for layer in itertools.count():
        full = True
        for name, shape, d in _layer(hidden, moe):
            size = math.prod(shape) * d.itemsize
            if total + size > nbytes:
                full = False
                break
            key = f"model.layers.{layer}.{name}"
            shapes[key] = (shape, d)
            if name.endswith(_ROUTER_BIAS):
                buffers.add(key)
            total += size
        if not full:
            break
    return SyntheticModel(shapes, frozenset(buffers), moe)


def _layer(hidden: int, moe: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """One layer of the synthetic model at width ``hidden`` (every other width shrinks
    with it), from the Qwen3 shape table."""
    f = 2048 // hidden
    if moe:  # Qwen3-30B-A3B
        table = qwen3_layer(
            hidden=hidden,
            q_dim=4096 // f,
            kv_dim=512 // f,
            head_dim=128,
            experts=16,
            moe_intermediate=768 // f,
            router_bias=True,
        )
    else:  # Qwen3-1.7B
        table = qwen3_layer(
            hidden=hidden, q_dim=2048 // f, kv_dim=1024 // f, head_dim=128, intermediate=6144 // f
        )
    return [(n, s, torch.float32 if n.endswith(_ROUTER_BIAS) else WIRE_DTYPE) for n, s in table]


def _layer_bytes(hidden: int, moe: bool) -> int:
    return sum(math.prod(s) * d.itemsize for _, s, d in _layer(hidden, moe))


#: A DeepSeek-V3-shaped FP8 expert, scaled down (V3: hidden 7168, expert MLP 2048): its
#: 2-D float8 weights, each with the fp32 ``weight_scale_inv`` of its 128x128 blocks.
FP8_HIDDEN, FP8_INTERMEDIATE, FP8_BLOCK = 1024, 256, 128


def fp8_model(nbytes: int) -> SyntheticModel:
    """Experts of an FP8 checkpoint until ``nbytes``: per expert ``gate_proj``, ``up_proj``
    and ``down_proj`` weights in ``float8_e4m3fn`` (256 KiB each) and their
    ``weight_scale_inv`` (fp32, 64 bytes each: half the tensors are tiny), 32 experts to a
    layer. The scales are the model's buffers, so they keep fp32 whatever the weights'
    dtype."""
    fp8 = torch.float8_e4m3fn
    shapes: Layout = {}
    buffers: set[str] = set()
    total = 0
    per = {
        "gate_proj": (FP8_INTERMEDIATE, FP8_HIDDEN),
        "up_proj": (FP8_INTERMEDIATE, FP8_HIDDEN),
        "down_proj": (FP8_HIDDEN, FP8_INTERMEDIATE),
    }
    for expert in itertools.count():
        layer, index = divmod(expert, 32)
        entries = []
        for proj, (rows, cols) in per.items():
            key = f"model.layers.{layer}.mlp.experts.{index}.{proj}"
            scale = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
            entries += [
                (f"{key}.weight", (rows, cols), fp8),
                (f"{key}.weight_scale_inv", scale, torch.float32),
            ]
        size = sum(math.prod(sh) * d.itemsize for _, sh, d in entries)
        if total + size > nbytes and shapes:
            break
        for name, shape, d in entries:
            shapes[name] = (shape, d)
            if d == torch.float32:
                buffers.add(name)
        total += size
    return SyntheticModel(shapes, frozenset(buffers), moe=False)


def uniform_model(nbytes: int, tensor_bytes: int) -> SyntheticModel:
    """``nbytes`` as bf16 tensors of ``tensor_bytes`` each (at least one), 64 to a layer:
    the many-small-tensors case (FP8 scales, expanded experts) against few large ones."""
    count = max(1, nbytes // tensor_bytes)
    numel = max(1, tensor_bytes // WIRE_DTYPE.itemsize)
    cols = 64 if numel % 64 == 0 else 1
    shape = (numel // cols, cols)
    return SyntheticModel(
        {f"model.layers.{i // 64}.w{i % 64}": (shape, WIRE_DTYPE) for i in range(count)}
    )
