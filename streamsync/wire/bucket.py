"""The bucket format: named tensors packed into one contiguous byte buffer plus msgspec
metadata, built by :class:`BucketBuilder` (sender) and checked by :class:`Unpacker` (receiver).

Every entry starts at a multiple of :data:`ALIGN` bytes, so a view of any dtype is legal
whatever came before it (a bf16 tensor of odd length followed by an fp32 one).
"""

from __future__ import annotations

import array
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec
import numpy as np
import torch
import xxhash

from streamsync._copies import CopyBatch, MovePlan, copy_tensors
from streamsync._dtypes import dtype_from_name, dtype_name
from streamsync.errors import (
    ChecksumError,
    ConfigError,
    DeltaBaseError,
    DuplicateTensorError,
    WireFormatError,
)
from streamsync.wire import patch as patches
from streamsync.wire.frames import BucketHeader, End, Entry, Extra, Layout

#: Alignment of every entry's offset: a cache line, a multiple of every dtype's size.
ALIGN: Final = 64
#: The smallest bucket accepted.
MIN_BUCKET_BYTES: Final = 1024
#: Bytes per bucket (and transport slot) unless told otherwise: measured into vLLM, 64 MiB
#: buckets beat 16 and 32 MiB (BENCHMARKS.md).
DEFAULT_BUCKET_BYTES: Final = 64 << 20
#: Default limit on one reassembled tensor, checked before allocating its staging buffer.
DEFAULT_MAX_TENSOR_BYTES: Final = 1 << 40
#: Checked entries an :class:`Unpacker` remembers by default: more than a model has tensors.
_REMEMBER: Final = 1 << 18
#: Checked layouts an :class:`Unpacker` remembers: more than a sync has buckets.
_LAYOUTS_MAX: Final = 1 << 12

