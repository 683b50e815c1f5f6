"""Pure checks of a bucket header's untrusted fields, on the receiver: each raises
:class:`~streamsync.errors.WireFormatError` naming the tensor, so a malformed or hostile
header never has bytes read or written outside its tensors. They keep no state (fuzzed
directly); :class:`~streamsync.wire.unpack.Unpacker` calls them, then checks the order of
what arrives.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence

import msgspec
import numpy as np
import torch

from streamsync._dtypes import dtype_from_name
from streamsync.errors import WireFormatError
from streamsync.wire import patch as patches
from streamsync.wire.frames import BucketHeader, Entry, Layout
from streamsync.wire.slot import ALIGN


def outside_bucket(name: str, offset: int, nbytes: int, bucket_nbytes: int) -> WireFormatError:
    """The error for tensor ``name`` claiming bytes ``[offset, offset + nbytes)`` beyond its
    bucket of ``bucket_nbytes``."""
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
                raise outside_bucket(name, offset, nbytes, bucket_nbytes)
    return checked
