"""``bucket(bucket_bytes)``: the last adapter of a sending chain.

The bucketer turns named tensors into :class:`~streamsync.wire.pack.Bucket` plans that a
transport packs straight into its slots; it holds at most one bucket's worth of tensors plus
the one being split.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import Any

import torch

from streamsync._delta import DeltaRun
from streamsync._replay import BucketPlans, PlanRun
from streamsync.errors import ConfigError
from streamsync.pipeline import Adapter, reading
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES, Bucket, BucketBuilder, CastRule


class Bucketer(Adapter):
    """The bucket builder: named tensors in, :class:`~streamsync.wire.pack.Bucket` plans
    out, at most ``bucket_bytes`` each. Buckets already made upstream pass through.

    How a tensor is placed is the builder's strategy: as it is (converted by ``cast`` while
    packing); against a sender's delta baseline (``delta``: each tensor whole, as a patch,
    or not at all); or, with a sender's ``plans``, filling the buckets of the last sync of
    the same source again while its tensors match them (:mod:`streamsync._replay`).
    """

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        cast: CastRule | None = None,
        plans: BucketPlans | None = None,
        delta: DeltaRun | None = None,
    ) -> None:
        BucketBuilder(bucket_bytes)  # validates the size now, not at first use
        self.bucket_bytes, self.cast, self.plans, self.delta = bucket_bytes, cast, plans, delta

    def casting(self, rule: CastRule) -> Bucketer | None:
        """This bucketer converting by ``rule`` while packing (a preceding ``cast`` fused
        into it), or ``None`` where it converts already: one cast per bucket, since a
        second would round twice, which one packing copy cannot."""
        if self.cast is not None:
            return None
        return Bucketer(self.bucket_bytes, cast=rule, plans=self.plans, delta=self.delta)

    def __repr__(self) -> str:
        cast = f", cast={self.cast!r}" if self.cast is not None else ""
        return f"bucket({self.bucket_bytes}{cast})"

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Bucket]:
        return self._buckets(source)

    def _strategy(self, builder: BucketBuilder) -> _Plain:
        if self.delta is not None:
            self.delta.cast = self.cast  # applied while comparing (fused where it can be)
            return _Delta(builder, self.delta)
        if self.plans is not None:
            return _Replay(builder, self.plans)
        return _Plain(builder)

    async def _buckets(self, source: AsyncIterable[Any]) -> AsyncIterator[Bucket]:
        """The one bucketing loop, whichever the strategy."""
        cast = self.cast if self.delta is None else None
        builder = BucketBuilder(self.bucket_bytes, cast=cast)
        strategy = self._strategy(builder)
        place, made = strategy.place, strategy.made
        async with reading(source) as items:
            async for item in items:
                if type(item) is not tuple and isinstance(item, Bucket):
                    for done in strategy.upstream(item):
                        yield done
                        del done
                    continue
                name, tensor = item
                del item
                full = place(name, tensor)
                del tensor  # held by the bucket alone from here
                if full:
                    for done in full:
                        made(done)
                        yield done
                        del done  # a finished bucket goes before the next one fills
                del full
        for done in strategy.finish():
            yield done


class _Plain:
    """The bucketer's plain strategy: each tensor placed as it is."""

    def __init__(self, builder: BucketBuilder) -> None:
        self.builder = builder
        self.place: Callable[[str, torch.Tensor], Sequence[Bucket]] = builder.add

    def made(self, bucket: Bucket) -> None:
        """A bucket the builder made, before it is handed on."""

    def upstream(self, bucket: Bucket) -> list[Bucket]:
        pending = self.builder.flush()
        return [bucket] if pending is None else [pending, bucket]

    def finish(self) -> list[Bucket]:
        last = self.builder.flush()
        if last is None:
            return []
        self.made(last)
        return [last]


class _Replay(_Plain):
    """The plain strategy with a sender's bucket plans: the last sync's buckets refilled
    while the source matches them, and what this sync makes kept for the next."""

    def __init__(self, builder: BucketBuilder, plans: BucketPlans) -> None:
        super().__init__(builder)
        self.run = run = PlanRun(plans, builder)
        offer, record, add = run.offer, run.record, builder.add

        def place(name: str, tensor: torch.Tensor) -> Sequence[Bucket]:
            if run.replaying and (done := offer(name, tensor)) is not None:
                return done
            record(name, tensor)
            return add(name, tensor)

        self.place = place

    def made(self, bucket: Bucket) -> None:
        if not self.run.replaying:
            self.run.recorded(bucket)

    def upstream(self, bucket: Bucket) -> list[Bucket]:
        self.run.stop()
        self.run.keep = False  # a plan holds only the buckets this stage makes
        return super().upstream(bucket)

    def finish(self) -> list[Bucket]:
        last = self.run.finish() + super().finish()
        self.run.commit()
        return last


class _Delta(_Plain):
    """The delta strategy: each tensor whole, as a patch against the sender's baseline, or
    not at all (:class:`~streamsync._delta.DeltaRun`); every bucket says its base."""

    def __init__(self, builder: BucketBuilder, run: DeltaRun) -> None:
        super().__init__(builder)
        self.run = run
        self.place = functools.partial(run.place, builder)

    def made(self, bucket: Bucket) -> None:
        bucket.base = self.run.base

    def upstream(self, bucket: Bucket) -> list[Bucket]:
        raise ConfigError(
            "delta syncs diff named tensors; the stream already holds buckets "
            "(drop the bucket() stage from the pipeline)"
        )


def bucket(bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, cast: CastRule | None = None) -> Bucketer:
    """``bucket(bucket_bytes=64 MiB, *, cast=None)``: groups named tensors into buckets of at
    most ``bucket_bytes`` (≥ 1 KiB); buckets already made upstream pass through. ``cast``
    (what a preceding ``cast(...)`` fuses into) converts while packing."""
    return Bucketer(bucket_bytes, cast=cast)
