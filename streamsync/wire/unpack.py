"""Unpacking, the receiver's side of the bucket format: :class:`Unpacker` checks each
bucket's header (the pure checks of :mod:`streamsync.wire.checks`, then the order of chunks,
patch pieces and names) and hands a sink the bucket's tensors as :class:`BucketTensors`.
The sender's side is :mod:`streamsync.wire.pack`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from streamsync._copies import copy_tensors
from streamsync._dtypes import dtype_name
from streamsync.errors import (
    ChecksumError,
    DeltaBaseError,
    DuplicateTensorError,
    WireFormatError,
)
from streamsync.wire import patch as patches
from streamsync.wire.checks import (
    CheckedLayout,
    check_bucket,
    check_entry,
    check_fits,
    check_layout,
    outside_bucket,
)
from streamsync.wire.frames import BucketHeader, End, Entry, Layout
from streamsync.wire.slot import allocate_slot, digest

#: Default limit on one reassembled tensor, checked before allocating its staging buffer.
DEFAULT_MAX_TENSOR_BYTES: Final = 1 << 40
#: Checked entries an :class:`Unpacker` remembers by default: more than a model has tensors.
_REMEMBER: Final = 1 << 18
#: Checked layouts an :class:`Unpacker` remembers: more than a sync has buckets.
_LAYOUTS_MAX: Final = 1 << 12

NamedTensor = tuple[str, torch.Tensor]


class BucketTensors(Sequence[NamedTensor]):
    """One bucket's complete, checked tensors, as a sink's ``load`` receives them:
    ``(name, tensor)`` pairs whose tensors may be views of the slot, valid until ``load``
    returns.

    A bucket of whole, plain tensors also has its :class:`CheckedLayout` (``layout``) and
    its bytes (``data``, uint8): a sink may copy from ``data`` at the layout's offsets and
    key a copy plan on ``layout``; the views are then built only if asked for."""

    __slots__ = ("_tensors", "data", "layout", "names")

    def __init__(
        self,
        tensors: list[NamedTensor] | None,
        *,
        layout: CheckedLayout | None = None,
        data: torch.Tensor | None = None,
    ) -> None:
        self._tensors = tensors
        self.layout = layout
        self.data = data
        self.names: Sequence[str] = (
            layout.names if layout is not None else [name for name, _ in tensors or ()]
        )

    def __len__(self) -> int:
        return len(self.names)

    def _all(self) -> list[NamedTensor]:
        if self._tensors is None:
            assert self.layout is not None and self.data is not None
            self._tensors = _views(self.layout, self.data)
        return self._tensors

    def __iter__(self) -> Iterator[NamedTensor]:
        return iter(self._all())

    def __getitem__(self, index: int) -> NamedTensor:  # type: ignore[override]
        return self._all()[index]


def _views(checked: CheckedLayout, data: torch.Tensor) -> list[NamedTensor]:
    """Each entry of a checked bucket as a view of its bytes ``data``."""
    # ``data`` as each dtype, made once, with its offset in its storage (in elements): an
    # entry's view is then one ``as_strided`` of it.
    typed: dict[torch.dtype, tuple[torch.Tensor, int, int]] = {}
    out: list[NamedTensor] = []
    for name, dtype, (shape, strides), offset in zip(
        checked.names, checked.dtypes, checked.views(), checked.offsets.tolist(), strict=True
    ):
        typed_view = typed.get(dtype)
        if typed_view is None:
            itemsize = dtype.itemsize
            view = data[: data.numel() // itemsize * itemsize].view(dtype)
            typed_view = typed[dtype] = (view, int(view.storage_offset()), itemsize)
        view, base, itemsize = typed_view
        # One call (a slice and a view are two): the entry lies inside the bucket.
        out.append((name, torch.as_strided(view, shape, strides, base + offset // itemsize)))
    return out


# -- receiving: the unpacker ---------------------------------------------------------------
@dataclass(slots=True)
class _Pending:
    """A chunked tensor whose chunks are still coming."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    total: int
    chunks: int
    #: The sink's own tensor, when the chunks go straight into it.
    owner: torch.Tensor | None
    next_chunk: int = 0
    next_offset: int = 0


