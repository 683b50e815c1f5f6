"""Packing, the sender's side of the bucket format: :class:`BucketBuilder` groups named
tensors into :class:`Bucket` plans, and :meth:`Bucket.pack_into` copies one into a slot's
bytes, returning the :class:`~streamsync.wire.frames.Layout` its header carries. The
receiver's side is :mod:`streamsync.wire.unpack`.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Final

import torch

from streamsync._copies import CopyBatch, MovePlan
from streamsync._dtypes import dtype_from_name, dtype_name
from streamsync.errors import ConfigError, WireFormatError
from streamsync.wire.frames import Entry, Extra, Layout
from streamsync.wire.slot import ALIGN, digest

#: The smallest bucket accepted.
MIN_BUCKET_BYTES: Final = 1024
#: Bytes per bucket (and transport slot) unless told otherwise: measured into vLLM, 64 MiB
#: buckets beat 16 and 32 MiB (BENCHMARKS.md).
DEFAULT_BUCKET_BYTES: Final = 64 << 20

#: A fused cast: ``(name, dtype) -> dtype to send, or None to send as is``; it decides on
#: the name and dtype alone, never by converting the tensor.
CastRule = Callable[[str, torch.dtype], "torch.dtype | None"]


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
                digest(buf[offset : offset + nbytes])
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
        #: The fused cast, if any.
        self.cast_rule = cast
        self._current = Bucket()

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
        if self.cast_rule is not None:
            dtype = self.cast_rule(name, dtype) or dtype
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
