"""``bucket(bucket_bytes)``: the last adapter of a sending chain; ``unbucket()`` its inverse.

The bucketer turns named tensors into :class:`~streamsync.wire.bucket.Bucket` plans that a
transport packs straight into its slots; it holds at most one bucket's worth of tensors plus
the one being split. ``unbucket()`` turns packed buckets back into named tensors, reassembling
chunks (receivers do the same through :class:`~streamsync.wire.bucket.Unpacker`).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from streamsync.pipeline import NamedTensor, adapter
from streamsync.wire.bucket import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    BucketBuilder,
    CastRule,
    PackedBucket,
    Unpacker,
)
from streamsync.wire.frames import BucketHeader
from streamsync.wire.plan import BucketPlans, PlanRun

if TYPE_CHECKING:
    from streamsync.sources import Checker


def _configure(
    bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, cast: CastRule | None = None
) -> dict[str, Any]:
    BucketBuilder(bucket_bytes)  # validates the size now, not at first use
    return {"bucket_bytes": bucket_bytes, "cast": cast}


@adapter(configure=_configure)
async def bucket(
    source: AsyncIterable[NamedTensor | Bucket], *, bucket_bytes: int, cast: CastRule | None
) -> AsyncIterator[Bucket]:
    """``bucket(bucket_bytes=64 MiB, *, cast=None)``: groups named tensors into buckets of at
    most ``bucket_bytes`` (≥ 1 KiB); buckets already made upstream pass through. ``cast``
    (what a preceding ``cast(...)`` fuses into) converts while packing."""
    builder = BucketBuilder(bucket_bytes, cast=cast)
    async for item in source:
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
            # Drop our reference before awaiting the source again: a finished bucket must
            # not stay alive while the next one fills.
            del full
        del item, tensor
    last = builder.flush()
    if last is not None:
        yield last


async def bucket_pairs(
    pairs: Iterator[Any],
    bucket_bytes: int,
    *,
    cast: CastRule | None = None,
    plans: BucketPlans | None = None,
    check: Checker | None = None,
) -> AsyncIterator[Bucket]:
    """What ``bucket(bucket_bytes, cast=cast)`` makes of a plain iterator of named tensors,
    built in a plain loop: one async step per bucket rather than per tensor. With ``plans``
    (a sender's), the buckets of the last sync of the same source are filled again while
    its tensors match them (:mod:`streamsync.wire.plan`), and what this sync makes is kept
    for the next. With ``check``, ``pairs`` are items not yet checked
    (:func:`~streamsync.sources.unchecked_pairs`): the replay takes the plain ones as they
    are, ``check`` the rest. ``pairs`` is closed however this ends."""
    builder = BucketBuilder(bucket_bytes, cast=cast)
    add = builder.add
    run = PlanRun(plans, builder, checked=check is None) if plans is not None else None
    try:
        if run is None:
            for name, tensor in check(pairs) if check is not None else pairs:
                full = add(name, tensor)
                if full:
                    del tensor
                    for done in full:
                        yield done
                        del done  # as in bucket(): a finished bucket goes before the next fills
                    del full
        else:
            it = iter(pairs)
            for done in run.replay(it):
                yield done
                del done
            rest: Iterator[Any] = (
                itertools.chain((run.pending,), it) if run.pending is not None else it
            )
            run.pending = None
            if check is not None:
                rest = check(rest)
            record, recorded = run.record, run.recorded
            for name, tensor in rest:
                record(name, tensor)
                full = add(name, tensor)
                if full:
                    del tensor
                    for done in full:
                        recorded(done)
                        yield done
                        del done
                    del full
    finally:
        close = getattr(pairs, "close", None)
        if close is not None:
            close()
    last = builder.flush()
    if run is not None:
        if last is not None:
            run.recorded(last)
        run.commit()
    if last is not None:
        yield last


#: ``Bucketer(bucket_bytes)`` is ``bucket(bucket_bytes)``; ``isinstance(s, Bucketer)`` too.
Bucketer = bucket


@adapter
async def unbucket(source: AsyncIterable[PackedBucket]) -> AsyncIterator[NamedTensor]:
    """``unbucket()``: the inverse of :func:`bucket` for packed buckets; yields copies (the
    results outlive the buffer)."""
    unpacker = Unpacker()
    unpacker.begin(0)
    seq = 0
    async for packed in source:
        header = BucketHeader(0, seq, 0, packed.data.numel(), packed.layout)
        seq += 1
        for name, view in unpacker.feed(header, packed.data):
            yield name, view.clone()