@dataclass(slots=True)
class _Patching:
    """A patched tensor whose pieces are still coming."""

    name: str
    pieces: int
    next_piece: int
    #: The last position patched so far (positions ascend across pieces).
    last: int
    owner: torch.Tensor


class _Claims:
    """The names of one sync, each claimed once. A sync that repeats, in order, the layouts
    of the last sync whose every name came in a layout (``known``: disjoint, checked then)
    is checked by their identity, with no set of its names (a trainer's every step)."""

    __slots__ = ("known", "layouts", "names", "sync_id")

    def __init__(self, sync_id: int | None, known: tuple[CheckedLayout, ...]) -> None:
        self.sync_id = sync_id
        self.known = known
        #: The layouts claimed, in order; ``None`` once a name was claimed alone.
        self.layouts: list[CheckedLayout] | None = []
        #: The names claimed; ``None`` while the layouts follow ``known``.
        self.names: set[str] | None = None

    def layout(self, checked: CheckedLayout) -> None:
        layouts, known = self.layouts, self.known
        if (
            layouts is not None
            and self.names is None
            and len(layouts) < len(known)
            and known[len(layouts)] is checked
        ):
            layouts.append(checked)
            return
        claimed = self._names()
        if layouts is not None:
            layouts.append(checked)
        if checked.unique and claimed.isdisjoint(checked.names):
            claimed.update(checked.names)
            return
        for name in checked.names:  # one came twice: raise for the first, as one by one
            self.name(name)

    def _names(self) -> set[str]:
        if self.names is None:
            self.names = {name for checked in self.layouts or () for name in checked.names}
        return self.names

    def name(self, name: str) -> None:
        claimed = self._names()
        self.layouts = None
        if name in claimed:
            raise DuplicateTensorError(f"tensor {name!r} arrived twice in sync {self.sync_id}")
        claimed.add(name)

    def disjoint(self) -> tuple[CheckedLayout, ...] | None:
        """At the end of a sync whose every name came in a layout, and was checked by the
        set: those layouts, known to be disjoint."""
        return tuple(self.layouts) if self.layouts and self.names is not None else None


