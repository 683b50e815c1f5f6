"""Bucket plans a sender keeps between syncs, the bucket builder's replay strategy.

A trainer sends the same tensors in the same order every step, each with the same name,
dtype and shape, so the buckets it makes are the same every step too: which entries, at
which offsets, in which bucket. :class:`BucketPlans` (one per open sender) keeps the buckets
of the last sync of a source, without its tensors. The next sync of that source checks each
tensor against what was recorded (its name, dtype, shape, and whether it is a contiguous
host tensor) and, while all agree, fills the recorded buckets with the new tensors instead
of building them again: a check per tensor instead of the builder's placement, and each
bucket's layout made once.

The first tensor that differs ends the replay: the part of its bucket already checked
becomes the builder's current bucket, that tensor and the rest are placed as usual, and what
that sync makes is recorded as the plan for the next one. A plan keeps, per tensor, its name,
dtype and shape, and per bucket its columns and layout (about 125 bytes per tensor: 8 MiB
for 65,536 tensors); never a tensor.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from streamsync._dtypes import dtype_from_name
from streamsync.wire.bucket import Bucket, BucketBuilder, CastRule, NamedTensor
from streamsync.wire.frames import Layout

#: Plans one sender keeps (its model, a LoRA adapter beside it, ...): the oldest goes first.
PLANS_PER_SENDER: Final = 4

#: How a tensor was held when recorded: ``True`` for a contiguous host tensor (the common
#: case, checked cheaply), else its device and whether it was contiguous.
_Held = bool | tuple[torch.device, bool]

_Key = tuple[int, "CastRule | None", "str | None"]


def _held(tensor: torch.Tensor) -> _Held:
    contiguous = tensor.is_contiguous()
    return True if tensor.is_cpu and contiguous else (tensor.device, contiguous)


@dataclass(slots=True)
class _Planned:
    """One recorded bucket: its columns (``sources`` empty), where its tensors start in the
    plan, and its layout once made."""

    bucket: Bucket
    #: The plan's index of the first tensor that starts in it.
    first: int
    #: How many tensors start in it.
    count: int
    layout: Layout | None = None

    def filled(self, sources: list[torch.Tensor]) -> Bucket:
        """A bucket with the recorded columns and these sources, one per entry."""
        done = self.bucket.refilled(sources)
        if self.layout is None:
            self.layout = done.layout()
        done.fixed_layout = self.layout
        return done


@dataclass(slots=True)
class _Plan:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    held: list[_Held]
    buckets: list[_Planned]


class BucketPlans:
    """The plans of one sender's sources, by bucket size, cast and first tensor's name."""

    def __init__(self) -> None:
        self._plans: dict[_Key, _Plan] = {}
        #: The names the sender's last sync sent, per bucket, and them sorted, each once: a
        #: sync that sends the same lists again reuses them.
        self.sent: tuple[list[Sequence[str]], tuple[str, ...]] | None = None

    def __len__(self) -> int:
        return len(self._plans)

    def _get(self, key: _Key) -> _Plan | None:
        return self._plans.get(key)

    def _put(self, key: _Key, plan: _Plan) -> None:
        self._plans.pop(key, None)
        self._plans[key] = plan
        while len(self._plans) > PLANS_PER_SENDER:
            del self._plans[next(iter(self._plans))]


def _plain(item: Any) -> bool:
    """Whether an item not yet checked is a pair of a name and a plain tensor that needs no
    detaching (what a checked source would pass on as it is)."""
    return (
        type(item) is tuple
        and len(item) == 2
        and type(item[0]) is str
        and type(item[1]) is torch.Tensor
        and not item[1].requires_grad
    )


class _Miss(Exception):
    """The source no longer matches the plan (internal)."""


class PlanRun:
    """One sync's use of a sender's plans: :meth:`replay` yields the buckets of the plan
    while the source matches it, then leaves the builder where a fresh build would continue;
    :meth:`record` and :meth:`recorded` note what the builder makes after that, and
    :meth:`commit` keeps the whole as the plan for the next sync.
    """

    def __init__(self, plans: BucketPlans, builder: BucketBuilder, *, checked: bool = True) -> None:
        self._plans = plans
        self._builder = builder
        #: Whether the pairs given to :meth:`replay` are checked named tensors; if not, only
        #: a tuple of a name and a plain tensor not requiring grad can match (the caller
        #: checks the pair the replay stopped at, and the rest).
        self._checked = checked
        #: The plan replayed, and how many of its tensors this sync matched.
        self._base: _Plan | None = None
        self._matched = 0
        self._base_buckets = 0
        # What this sync placed past the matched part.
        self._new = _Plan([], [], [], [], [])
        self._tensors = 0  # tensors starting in the buckets recorded so far
        self._complete = False  # the whole plan was replayed, and the source ended with it
        self._first: str | None = None
        self._flat: torch.Tensor | None = None
        self._shapes: dict[torch.Size, torch.Size] = {}
        #: The pair the replay stopped at (for the builder to place first), if any.
        self.pending: NamedTensor | None = None

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """Note a tensor the builder is about to place."""
        new = self._new
        shape = tensor.shape
        new.names.append(name)
        new.dtypes.append(tensor.dtype)
        new.shapes.append(self._shapes.setdefault(shape, shape))  # one object per shape
        new.held.append(_held(tensor))

    def recorded(self, bucket: Bucket) -> None:
        """Note a bucket the builder made (before it is packed)."""
        count = len(bucket.names) - sum(1 for e in bucket.extras.values() if e[0] > 0)
        kept = bucket.refilled([])
        # Kept for many syncs: machine integers, not an int object per entry.
        kept.offsets = array.array("q", bucket.offsets)
        kept.sizes = array.array("q", bucket.sizes)
        kept.dims = array.array("q", bucket.dims)
        self._new.buckets.append(_Planned(kept, self._tensors, count))
        self._tensors += count

    def commit(self) -> None:
        """Keep what this sync made as the plan for the next sync of this source."""
        base, new = self._base, self._new
        if base is not None and self._complete:
            plan = base
        elif base is not None:
            hi, k = self._matched, self._base_buckets
            plan = _Plan(
                base.names[:hi] + new.names,
                base.dtypes[:hi] + new.dtypes,
                base.shapes[:hi] + new.shapes,
                base.held[:hi] + new.held,
                base.buckets[:k] + new.buckets,
            )
        else:
            plan = new
        self._plans._put(self._key(), plan)

    def _key(self) -> _Key:
        builder = self._builder
        return (builder.bucket_bytes, builder.cast_rule, self._first)

    def replay(self, pairs: Iterator[Any]) -> Iterator[Bucket]:
        """The plan's buckets, filled from ``pairs``, while they match it. At the first
        mismatch (or a source longer or shorter than the plan) :attr:`pending` holds the
        pair not yet placed and the builder's current bucket what was checked of its
        bucket; the caller goes on with the builder, which then makes what a build from
        scratch would have made. As in a build, a bucket is handed on once the first
        tensor of the next one is known to match (that tensor is what closed it)."""
        head = next(pairs, None)
        if head is None:
            return
        if not self._checked and not _plain(head):
            self.pending = head  # the caller's check says what is wrong with it
            return
        self._first = head[0]
        plan = self._plans._get(self._key())
        if plan is None:
            self.pending = head
            return
        self._base = plan
        source = itertools.chain((head,), pairs)
        held: tuple[_Planned, list[torch.Tensor]] | None = None  # checked, not handed on
        for planned in plan.buckets:
            sources: list[torch.Tensor] = []
            extras = planned.bucket.extras
            closes = not (extras and 0 in extras and extras[0][0] > 0)
            try:
                if closes:
                    # Its first tensor is what closed the bucket before it.
                    at = self._fill(plan, planned, source, sources, 0, 1, planned.first)
                else:
                    at = planned.first  # it goes on with a chunked tensor: nothing to check
            except _Miss:
                if held is not None:
                    self._resume(plan, *held)
                else:
                    self._resume(plan, planned, sources)
                return
            if held is not None:
                yield self._hand_on(*held)
                held = None
            try:
                self._fill(plan, planned, source, sources, len(sources), None, at)
            except _Miss:
                self._resume(plan, planned, sources)
                return
            held = (planned, sources)
            del sources
        if held is not None:
            extra = next(source, None)
            if extra is not None:
                self.pending = extra
                self._resume(plan, *held)
                return
            self._complete = True
            yield self._hand_on(*held)

    def _hand_on(self, planned: _Planned, sources: list[torch.Tensor]) -> Bucket:
        self._matched = self._tensors = planned.first + planned.count
        self._base_buckets += 1
        return planned.filled(sources)

    def _fill(
        self,
        plan: _Plan,
        planned: _Planned,
        pairs: Iterator[NamedTensor],
        sources: list[torch.Tensor],
        start: int,
        stop: int | None,
        index: int,
    ) -> int:
        """Check the tensors that start in entries ``start`` to ``stop`` (the end if None)
        of ``planned``, the first of them the plan's ``index``th, and put each entry's
        source in ``sources``; returns the index of the next tensor. Raises :class:`_Miss`
        at the first that does not match, with :attr:`pending` the pair that did not
        (``None`` where the source ended)."""
        bucket = planned.bucket
        end = len(bucket.names) if stop is None else stop
        if bucket.extras:
            return self._fill_chunked(plan, bucket, pairs, sources, start, end, index)
        hi = index + (end - start)
        add = sources.append
        unchecked = not self._checked
        plain = torch.Tensor
        # ``pairs`` last: zip stops at the plan's end without reading a pair past it.
        for cn, dt, sh, held, pair in zip(
            plan.names[index:hi],
            plan.dtypes[index:hi],
            plan.shapes[index:hi],
            plan.held[index:hi],
            pairs,
            strict=False,
        ):
            try:
                name, tensor = pair
            except (TypeError, ValueError):
                self.pending = pair
                raise _Miss from None
            if (
                name != cn
                or (unchecked and (type(tensor) is not plain or tensor.requires_grad))
                or tensor.dtype is not dt
                or tensor.shape != sh
                or not (
                    (tensor.is_cpu and tensor.is_contiguous())
                    if held is True
                    else _held(tensor) == held
                )
            ):
                self.pending = pair
                raise _Miss
            add(tensor)
        if len(sources) < end:
            raise _Miss  # the source ended early
        return hi

    def _fill_chunked(
        self,
        plan: _Plan,
        bucket: Bucket,
        pairs: Iterator[NamedTensor],
        sources: list[torch.Tensor],
        start: int,
        end: int,
        index: int,
    ) -> int:
        table = tuple(bucket.dtypes)
        for entry in range(start, end):
            extra = bucket.extras.get(entry)
            if extra is None or extra[0] == 0:
                pair = next(pairs, None)
                if pair is None:
                    raise _Miss
                if not (self._checked or _plain(pair)):
                    self.pending = pair
                    raise _Miss
                name, tensor = pair
                if (
                    name != plan.names[index]
                    or tensor.dtype is not plan.dtypes[index]
                    or tensor.shape != plan.shapes[index]
                    or _held(tensor) != plan.held[index]
                ):
                    self.pending = pair
                    raise _Miss
                index += 1
                if extra is None:
                    sources.append(tensor)
                    continue
                self._flat = tensor.detach().reshape(-1)
            # A chunk: elements of the flattened tensor, counted in the wire dtype's size.
            assert self._flat is not None
            itemsize = dtype_from_name(table[bucket.kinds[entry]]).itemsize
            lo = extra[2] // itemsize
            sources.append(self._flat[lo : lo + bucket.sizes[entry] // itemsize])
            if extra[0] == extra[1] - 1:
                self._flat = None
        return index

    def _resume(self, plan: _Plan, planned: _Planned, sources: list[torch.Tensor]) -> None:
        """Hand the builder the checked part of ``planned`` as its current bucket (the
        replay stops only where a tensor starts, so no chunked tensor is cut in it)."""
        bucket = planned.bucket
        prefix = Bucket()
        table = tuple(bucket.dtypes)
        dims = bucket.dims
        at = 0
        started = 0
        for entry, source in enumerate(sources):
            ndim = bucket.ndims[entry]
            extra = bucket.extras.get(entry)
            prefix.append(
                bucket.names[entry],
                table[bucket.kinds[entry]],
                tuple(dims[at : at + ndim]),
                bucket.offsets[entry],
                bucket.sizes[entry],
                source,
                bool(bucket.moves[entry]),
                extra,
            )
            at += ndim
            if extra is None or extra[0] == 0:
                started += 1
            if extra is None or extra[0] == extra[1] - 1:
                prefix.tensors += 1
                if extra is not None and extra[1] > 1:
                    prefix.holds_tail = True
        self._builder.resume(prefix)
        # The checked tensors of this bucket count as placed by the builder.
        self._matched = planned.first + started
        self._tensors = planned.first
