"""Bucket plans a sender keeps between syncs: the bucket builder's replay strategy.

A trainer sends the same tensors in the same order every step, so its buckets are the same
every step too. :class:`BucketPlans` (one per open sender) keeps the buckets of the last sync
of a source, without its tensors. The next sync checks each tensor against the plan (name,
dtype, shape, and whether it is a contiguous host tensor) and, while all agree, refills the
planned buckets: a check per tensor instead of a placement, and each bucket's layout made
once. At the first tensor that differs, the checked part of its bucket becomes the builder's
current bucket and the builder goes on as a fresh build would; what that sync makes is the
plan for the next. A plan holds no tensor: each one's name, dtype, shape and place.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Final, NamedTuple

import torch

from streamsync._dtypes import dtype_from_name
from streamsync.wire.pack import Bucket, BucketBuilder, CastRule

#: Plans one sender keeps (its model, a LoRA adapter beside it, ...): the oldest goes first.
PLANS_PER_SENDER: Final = 4

#: How a tensor was held when recorded: ``True`` for a contiguous host tensor (the common
#: case, checked cheaply), else its device and whether it was contiguous.
_Held = bool | tuple[torch.device, bool]

_Key = tuple[int, "CastRule | None", "str | None"]


_Tensor: Final = torch.Tensor


def _held(tensor: torch.Tensor) -> _Held:
    contiguous = tensor.is_contiguous()
    return True if tensor.is_cpu and contiguous else (tensor.device, contiguous)


class _Planned(NamedTuple):
    """One recorded bucket: its columns (``sources`` empty) and where its tensors start in
    the plan: the index of the first that starts in it, and how many do."""

    bucket: Bucket
    first: int
    starting: int


@dataclass(slots=True)
class _Plan:
    #: Per tensor: its name, dtype, shape and how it was held.
    tensors: list[tuple[str, torch.dtype, torch.Size, _Held]]
    buckets: list[_Planned]


class BucketPlans:
    """The plans of one sender's sources, by bucket size, cast and first tensor's name."""

    def __init__(self) -> None:
        self._plans: dict[_Key, _Plan] = {}
        #: The names the sender's last sync sent, per bucket, and them sorted, each once: a
        #: sync that sends the same lists again reuses them.
        self.sent: tuple[list[Sequence[str]], tuple[str, ...]] | None = None
        #: Of the last sync that used these plans: tensors refilled from a plan, and
        #: tensors the builder placed anew.
        self.replayed = 0
        self.placed = 0

    def __len__(self) -> int:
        return len(self._plans)

    def _put(self, key: _Key, plan: _Plan) -> None:
        self._plans.pop(key, None)
        self._plans[key] = plan
        while len(self._plans) > PLANS_PER_SENDER:
            del self._plans[next(iter(self._plans))]


class PlanRun:
    """One sync's use of a sender's plans: :meth:`offer` refills the plan's buckets while
    the tensors match it; :meth:`record` and :meth:`recorded` note what the builder makes
    after that, and :meth:`commit` keeps the whole as the plan for the next sync."""

    def __init__(self, plans: BucketPlans, builder: BucketBuilder) -> None:
        self._plans = plans
        self._builder = builder
        #: Tensors go to :meth:`offer` (until one does not match the plan).
        self.replaying = True
        #: What this sync makes is kept as the plan (not when buckets came from upstream).
        self.keep = True
        self._plan: _Plan | None = None
        # Where the replay is: the planned bucket being filled, its next entry and the
        # sources of those before, the plan's next tensor, and a filled bucket not yet
        # handed on (the next tensor, matching, closes it).
        self._k = 0
        self._entry = 0
        self._sources: list[torch.Tensor] = []
        self._index = 0
        self._filled: tuple[_Planned, list[torch.Tensor]] | None = None
        self._flat: torch.Tensor | None = None
        self._bucket = Bucket()
        self._wanted: list[tuple[str, torch.dtype, torch.Size, _Held]] = []
        # How much of the plan this sync matched: tensors, and buckets handed on.
        self._matched = 0
        self._base_buckets = 0
        # What the builder placed past the matched part.
        self._new = _Plan([], [])
        self._tensors = 0  # tensors starting in the buckets recorded so far
        self._complete = False  # the whole plan was replayed, and the source ended with it
        self._first: str | None = None
        self._shapes: dict[torch.Size, torch.Size] = {}

    def offer(self, name: str, tensor: torch.Tensor) -> Sequence[Bucket] | None:
        """The buckets ``tensor`` completes (usually none) if it is the plan's next tensor;
        else ``None``: the replay ends, and the builder holds what was checked of the
        current bucket, ready to place ``tensor``."""
        i = self._index
        wanted = self._wanted
        if i < len(wanted):
            want, dtype, shape, held = wanted[i]
            if not (
                name == want
                and (type(tensor) is _Tensor or isinstance(tensor, _Tensor))
                and tensor.dtype is dtype
                and tensor.shape == shape
                and (
                    (tensor.is_cpu and tensor.is_contiguous())
                    if held is True
                    else _held(tensor) == held
                )
            ):
                self.stop()
                return None
        elif self._first is None:
            self._first = name
            plan = self._plans._plans.get(self._key())
            if plan is None or not plan.buckets:
                self.stop()
                return None
            self._plan, self._wanted = plan, plan.tensors
            self._bucket = plan.buckets[0].bucket
            return self.offer(name, tensor)
        else:
            self.stop()
            return None
        self._index = i + 1
        out: Sequence[Bucket] = ()
        if self._filled is not None:
            out = [self._hand_on(*self._filled)]
            self._filled = None
        bucket, entry = self._bucket, self._entry
        extra = bucket.extras.get(entry) if bucket.extras else None
        if extra is None:
            self._sources.append(tensor)
        else:
            self._flat = tensor.detach().reshape(-1)
            self._chunk(bucket, entry, extra)
        self._entry = entry = entry + 1
        if entry == len(bucket.names):
            out = list(out)
            assert self._plan is not None
            self._advance(self._plan, out)
        return out

    def _chunk(self, bucket: Bucket, entry: int, extra: tuple[int, int, int, int]) -> None:
        """The entry's source: a chunk of the flattened tensor, counted in the wire dtype's
        size."""
        assert self._flat is not None
        itemsize = dtype_from_name(tuple(bucket.dtypes)[bucket.kinds[entry]]).itemsize
        lo = extra[2] // itemsize
        self._sources.append(self._flat[lo : lo + bucket.sizes[entry] // itemsize])
        if extra[0] == extra[1] - 1:
            self._flat = None

    def _advance(self, plan: _Plan, out: list[Bucket]) -> None:
        """Past a bucket's last entry. It waits for the next tensor to close it, as in a
        build, unless the next bucket goes on with a chunked tensor: that fills it now."""
        while True:
            done = (plan.buckets[self._k], self._sources)
            self._k += 1
            self._entry, self._sources = 0, []
            if self._k == len(plan.buckets):
                self._filled = done
                return
            bucket = self._bucket = plan.buckets[self._k].bucket
            extra = bucket.extras.get(0) if bucket.extras else None
            if extra is None or extra[0] == 0:
                self._filled = done
                return
            out.append(self._hand_on(*done))
            self._chunk(bucket, 0, extra)
            self._entry = 1
            if len(bucket.names) > 1:
                return

    def stop(self) -> None:
        """End the replay: the builder goes on from where it stopped."""
        if not self.replaying:
            return
        self.replaying = False
        if self._filled is not None:
            self._resume(*self._filled)
            self._filled = None
        elif self._plan is not None and self._k < len(self._plan.buckets):
            self._resume(self._plan.buckets[self._k], self._sources)

    def finish(self) -> list[Bucket]:
        """The source ended: the plan's last bucket, if the replay reached it."""
        plan = self._plan
        if self.replaying and plan is not None and self._k == len(plan.buckets):
            self.replaying = False
            self._complete = True
            done, self._filled = self._filled, None
            return [] if done is None else [self._hand_on(*done)]
        self.stop()
        return []

    def _hand_on(self, planned: _Planned, sources: list[torch.Tensor]) -> Bucket:
        self._matched = self._tensors = planned.first + planned.starting
        self._base_buckets += 1
        bucket = planned.bucket
        if bucket.fixed_layout is None:
            bucket.fixed_layout = bucket.layout()
        return bucket.refilled(sources)

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """Note a tensor the builder is about to place."""
        new = self._new
        shape = tensor.shape
        # One object per shape.
        new.tensors.append(
            (name, tensor.dtype, self._shapes.setdefault(shape, shape), _held(tensor))
        )

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
        base, new = self._plan, self._new
        self._plans.replayed, self._plans.placed = self._matched, len(new.tensors)
        if not self.keep:
            return
        if base is not None and self._complete:
            plan = base
        elif base is not None:
            hi, k = self._matched, self._base_buckets
            plan = _Plan(base.tensors[:hi] + new.tensors, base.buckets[:k] + new.buckets)
        else:
            plan = new
        self._plans._put(self._key(), plan)

    def _key(self) -> _Key:
        builder = self._builder
        return (builder.bucket_bytes, builder.cast_rule, self._first)

    def _resume(self, planned: _Planned, sources: list[torch.Tensor]) -> None:
        """Hand the builder the checked part of ``planned`` as its current bucket (the
        replay stops only where a tensor starts, so no chunked tensor is cut in it)."""
        bucket, n = planned.bucket, len(sources)
        extras = {i: extra for i, extra in bucket.extras.items() if i < n}
        kinds = bucket.kinds[:n]
        prefix = Bucket(
            names=bucket.names[:n],
            # Kinds are numbered as dtypes first appear: the prefix's are the table's first.
            dtypes=dict(islice(bucket.dtypes.items(), max(kinds, default=-1) + 1)),
            kinds=kinds,
            ndims=bucket.ndims[:n],
            dims=list(bucket.dims[: sum(bucket.ndims[:n])]),
            offsets=list(bucket.offsets[:n]),
            sizes=list(bucket.sizes[:n]),
            sources=sources,
            moves=bucket.moves[:n],
            extras=extras,
            nbytes=bucket.offsets[n - 1] + bucket.sizes[n - 1] if n else 0,
            tensors=n - sum(1 for e in extras.values() if e[0] < e[1] - 1),
            holds_tail=any(1 < e[1] == e[0] + 1 for e in extras.values()),
        )
        self._builder.resume(prefix)
        # The checked tensors of this bucket count as placed by the builder.
        self._matched = planned.first + n - sum(1 for e in extras.values() if e[0] > 0)
        self._tensors = planned.first