#: A sink's ``target(name, dtype, shape)``: the tensor it will keep this tensor in, so the
#: chunks of a large tensor are written straight into it, or ``None`` for the staging buffer.
TargetFn = Callable[[str, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]


class Unpacker:
    """Receiver side of the bucket format: checks untrusted headers (the pure ``check_*``
    functions, then the order of chunks, patch pieces and names) and returns views.

    One instance serves one channel across syncs. It keeps one staging buffer for
    reassembly, grown as chunks arrive to the largest chunked tensor seen, unless the sink
    offers its own tensor (``target``): the chunks are then copied straight into it. It
    remembers up to ``remember`` checked entries (a trainer repeats them every step), few
    enough that a sender sending ever new ones cannot exhaust memory. ``allocate(nbytes)``
    makes a host staging buffer.
    """

    def __init__(
        self,
        *,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        remember: int = _REMEMBER,
        allocate: Callable[[int], torch.Tensor] = allocate_slot,
    ) -> None:
        self.max_tensor_bytes = max_tensor_bytes
        self._remember = remember
        self._allocate = allocate
        self._checked: dict[Entry, torch.dtype] = {}
        #: Checked layouts, by value, and their entries all together.
        self._plans: dict[Layout, CheckedLayout] = {}
        self._planned = 0
        self._checked_limit = max_tensor_bytes
        #: The layouts of the last sync whose every name came in a layout, in order.
        self._disjoint: tuple[CheckedLayout, ...] = ()
        self._staging: torch.Tensor | None = None
        self.begin(None)

    def _forget(self) -> None:
        self._checked = {}
        self._plans, self._planned = {}, 0
        self._disjoint = ()

    def begin(self, sync_id: int | None) -> None:
        """Start a new sync: forget what the previous one received."""
        if self._checked_limit != self.max_tensor_bytes:
            self._forget()  # what was checked under another limit is checked again
            self._checked_limit = self.max_tensor_bytes
        #: Names whose bytes went straight into a sink's tensor during this sync.
        self.touched: list[str] = []
        self._pending: _Pending | None = None
        self._patching: _Patching | None = None
        self._claims = _Claims(sync_id, self._disjoint)
        self._completed_here = False
        self._sync_id = sync_id
        self._seq = 0
        self._tensors = 0
        self._nbytes = 0

    def feed(
        self, header: BucketHeader, data: torch.Tensor, *, target: TargetFn | None = None
    ) -> BucketTensors:
        """Check ``header`` against the bucket bytes ``data`` (uint8) and return the
        complete tensors of this bucket: views into ``data``, into the staging buffer, or
        (a chunked tensor whose destination ``target`` gave) the sink's own tensor.

        Raises :class:`WireFormatError` (:class:`ChecksumError` for bytes that do not match
        their checksum), :class:`DuplicateTensorError` or, for a patch the sink cannot
        take, :class:`DeltaBaseError`."""
        check_bucket(header, data.numel(), self._sync_id, self._seq)
        if len(self._checked) > self._remember:
            self._forget()
        self._completed_here = False
        if not header.layout.extras and self._pending is None and self._patching is None:
            checked = check_fits(self._checked_layout(header.layout), header.nbytes)
            self._claims.layout(checked)
            self._seq += 1
            self._nbytes += header.nbytes
            self._tensors += len(checked)
            return BucketTensors(None, layout=checked, data=data[: header.nbytes])
        self._seq += 1
        self._nbytes += header.nbytes
        return BucketTensors(self._feed_entries(header, data, target))

    def _checked_layout(self, layout: Layout) -> CheckedLayout:
        checked = self._plans.get(layout)
        if checked is None:
            checked = check_layout(layout, self.max_tensor_bytes)
            if len(self._plans) >= _LAYOUTS_MAX or self._planned + len(checked) > self._remember:
                self._plans, self._planned = {}, 0
                self._disjoint = ()
            self._plans[checked.layout] = checked
            self._planned += len(checked)
        return checked

    def _feed_entries(
        self, header: BucketHeader, data: torch.Tensor, target: TargetFn | None
    ) -> list[NamedTensor]:
        """:meth:`feed` for a bucket checked entry by entry (chunks, patches, checksums, or
        after a chunked or patched tensor)."""
        out: list[NamedTensor] = []
        # Patches are applied once the whole bucket is checked: a bad one applies nothing.
        patching: list[tuple[torch.Tensor, patches.Patch, int, str | None]] = []
        for entry in header.layout.entries():
            dtype = self._checked.get(entry)
            if dtype is None:
                dtype = self._checked[entry] = check_entry(entry, self.max_tensor_bytes)
            itemsize = dtype.itemsize
            name, offset, nbytes = entry.name, entry.offset, entry.nbytes
            if offset + nbytes > header.nbytes:
                raise outside_bucket(name, offset, nbytes, header.nbytes)
            region = data[offset : offset + nbytes]
            if entry.checksum is not None and digest(region) != entry.checksum:
                what, unit = (
                    ("the patch of tensor", "piece") if entry.patch else ("tensor", "chunk")
                )
                raise ChecksumError(
                    f"{what} {name!r} ({unit} {entry.chunk}/{entry.chunks}) in bucket "
                    f"{header.seq} does not match its checksum"
                )
            if entry.patch:
                patching.append(
                    self._check_patch(header.base, entry, dtype, itemsize, region, target)
                )
            elif self._patching is not None:
                raise WireFormatError(
                    f"tensor {name!r} arrived before patched tensor {self._patching.name!r} "
                    "was complete"
                )
            elif entry.chunks > 1:
                done = self._feed_chunk(entry, dtype, itemsize, region, target)
                if done is not None:
                    out.append(done)
            elif self._pending is not None:
                # A chunked tensor's chunks come first in each bucket until it is whole.
                raise WireFormatError(
                    f"tensor {name!r} arrived before chunked tensor {self._pending.name!r} "
                    "was complete"
                )
            else:
                self._claims.name(name)
                self._tensors += 1
                out.append((name, region.view(dtype).view(entry.shape)))
        for owner, patch, itemsize, whole in patching:
            patches.apply(owner, patch, itemsize)
            if whole is not None:
                out.append((whole, owner))
        return out

    def _check_patch(
        self,
        base: int | None,
        entry: Entry,
        dtype: torch.dtype,
        itemsize: int,
        region: torch.Tensor,
        target: TargetFn | None,
    ) -> tuple[torch.Tensor, patches.Patch, int, str | None]:
        """Check one patch piece against the tensor it patches; returns what to apply and,
        for the last piece, the tensor's name (it is then complete)."""
        name = entry.name
        current = self._patching
        if base is None:
            raise WireFormatError(f"tensor {name!r} is a patch in a sync that is not a delta")
        if self._pending is not None:
            raise WireFormatError(
                f"tensor {name!r} arrived before chunked tensor {self._pending.name!r} was complete"
            )
        if entry.chunk == 0:
            if current is not None:
                raise WireFormatError(
                    f"tensor {name!r} started before patched tensor {current.name!r} was complete"
                )
            self._claims.name(name)
            owner = target(name, dtype, entry.shape) if target is not None else None
            if owner is None or tuple(owner.shape) != entry.shape or owner.dtype != dtype:
                raise DeltaBaseError(
                    f"tensor {name!r} came as a patch of {entry.patch} elements, but the sink "
                    "offers no tensor of its shape and dtype to patch (target)"
                )
            current = self._patching = _Patching(name, entry.chunks, 0, -1, owner)
        elif current is None or current.name != name or entry.chunk != current.next_piece:
            raise WireFormatError(
                f"piece {entry.chunk} of the patch of tensor {name!r} arrived out of order"
            )
        if entry.chunks != current.pieces:
            raise WireFormatError(
                f"piece {entry.chunk} of the patch of tensor {name!r} says {entry.chunks} "
                f"pieces, the first said {current.pieces}"
            )
        if entry.shape != tuple(current.owner.shape) or dtype != current.owner.dtype:
            raise WireFormatError(
                f"piece {entry.chunk} of the patch of tensor {name!r} says shape "
                f"{list(entry.shape)} of {entry.dtype}; the first said "
                f"{list(current.owner.shape)} of {dtype_name(current.owner.dtype)}"
            )
        numel = math.prod(entry.shape)
        patch = patches.decode(region, entry.patch, numel, itemsize)
        current.last = patches.check(patch[0], numel, current.last, name)
        current.next_piece += 1
        if current.next_piece < current.pieces:
            return current.owner, patch, itemsize, None
        self._patching = None
        self._tensors += 1
        self.touched.append(name)
        return current.owner, patch, itemsize, name

    def _feed_chunk(
        self,
        entry: Entry,
        dtype: torch.dtype,
        itemsize: int,
        region: torch.Tensor,
        target: TargetFn | None,
    ) -> NamedTensor | None:
        name, pending = entry.name, self._pending
        if entry.chunk == 0:
            if self._completed_here:
                # The staging buffer still holds the tensor completed in this bucket.
                raise WireFormatError(
                    f"tensor {name!r} starts in the bucket where another chunked tensor "
                    "ends; the format requires it to start in the next bucket"
                )
            if pending is not None:
                raise WireFormatError(
                    f"tensor {name!r} started before tensor {pending.name!r} was complete"
                )
            self._claims.name(name)
            owner = target(name, dtype, entry.shape) if target is not None else None
            if owner is not None and not (
                owner.dtype == dtype
                and tuple(owner.shape) == entry.shape
                and owner.device.type == "cpu"
                and owner.is_contiguous()
            ):
                owner = None
            total = math.prod(entry.shape) * itemsize
            pending = self._pending = _Pending(name, dtype, entry.shape, total, entry.chunks, owner)
        elif pending is None or pending.name != name:
            raise WireFormatError(f"chunk {entry.chunk} of tensor {name!r} arrived out of order")
        if (
            entry.chunk != pending.next_chunk
            or entry.chunks != pending.chunks
            or entry.tensor_offset != pending.next_offset
            or entry.dtype != dtype_name(pending.dtype)
            or entry.shape != pending.shape
        ):
            raise WireFormatError(
                f"chunk {entry.chunk}/{entry.chunks} of tensor {name!r} does not continue "
                f"chunk {pending.next_chunk - 1} (expected offset {pending.next_offset})"
            )
        lo, hi = entry.tensor_offset, entry.tensor_offset + entry.nbytes
        if pending.owner is not None:
            if entry.chunk == 0:
                self.touched.append(name)
            staging = pending.owner.view(-1).view(torch.uint8)
        else:
            staging = self._grow_staging(hi, pending.total, region.device)
        copy_tensors([(staging[lo:hi], region)])
        pending.next_chunk += 1
        pending.next_offset = hi
        if pending.next_chunk < pending.chunks:
            return None
        if hi != pending.total:
            raise WireFormatError(
                f"tensor {name!r}: chunks add up to {hi} bytes, expected {pending.total}"
            )
        self._pending = None
        self._tensors += 1
        if pending.owner is not None:
            return (name, pending.owner)
        self._completed_here = True
        return (name, staging[: pending.total].view(pending.dtype).view(pending.shape))

    def _grow_staging(self, needed: int, total: int, device: torch.device) -> torch.Tensor:
        """The staging buffer, at least ``needed`` bytes long, on ``device`` (the slots': a
        GPU's for ``cuda-ipc://``, so chunks are not copied through the host).

        It grows with the bytes that actually arrived (at most doubling, never past the
        tensor's declared ``total``), never from the declared size alone: a header claiming
        a huge tensor allocates nothing until its bytes come. Kept across syncs, it grows in
        the first sync only.
        """
        staging = self._staging
        if staging is not None and staging.numel() >= needed and staging.device == device:
            return staging
        old = staging.numel() if staging is not None and staging.device == device else 0
        size = max(needed, min(total, 2 * old))
        kept = self._pending.next_offset if self._pending is not None else 0
        if not kept:
            self._staging = staging = None  # free the old one before allocating the new one
        grown = (
            self._allocate(size)
            if device.type == "cpu"
            else torch.empty(size, dtype=torch.uint8, device=device)
        )
        if staging is not None and kept:
            copy_tensors([(grown[:kept], staging[:kept])])
        self._staging = grown
        return grown

    def finish(self, end: End) -> None:
        """Check the sender's counts against what arrived."""
        if end.sync_id != self._sync_id:
            raise WireFormatError(f"end of sync {end.sync_id} arrived during sync {self._sync_id}")
        if self._pending is not None:
            raise WireFormatError(
                f"sync {end.sync_id} ended with tensor {self._pending.name!r} incomplete "
                f"({self._pending.next_chunk} of {self._pending.chunks} chunks)"
            )
        if self._patching is not None:
            raise WireFormatError(
                f"sync {end.sync_id} ended with the patch of tensor {self._patching.name!r} "
                f"incomplete ({self._patching.next_piece} of {self._patching.pieces} pieces)"
            )
        if (end.buckets, end.tensors, end.nbytes) != (self._seq, self._tensors, self._nbytes):
            raise WireFormatError(
                f"sync {end.sync_id}: sender sent {end.buckets} buckets, {end.tensors} tensors, "
                f"{end.nbytes} bytes; received {self._seq}, {self._tensors}, {self._nbytes}"
            )
        disjoint = self._claims.disjoint()
        if disjoint is not None:
            self._disjoint = disjoint
