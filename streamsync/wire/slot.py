"""The bytes of a slot, as both ends of the bucket format see them.

Every entry starts at a multiple of :data:`ALIGN` bytes of a slot whose start is aligned
(:func:`allocate_slot`), so a view of any dtype is legal whatever came before it (a bf16
tensor of odd length followed by an fp32 one). An entry's checksum is :func:`digest` of its
bytes, made by the sender and checked by the receiver.
"""

from __future__ import annotations

from typing import Final

import torch
import xxhash

#: Alignment of every entry's offset: a cache line, a multiple of every dtype's size.
ALIGN: Final = 64


def allocate_slot(nbytes: int) -> torch.Tensor:
    """A byte buffer whose start is aligned for every dtype (CPU allocations are 64-byte
    aligned by torch's allocator)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def digest(region: torch.Tensor) -> int:
    """xxh3-64 of a uint8 tensor's bytes, read in place (a device's, from a host copy)."""
    return int(xxhash.xxh3_64_intdigest((region if region.is_cpu else region.cpu()).numpy().data))
