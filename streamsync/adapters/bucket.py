"""``bucket(bucket_bytes)``: the last adapter of a sending chain; ``unbucket()`` its inverse.

The bucketer turns named tensors into :class:`~streamsync.bucket.Bucket` plans that a
transport packs straight into its slots; it holds at most one bucket's worth of tensors plus
the one being split. ``unbucket()`` turns packed buckets back into named tensors, reassembling
chunks (receivers do the same through :class:`~streamsync.bucket.Unpacker`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from streamsync.adapter import Adapter, NamedTensor, reading
from streamsync.bucket import Bucket, BucketBuilder, CastRule, PackedBucket, Unpacker
from streamsync.wire import BucketHeader

__all__ = ["Bucketer", "Unbucketer", "bucket", "unbucket"]

DEFAULT_BUCKET_BYTES = 64 << 20


class Bucketer(Adapter):
    """Groups named tensors into buckets of at most ``bucket_bytes``; buckets already made
    upstream pass through."""

    def __init__(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, cast: CastRule | None = None
    ) -> None:
        BucketBuilder(bucket_bytes)  # validates the size now, not at first use
        self.bucket_bytes = bucket_bytes
        self.cast = cast

    def with_cast(self, cast: CastRule) -> Bucketer:
        """This bucketer with a cast fused into its packing copy."""
        if self.cast is not None:
            first, second = cast, self.cast

            def both(name: str, tensor: Any) -> Any:
                dtype = first(name, tensor)
                return second(name, tensor if dtype is None else tensor.to(dtype)) or dtype

            return Bucketer(self.bucket_bytes, cast=both)
        return Bucketer(self.bucket_bytes, cast=cast)

    async def _run(self, source: AsyncIterable[NamedTensor]) -> AsyncIterator[Bucket]:
        builder = BucketBuilder(self.bucket_bytes, cast=self.cast)
        async with reading(source) as items:
            async for item in items:
                if isinstance(item, Bucket):
                    # Already bucketed upstream: pass it through, after what we hold.
                    pending = builder.flush()
                    if pending is not None:
                        yield pending
                    yield item
                    continue
                name, tensor = item
                for full in builder.add(name, tensor):
                    yield full
                    # Drop our reference before awaiting the source again: a finished
                    # bucket must not stay alive while the next one fills.
                    del full
                del item, tensor
        last = builder.flush()
        if last is not None:
            yield last

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return self._run(source)


class Unbucketer(Adapter):
    """Turns packed buckets back into named tensors (copies: the results outlive the buffer)."""

    async def _run(self, source: AsyncIterable[PackedBucket]) -> AsyncIterator[NamedTensor]:
        unpacker = Unpacker()
        unpacker.begin(0)
        async with reading(source) as items:
            seq = 0
            async for packed in items:
                header = BucketHeader(0, seq, 0, packed.data.numel(), packed.entries)
                seq += 1
                for name, view in unpacker.feed(header, packed.data):
                    yield name, view.clone()

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return self._run(source)


def bucket(bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Bucketer:
    """Group named tensors into buckets of at most ``bucket_bytes`` (≥ 1 KiB)."""
    return Bucketer(bucket_bytes)


def unbucket() -> Unbucketer:
    """The inverse of :func:`bucket` for packed buckets."""
    return Unbucketer()