NamedTensor = tuple[str, torch.Tensor]
#: A fused cast: ``(name, dtype) -> dtype to send, or None to send as is``; it decides on
#: the name and dtype alone, never by converting the tensor.
CastRule = Callable[[str, torch.dtype], "torch.dtype | None"]


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def allocate_slot(nbytes: int) -> torch.Tensor:
    """A byte buffer whose start is aligned for every dtype (CPU allocations are 64-byte
    aligned by torch's allocator)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _digest(region: torch.Tensor) -> int:
    """xxh3-64 of a uint8 tensor's bytes, read in place (a device's, from a host copy)."""
    return int(xxhash.xxh3_64_intdigest((region if region.is_cpu else region.cpu()).numpy().data))


#: dtype -> (wire name, item size), filled as dtypes are first sent.
_WIRE: dict[torch.dtype, tuple[str, int]] = {}


def _wire(dtype: torch.dtype) -> tuple[str, int]:
    # dtype_name raises for a dtype that cannot travel.
    return _WIRE.get(dtype) or _WIRE.setdefault(dtype, (dtype_name(dtype), dtype.itemsize))


#: A bucket of at most this many entries keeps its copy plan for the next sync: building
#: one costs tens of microseconds whatever its size, keeping one about 60 bytes per entry,
#: which a bucket of thousands of small tensors would rather not pay (its peak memory).
KEPT_PLAN_ENTRIES = 64


@dataclass(slots=True, eq=False, repr=False)
class Bucket:
    """A bucket not yet packed: its entries as the columns of its :class:`Layout`, and per
    entry the tensor its bytes come from (copied straight into a slot, converted to the
    entry's dtype on the way); ``tensors`` counts those whose last (or only) piece is in it.
    """

    names: list[str] = field(default_factory=list)
    #: The wire dtype names of its entries, each with its position in the layout's table.
    dtypes: dict[str, int] = field(default_factory=dict)
    #: Per entry, its dtype's position in ``dtypes``.
    kinds: bytearray = field(default_factory=bytearray)
    ndims: bytearray = field(default_factory=bytearray)
    # Lists while built; a kept plan's as ``array("q")``.
    dims: MutableSequence[int] = field(default_factory=list)
    offsets: MutableSequence[int] = field(default_factory=list)
    sizes: MutableSequence[int] = field(default_factory=list)
    #: Per entry, the tensor holding its bytes (before conversion).
    sources: list[torch.Tensor] = field(default_factory=list)
    #: Per entry, 1 where its bytes are a plain memmove from its source.
    moves: bytearray = field(default_factory=bytearray)
    #: ``(chunk, chunks, tensor_offset, patch)`` of the entries that are not whole tensors.
    extras: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    nbytes: int = 0
    tensors: int = 0
    #: The last chunk of a chunked tensor is in this bucket.
    holds_tail: bool = False
    #: A delta sync's base version (``BucketHeader.base``).
    base: int | None = None
    #: Its layout, made once for a replayed plan's bucket and shared with its twins.
    fixed_layout: Layout | None = None
    #: The source addresses it was last packed from and their :class:`MovePlan` (up to
    #: :data:`KEPT_PLAN_ENTRIES` entries); shared with its :meth:`refilled` twins, which
    #: replay it while the sources stay put.
    moves_plan: list[tuple[list[int], MovePlan]] = field(default_factory=list)

    def refilled(self, sources: list[torch.Tensor]) -> Bucket:
        """This bucket with ``sources``, one per entry; all else is shared, not copied (a
        finished bucket's columns no longer change)."""
        return dataclasses.replace(self, sources=sources)

    def append(
        self,
        name: str,
        wire_dtype: str,
        shape: tuple[int, ...],
        offset: int,
        nbytes: int,
        source: torch.Tensor,
        move: bool,
        extra: tuple[int, int, int, int] | None = None,
    ) -> None:
        """Place one entry, whose bytes are ``source``'s (converted to ``wire_dtype`` unless
        ``move``: then they are its bytes as they are)."""
        kind = self.dtypes.get(wire_dtype)
        if kind is None:
            kind = self.dtypes[wire_dtype] = len(self.dtypes)
        if extra is not None:
            self.extras[len(self.names)] = extra
        self.names.append(name)
        self.kinds.append(kind)
        self.ndims.append(len(shape))
        self.dims.extend(shape)
        self.offsets.append(offset)
        self.sizes.append(nbytes)
        self.sources.append(source)
        self.moves.append(move)
        self.nbytes = offset + nbytes

    @property
    def entries(self) -> list[Entry]:
        """The entries as structs (without checksums)."""
        return self.layout().entries()

    def layout(self, checksums: Sequence[int] | None = None) -> Layout:
        """The bucket's layout, with each entry's checksum when ``checksums`` is given."""
        if checksums is None and self.fixed_layout is not None:
            return self.fixed_layout
        extras = []
        for i in range(len(self.names)) if checksums is not None else sorted(self.extras):
            chunk, chunks, tensor_offset, patch = self.extras.get(i, (0, 1, 0, 0))
            checksum = checksums[i] if checksums is not None else None
            extras.append(Extra(i, chunk, chunks, tensor_offset, checksum, patch))
        return Layout(
            names=tuple(self.names),
            dtypes=tuple(self.dtypes),
            dtype_index=bytes(self.kinds),
            ndims=bytes(self.ndims),
            dims=array.array("q", self.dims).tobytes(),
            offsets=array.array("q", self.offsets).tobytes(),
            nbytes=array.array("q", self.sizes).tobytes(),
            extras=tuple(extras),
        )

    def pack_into(self, buf: torch.Tensor, *, checksum: bool = False) -> Layout:
        """Copy every entry into ``buf`` (a uint8 tensor of at least ``nbytes``).

        Returns the bucket's layout, with checksums when ``checksum`` is true.
        """
        if buf.numel() < self.nbytes:
            raise ConfigError(
                f"slot of {buf.numel()} bytes is too small for a bucket of {self.nbytes}"
            )
        base = buf.data_ptr()
        # A memmove reaches only host memory: into a device's slot (cuda-ipc://) every entry
        # is a torch copy, a move's bytes as they are.
        host = buf.is_cpu
        if host and 0 not in self.moves:
            # The common case: every entry a plain memmove, in one batch.
            srcs = [t.data_ptr() for t in self.sources]
            memo = self.moves_plan
            if memo and memo[0][0] == srcs:
                plan = memo[0][1]
            else:
                plan = MovePlan(self.offsets, srcs, self.sizes)
                if len(srcs) <= KEPT_PLAN_ENTRIES:
                    memo[:] = [(srcs, plan)]
            plan.run(base, 0)
        else:
            batch = CopyBatch()
            table = tuple(self.dtypes)
            for src, kind, move, offset, nbytes in zip(
                self.sources, self.kinds, self.moves, self.offsets, self.sizes, strict=True
            ):
                if move and host:
                    batch.move(base + offset, src.data_ptr(), nbytes)
                elif move:
                    batch.copy(buf[offset : offset + nbytes], src.reshape(-1).view(torch.uint8))
                else:
                    region = buf[offset : offset + nbytes]
                    batch.copy(region.view(dtype_from_name(table[kind])).view(src.shape), src)
            batch.run()
        if not checksum:
            return self.layout()
        return self.layout(
            [
                _digest(buf[offset : offset + nbytes])
                for offset, nbytes in zip(self.offsets, self.sizes, strict=True)
            ]
        )


class BucketBuilder:
    """Groups named tensors into buckets of at most ``bucket_bytes``.

    A tensor that does not fit in what is left of the current bucket starts the next one; a
    tensor larger than a bucket is split into element-aligned chunks, the first filling what
    is left of the current bucket. ``cast`` maps a source dtype to the dtype to send (or
    ``None`` to send as is): the conversion happens while packing, so it writes where the
    copy would have.
    """

    def __init__(self, bucket_bytes: int, *, cast: CastRule | None = None) -> None:
        if bucket_bytes < MIN_BUCKET_BYTES:
            raise ConfigError(
                f"bucket_bytes={bucket_bytes} is too small; use at least {MIN_BUCKET_BYTES}"
            )
        self.bucket_bytes = bucket_bytes
        self._cast = cast
        self._current = Bucket()

    @property
    def cast_rule(self) -> CastRule | None:
        """The fused cast, if any."""
        return self._cast

    def resume(self, bucket: Bucket) -> None:
        """Go on filling ``bucket`` (nothing placed yet is lost: the builder's current
        bucket must be empty)."""
        if self._current.names:
            raise RuntimeError("BucketBuilder.resume: the current bucket is not empty")
        self._current = bucket

    def add(self, name: str, tensor: torch.Tensor) -> Sequence[Bucket]:
        """Add one tensor; returns the buckets that became full (usually none: a plain
        function, as a generator per tensor costs as much as the rest of this)."""
        if not isinstance(tensor, torch.Tensor):
            raise WireFormatError(
                f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor"
            )
        source_dtype = tensor.dtype
        dtype = source_dtype
        if self._cast is not None:
            dtype = self._cast(name, dtype) or dtype
        wire_dtype, itemsize = _WIRE.get(dtype) or _wire(dtype)  # raises if it can't travel
        shape = tensor.shape  # a tuple (torch.Size)
        nbytes = tensor.numel() * itemsize
        current = self._current
        offset = (current.nbytes + ALIGN - 1) & -ALIGN
        if nbytes > self.bucket_bytes:
            # Its chunks are views of it: no autograd graph for them (a tensor that requires
            # grad is sent as its data, whole or in chunks).
            flat = tensor.detach().reshape(-1)
            return list(self._add_chunked(name, flat, dtype, tuple(shape)))
        full: Sequence[Bucket] = ()
        if offset + nbytes > self.bucket_bytes:
            # Fits in a bucket of its own: close the current one first.
            full = (self._flush_current(),)
            current = self._current
            offset = 0
        move = source_dtype == dtype and tensor.is_cpu and tensor.is_contiguous()
        current.append(name, wire_dtype, shape, offset, nbytes, tensor, move)
        current.tensors += 1
        return full

    def add_patch(
        self,
        name: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        pieces: list[tuple[int, torch.Tensor]],
    ) -> Iterator[Bucket]:
        """Add a patch of tensor ``name`` as its encoded pieces (``(changed elements, uint8
        bytes)``, each at most a bucket): yields each bucket that became full."""
        wire_dtype = dtype_name(dtype)
        for index, (k, payload) in enumerate(pieces):
            extra = (index, len(pieces), 0, k)
            yield from self._piece(name, wire_dtype, shape, payload, torch.uint8, 1, extra)
        self._current.tensors += 1

    def _add_chunked(
        self, name: str, flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> Iterator[Bucket]:
        # ``flat``: one copy at most (non-contiguous input), kept for all chunks.
        room = self.bucket_bytes - align_up(self._current.nbytes)
        # The receiver reassembles into one staging buffer: a chunked tensor must not start
        # in the bucket where the previous chunked tensor ends.
        if room < max(ALIGN, self.bucket_bytes // 8) or self._current.holds_tail:
            # Too little left to be worth a chunk: start the tensor in a fresh bucket.
            if self._current.names:
                yield self._flush_current()
            room = self.bucket_bytes
        wire_dtype, itemsize = _wire(dtype)
        numel = flat.numel()
        spans: list[tuple[int, int]] = []
        start = 0
        while start < numel:
            count = min(numel - start, (room if not spans else self.bucket_bytes) // itemsize)
            spans.append((start, start + count))
            start += count
        for index, (lo, hi) in enumerate(spans):
            extra = (index, len(spans), lo * itemsize, 0)
            yield from self._piece(name, wire_dtype, shape, flat[lo:hi], dtype, itemsize, extra)
        self._current.tensors += 1
        self._current.holds_tail = True

    def _piece(
        self,
        name: str,
        wire_dtype: str,
        shape: tuple[int, ...],
        source: torch.Tensor,
        dtype: torch.dtype,
        itemsize: int,
        extra: tuple[int, int, int, int],
    ) -> Iterator[Bucket]:
        """Place one chunk or patch piece (``source`` as ``dtype``, at most a bucket),
        closing the current bucket first where it does not fit there."""
        nbytes = source.numel() * itemsize
        offset = align_up(self._current.nbytes)
        if offset + nbytes > self.bucket_bytes:
            yield self._flush_current()
            offset = 0
        move = source.dtype == dtype and source.is_cpu and source.is_contiguous()
        self._current.append(name, wire_dtype, shape, offset, nbytes, source, move, extra)

    def _flush_current(self) -> Bucket:
        done, self._current = self._current, Bucket()
        return done

    def flush(self) -> Bucket | None:
        """The last, partly filled bucket, if any tensor is in it."""
        return self._flush_current() if self._current.names else None


# -- receiving: pure checks of untrusted headers ----------------------------------------------
def _outside(name: str, offset: int, nbytes: int, bucket_nbytes: int) -> WireFormatError:
    return WireFormatError(
        f"tensor {name!r} claims bytes [{offset}, {offset + nbytes}) "
        f"outside its bucket of {bucket_nbytes} bytes"
    )


def check_bucket(header: BucketHeader, slot_bytes: int, sync_id: int | None, seq: int) -> None:
    """Refuse a bucket of another sync than ``sync_id``, other than bucket ``seq``, or
    larger than its slot of ``slot_bytes``."""
    if header.sync_id != sync_id:
        raise WireFormatError(f"bucket of sync {header.sync_id} arrived during sync {sync_id}")
    if header.seq != seq:
        raise WireFormatError(
            f"bucket {header.seq} of sync {header.sync_id} arrived; expected bucket {seq}"
        )
    if header.nbytes < 0 or header.nbytes > slot_bytes:
        raise WireFormatError(
            f"bucket {header.seq} claims {header.nbytes} bytes; the slot holds {slot_bytes}"
        )


def check_entry(entry: Entry, max_tensor_bytes: int) -> torch.dtype:
    """Check what one entry says of itself (not where it lies in its bucket, nor how it
    follows the entries before it) and return its dtype; raises :class:`WireFormatError`
    naming the tensor."""
    dtype = dtype_from_name(entry.dtype)
    itemsize = dtype.itemsize
    name = entry.name
    if any(d < 0 for d in entry.shape):
        raise WireFormatError(f"tensor {name!r} has a negative dimension: {list(entry.shape)}")
    if any(d > max_tensor_bytes for d in entry.shape):
        # Even an empty tensor (a 0 elsewhere) cannot have it: torch sizes are int64.
        raise WireFormatError(
            f"tensor {name!r} has a dimension above the limit of {max_tensor_bytes}: "
            f"{list(entry.shape)}"
        )
    total = math.prod(entry.shape) * itemsize
    if total > max_tensor_bytes:
        raise WireFormatError(
            f"tensor {name!r} claims {total} bytes (shape {list(entry.shape)}, {entry.dtype}); "
            f"the limit is {max_tensor_bytes}"
        )
    if entry.offset < 0 or entry.nbytes < 0:
        raise WireFormatError(
            f"tensor {name!r} claims bytes [{entry.offset}, {entry.offset + entry.nbytes}) "
            "outside its bucket"
        )
    if entry.offset % ALIGN:
        raise WireFormatError(f"tensor {name!r} starts at unaligned offset {entry.offset}")
    if entry.nbytes % itemsize:
        raise WireFormatError(
            f"tensor {name!r}: {entry.nbytes} bytes is not a whole number of {entry.dtype}"
        )
    if not 0 <= entry.chunk < entry.chunks:
        raise WireFormatError(f"tensor {name!r}: chunk {entry.chunk} of {entry.chunks}")
    if entry.patch:
        numel = math.prod(entry.shape)
        if entry.patch < 0 or entry.patch > numel:
            raise WireFormatError(
                f"tensor {name!r}: a patch of {entry.patch} elements of a tensor of {numel}"
            )
        if entry.nbytes != patches.patch_nbytes(entry.patch, numel, itemsize):
            raise WireFormatError(
                f"the patch of tensor {name!r} has {entry.nbytes} bytes; {entry.patch} "
                f"elements of {entry.dtype} need "
                f"{patches.patch_nbytes(entry.patch, numel, itemsize)}"
            )
        if entry.tensor_offset:
            raise WireFormatError(f"the patch of tensor {name!r} has a tensor offset")
        return dtype
    if entry.chunks == 1 and (entry.nbytes != total or entry.tensor_offset != 0):
        raise WireFormatError(
            f"tensor {name!r} has {entry.nbytes} bytes; shape {list(entry.shape)} of "
            f"{entry.dtype} needs {total}"
        )
    if entry.tensor_offset < 0 or entry.tensor_offset + entry.nbytes > total:
        raise WireFormatError(
            f"chunk {entry.chunk} of tensor {name!r} claims bytes beyond its {total}"
        )
    return dtype


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides: list[int] = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class CheckedLayout:
    """A layout of whole, plain tensors (no chunks, patches or checksums) whose every entry
    passed :func:`check_entry`: per entry its name, dtype, offset and size, read off the
    layout's columns. Equal to, and hashed as, the layout it was checked from, so a cache
    keyed on it (the unpacker's, a sink's copy plans) finds it by value."""

    __slots__ = (
        "_hash",
        "_views",
        "dtypes",
        "end",
        "layout",
        "names",
        "offsets",
        "sizes",
        "unique",
    )

    def __init__(self, layout: Layout, dtypes: Sequence[torch.dtype]) -> None:
        self.layout = layout
        self.names: tuple[str, ...] = layout.names
        self.dtypes: tuple[torch.dtype, ...] = tuple(dtypes)
        _, _, offsets, sizes = layout.columns()
        self.offsets: np.ndarray = offsets
        self.sizes: np.ndarray = sizes
        #: Where the last byte of any entry lies: the bucket must hold this many. In
        #: Python's integers: a hostile offset near 2**63 must not wrap around.
        self.end = max(map(int.__add__, offsets.tolist(), sizes.tolist()), default=0)
        #: No name comes twice.
        self.unique = len(set(self.names)) == len(self.names)
        self._hash = hash(layout)
        self._views: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, CheckedLayout) and self.layout == other.layout)

    def __len__(self) -> int:
        return len(self.names)

    def shapes(self) -> Iterator[tuple[int, ...]]:
        """Each entry's shape (made from the layout's columns, not kept)."""
        return (e.shape for e in self.layout.entries())

    def views(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each entry's shape and contiguous strides, kept once asked for."""
        if self._views is None:
            self._views = [(shape, _strides(shape)) for shape in self.shapes()]
        return self._views


def check_layout(layout: Layout, max_tensor_bytes: int) -> CheckedLayout:
    """Check a layout without extras: its columns agree, and every entry passes
    :func:`check_entry`. Its names are interned: one string per name with the sink's
    (``ModuleSink`` interns its own), however many layouts hold it."""
    if layout.extras:
        raise ValueError("check_layout takes a layout of whole tensors; check its entries")
    layout = msgspec.structs.replace(layout, names=tuple(map(sys.intern, layout.names)))
    return CheckedLayout(layout, [check_entry(e, max_tensor_bytes) for e in layout.entries()])


def check_fits(checked: CheckedLayout, bucket_nbytes: int) -> CheckedLayout:
    """``checked``, if every entry lies inside a bucket of ``bucket_nbytes``."""
    if checked.end > bucket_nbytes:
        for name, offset, nbytes in zip(
            checked.names, checked.offsets.tolist(), checked.sizes.tolist(), strict=True
        ):
            if offset + nbytes > bucket_nbytes:
                raise _outside(name, offset, nbytes, bucket_nbytes)
    return checked


# -- receiving: what a sink gets ------------------------------------------------------------
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
        """:func:`check_layout` of ``layout``, remembered by its value."""
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
                raise _outside(name, offset, nbytes, header.nbytes)
            region = data[offset : offset + nbytes]
            if entry.checksum is not None and _digest(region) != entry.checksum:
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
