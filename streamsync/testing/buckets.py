"""Buckets packed into buffers of their own, and back into named tensors: the bucket format
without a transport, for tests of a pipeline's buckets."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import torch

from streamsync.pipeline import NamedTensor, adapter
from streamsync.wire.frames import BucketHeader, Entry, Layout
from streamsync.wire.pack import Bucket
from streamsync.wire.slot import allocate_slot
from streamsync.wire.unpack import Unpacker


@dataclass(slots=True, frozen=True)
class PackedBucket:
    """A packed bucket: its layout plus the byte buffer it points into."""

    layout: Layout
    data: torch.Tensor
    tensors: int = 0

    @property
    def entries(self) -> list[Entry]:
        """The layout's entries as structs."""
        return self.layout.entries()


def pack_bucket(bucket: Bucket, *, checksum: bool = False) -> PackedBucket:
    """``bucket`` packed into a fresh buffer (transports pack into their slots)."""
    buf = allocate_slot(bucket.nbytes)
    layout = bucket.pack_into(buf, checksum=checksum)
    return PackedBucket(layout=layout, data=buf, tensors=bucket.tensors)


@adapter
async def unbucket(source: AsyncIterable[PackedBucket]) -> AsyncIterator[NamedTensor]:
    """``unbucket()``: packed buckets back into named tensors, chunks reassembled, through
    the receiver's :class:`~streamsync.wire.unpack.Unpacker`; yields copies (the results
    outlive the buffer)."""
    unpacker = Unpacker()
    unpacker.begin(0)
    seq = 0
    async for packed in source:
        header = BucketHeader(0, seq, 0, packed.data.numel(), packed.layout)
        seq += 1
        for name, view in unpacker.feed(header, packed.data):
            yield name, view.clone()
