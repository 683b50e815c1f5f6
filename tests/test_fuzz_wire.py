"""Fuzzing the two parsers of untrusted input: the frame decoder and the bucket unpacker.

What may escape, and nothing else:

- :meth:`WireCodec.decode`: :class:`~streamsync.WireFormatError` (its subclass
  :class:`~streamsync.ProtocolVersionError` included) and, on a channel with a secret,
  :class:`~streamsync.AuthenticationError`.
- :meth:`Unpacker.feed` / :meth:`Unpacker.finish`: :class:`~streamsync.WireFormatError` (its
  subclass :class:`~streamsync.ChecksumError` included) and
  :class:`~streamsync.DuplicateTensorError`.
- The pure checks the unpacker is made of (``check_bucket``, ``check_entry``,
  ``check_layout``, ``check_fits``): :class:`~streamsync.WireFormatError`, and what they
  pass is what the bucket format allows.

And the unpacker never allocates from a size it was told rather than given: one bucket never
makes it allocate more than the slot holds, and a run of buckets never more than twice the
bytes they delivered.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamsync._dtypes import DTYPES
from streamsync.errors import (
    AuthenticationError,
    DuplicateTensorError,
    StreamsyncError,
    WireFormatError,
)
from streamsync.wire.checks import check_bucket, check_entry, check_fits, check_layout
from streamsync.wire.frames import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    BucketHeader,
    Bye,
    Done,
    End,
    Entry,
    Failed,
    Hello,
    Joined,
    Layout,
    Message,
    Welcome,
    WireCodec,
)
from streamsync.wire.pack import BucketBuilder
from streamsync.wire.slot import ALIGN, allocate_slot
from streamsync.wire.unpack import Unpacker

DECODE_ERRORS = (WireFormatError, AuthenticationError)
UNPACK_ERRORS = (WireFormatError, DuplicateTensorError)
SLOT_BYTES = 4096
SECRET = b"fuzz-secret"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ------------------------------------------------------------------------
# Integers a hostile peer would pick: edges of every width msgpack carries, and small ones.
edgy_ints = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([-(2**63), -1, 2**31 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1]),
    st.integers(-(2**63), 2**64 - 1),
)
dtype_names = st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=12))
names = st.one_of(st.sampled_from(["w", "a", "b"]), st.text(max_size=20))
entries = st.builds(
    Entry,
    name=names,
    dtype=dtype_names,
    shape=st.lists(edgy_ints, max_size=4).map(tuple),
    offset=st.one_of(st.sampled_from([0, ALIGN, 2 * ALIGN, SLOT_BYTES - ALIGN]), edgy_ints),
    nbytes=st.one_of(st.sampled_from([0, 4, 16, 64, 1024, SLOT_BYTES]), edgy_ints),
    chunk=st.one_of(st.integers(0, 3), edgy_ints),
    chunks=st.one_of(st.integers(1, 4), edgy_ints),
    tensor_offset=st.one_of(st.sampled_from([0, 64, 1024]), edgy_ints),
    checksum=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
I64 = (-(2**63), 2**63 - 1)


def _fits_columns(entry: Entry) -> bool:
    """Whether ``entry`` can be written into a layout's int64 columns at all."""
    return all(I64[0] <= v <= I64[1] for v in (entry.offset, entry.nbytes, *entry.shape))


# Layouts a sender could write (from entries), and columns of arbitrary bytes that disagree
# with each other or with their names.
layouts = st.one_of(
    st.lists(entries.filter(_fits_columns), max_size=4).map(Layout.of),
    st.builds(
        Layout,
        names=st.lists(names, max_size=4).map(tuple),
        dtypes=st.lists(dtype_names, max_size=3).map(tuple),
        dtype_index=st.binary(max_size=5),
        ndims=st.binary(max_size=5),
        dims=st.binary(max_size=40),
        offsets=st.binary(max_size=40),
        nbytes=st.binary(max_size=40),
    ),
)
headers = st.builds(
    BucketHeader,
    sync_id=st.just(1),
    seq=st.integers(0, 3),
    slot=edgy_ints,
    nbytes=st.one_of(st.sampled_from([0, 64, 1024, SLOT_BYTES]), edgy_ints),
    layout=layouts,
)
messages: st.SearchStrategy[Message] = st.one_of(
    headers,
    st.builds(Hello, receiver=st.text(max_size=10), pid=edgy_ints, nonce=st.binary(max_size=16)),
    st.builds(Welcome, index=edgy_ints, slots=edgy_ints, slot_bytes=edgy_ints),
    st.builds(Joined, receiver=edgy_ints),
    st.builds(End, sync_id=edgy_ints, buckets=edgy_ints, tensors=edgy_ints, nbytes=edgy_ints),
    st.builds(Abort, sync_id=edgy_ints, reason=st.text(max_size=10)),
    st.builds(Ack, sync_id=edgy_ints, seq=edgy_ints, slot=edgy_ints, receiver=edgy_ints),
    st.builds(
        Done,
        sync_id=edgy_ints,
        receiver=edgy_ints,
        tensors=edgy_ints,
        nbytes=edgy_ints,
        skipped=st.lists(st.text(max_size=8), max_size=3).map(tuple),
        added=st.lists(st.text(max_size=8), max_size=3).map(tuple),
    ),
    st.builds(Failed, sync_id=edgy_ints, receiver=edgy_ints, error=st.text(), message=st.text()),
    st.builds(Bye, reason=st.text(max_size=10)),
)


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply byte edits: (kind, position, value) = flip, delete, insert or truncate."""
    out = bytearray(data)
    for kind, pos, value in edits:
        if not out:
            out.append(value)
            continue
        pos %= len(out)
        if kind == 0:
            out[pos] ^= value or 0xFF
        elif kind == 1:
            del out[pos : pos + 1 + value % 8]
        elif kind == 2:
            out[pos:pos] = bytes([value]) * (1 + value % 5)
        else:
            del out[pos:]
    return bytes(out)


byte_edits = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)),
    min_size=1,
    max_size=6,
)


def _decode(codec: WireCodec, frame: bytes) -> Message | None:
    try:
        return codec.decode(frame)
    except DECODE_ERRORS:
        return None


# -- the frame decoder -----------------------------------------------------------------
@FUZZ
@given(frame=st.binary(max_size=512), secret=st.sampled_from([None, SECRET]))
def test_decoding_random_bytes_raises_only_wire_errors(frame: bytes, secret: bytes | None) -> None:
    _decode(WireCodec(secret), frame)


@FUZZ
@given(msg=messages, edits=byte_edits, secret=st.sampled_from([None, SECRET]))
def test_decoding_mutated_frames_raises_only_wire_errors(
    msg: Message, edits: list[tuple[int, int, int]], secret: bytes | None
) -> None:
    codec = WireCodec(secret)
    frame = codec.encode(msg)
    try:
        assert codec.decode(frame) == msg or isinstance(msg, BucketHeader)
    except WireFormatError:
        assert isinstance(msg, BucketHeader)  # a layout the decoder's cheap checks refuse
    _decode(codec, _mutate(frame, edits))


@FUZZ
@given(msg=messages, edits=byte_edits)
def test_mutated_bodies_under_a_valid_mac_raise_only_wire_errors(
    msg: Message, edits: list[tuple[int, int, int]]
) -> None:
    # A peer holding the secret (or a bug on its side): the MAC checks out, the body is bad.
    codec = WireCodec(SECRET)
    body = _mutate(msgspec.msgpack.encode(msg), edits)
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION, msgspec.Raw(body), codec._mac(body)])
    _decode(codec, frame)


@FUZZ
@given(version=edgy_ints.filter(lambda v: v != PROTOCOL_VERSION), msg=messages)
def test_another_protocol_version_is_named(version: int, msg: Message) -> None:
    body = msgspec.msgpack.encode(msg)
    frame = msgspec.msgpack.encode([version, msgspec.Raw(body), b""])
    with pytest.raises(WireFormatError, match=f"version {version}"):
        WireCodec().decode(frame)


def test_a_frame_without_the_mac_is_not_authenticated() -> None:
    frame = WireCodec(None).encode(Bye("hi"))
    with pytest.raises(AuthenticationError):
        WireCodec(SECRET).decode(frame)
    with pytest.raises(AuthenticationError):
        WireCodec(b"another").decode(WireCodec(SECRET).encode(Bye("hi")))


# -- the unpacker ------------------------------------------------------------------------
class _Allocations:
    """An unpacker's allocator that records the size of every buffer it makes, so a test
    can bound them."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return allocate_slot(nbytes)


def _feed_all(seq_headers: list[BucketHeader], slot: torch.Tensor) -> list[int]:
    """Feed ``seq_headers`` into a fresh unpacker until one is refused; checks what escapes
    and what was allocated."""
    allocations = _Allocations()
    sizes = allocations.sizes
    unpacker = Unpacker(max_tensor_bytes=1 << 30, allocate=allocations)
    unpacker.begin(1)
    delivered = 0
    for header in seq_headers:
        before = len(sizes)
        try:
            out = unpacker.feed(header, slot)
        except UNPACK_ERRORS:
            break
        except StreamsyncError as exc:  # pragma: no cover - the failure message
            raise AssertionError(f"undocumented {type(exc).__name__}: {exc}") from exc
        delivered += header.nbytes
        for size in sizes[before:]:
            assert size <= 2 * delivered, f"allocated {size} after {delivered} bytes arrived"
        for name, tensor in out:
            assert isinstance(name, str) and tensor.numel() * tensor.element_size() <= (
                max(delivered, 1) * 2
            )
    if sizes:
        assert sizes[0] <= SLOT_BYTES, f"one bucket allocated {sizes[0]} bytes"
    return sizes


@FUZZ
@given(seq_headers=st.lists(headers, min_size=1, max_size=4), fill=st.integers(0, 255))
def test_unpacking_random_headers_raises_only_wire_errors(
    seq_headers: list[BucketHeader], fill: int
) -> None:
    # Renumber so that sequence checks do not stop every example at the first bucket.
    seq_headers = [
        BucketHeader(1, i, h.slot, h.nbytes, h.layout) for i, h in enumerate(seq_headers)
    ]
    _feed_all(seq_headers, torch.full((SLOT_BYTES,), fill, dtype=torch.uint8))


def _valid_buckets(sizes: list[int], bucket_bytes: int) -> tuple[list[BucketHeader], torch.Tensor]:
    """Real buckets of float32 tensors (some chunked), packed into consecutive slots of one
    buffer; header ``i`` describes slot ``i``."""
    builder = BucketBuilder(bucket_bytes)
    planned = [b for i, n in enumerate(sizes) for b in builder.add(f"t{i}", torch.rand(n))]
    last = builder.flush()
    planned += [last] if last is not None else []
    slots = torch.zeros(max(1, len(planned)), SLOT_BYTES, dtype=torch.uint8)
    out = []
    for seq, bucket in enumerate(planned):
        layout = bucket.pack_into(slots[seq], checksum=seq % 2 == 0)
        out.append(BucketHeader(1, seq, 0, bucket.nbytes, layout))
    return out, slots


fields = st.sampled_from(
    ["name", "dtype", "shape", "offset", "nbytes", "chunk", "chunks", "tensor_offset", "checksum"]
)


def _mutated_entry(entry: Entry, field: str, value: Any) -> Entry:
    values = msgspec.structs.asdict(entry)
    if field == "name":
        value = "t0" if value % 2 else str(value)
    elif field == "dtype":
        value = sorted(DTYPES)[value % len(DTYPES)]
    elif field == "shape":
        value = (*entry.shape, value) if value % 3 == 0 else (value,)
    values[field] = value
    return Entry(**values)


@FUZZ
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=5),
    bucket_bytes=st.sampled_from([1024, 2048, SLOT_BYTES]),
    mutations=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 6), fields, edgy_ints),
        min_size=1,
        max_size=3,
    ),
)
def test_unpacking_mutated_real_buckets_raises_only_wire_errors(
    sizes: list[int],
    bucket_bytes: int,
    mutations: list[tuple[int, int, str, int]],
) -> None:
    valid, slots = _valid_buckets(sizes, bucket_bytes)
    seq_headers = list(valid)
    for which, index, field, value in mutations:
        header = seq_headers[which % len(seq_headers)]
        if not header.entries:
            continue
        items = list(header.entries)
        mutated = _mutated_entry(items[index % len(items)], field, value)
        if not _fits_columns(mutated):
            continue  # a layout's int64 columns cannot say it
        items[index % len(items)] = mutated
        seq_headers[which % len(seq_headers)] = BucketHeader(
            1, header.seq, header.slot, header.nbytes, Layout.of(items)
        )
    allocations = _Allocations()
    allocated = allocations.sizes
    unpacker = Unpacker(max_tensor_bytes=1 << 30, allocate=allocations)
    unpacker.begin(1)
    delivered = 0
    try:
        for header in seq_headers:
            unpacker.feed(header, slots[header.seq])
            delivered += header.nbytes
            assert all(size <= 2 * delivered for size in allocated), (allocated, delivered)
        unpacker.finish(End(1, len(valid), len(sizes), sum(h.nbytes for h in valid)))
    except UNPACK_ERRORS:
        return


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=5))
def test_real_buckets_through_the_codec_unpack_intact(sizes: list[int]) -> None:
    # The property above is not vacuous: unmutated buckets, encoded and decoded as on the
    # wire, unpack completely.
    valid, slots = _valid_buckets(sizes, 1024)
    codec = WireCodec(SECRET)
    unpacker = Unpacker()
    unpacker.begin(1)
    got = []
    for header in valid:
        decoded = codec.decode(codec.encode(header))
        assert isinstance(decoded, BucketHeader)
        got += [name for name, _ in unpacker.feed(decoded, slots[header.seq])]
    unpacker.finish(End(1, len(valid), len(sizes), sum(h.nbytes for h in valid)))
    assert got == [f"t{i}" for i in range(len(sizes))]


@pytest.mark.parametrize(
    "entry",
    [
        # A chunked tensor claiming 1 GiB: only its first chunk's bytes are allocated.
        Entry("huge", "float32", (1 << 28,), 0, 1024, 0, 1 << 20, 0),
        # Right at the limit, and a dimension torch could not even represent.
        Entry("limit", "uint8", (1 << 30,), 0, 64, 0, 2, 0),
        Entry("empty", "float32", (0, 2**63 - 1), 0, 0),
    ],
)
def test_absurd_claims_allocate_at_most_what_arrived(entry: Entry) -> None:
    slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    allocations = _Allocations()
    unpacker = Unpacker(max_tensor_bytes=1 << 30, allocate=allocations)
    unpacker.begin(1)
    sizes = allocations.sizes
    with contextlib.suppress(*UNPACK_ERRORS):
        unpacker.feed(BucketHeader(1, 0, 0, SLOT_BYTES, Layout.of([entry])), slot)
    assert all(size <= entry.nbytes for size in sizes), sizes


def test_staging_grows_with_the_chunks_and_is_kept_across_syncs() -> None:
    big = torch.rand(5000)  # 20000 bytes in 1 KiB buckets: about 20 chunks
    builder = BucketBuilder(1024)
    planned = list(builder.add("big", big))
    last = builder.flush()
    planned += [last] if last is not None else []
    allocations = _Allocations()
    unpacker = Unpacker(allocate=allocations)
    for sync_id in (1, 2):
        unpacker.begin(sync_id)
        slot = torch.zeros(1024, dtype=torch.uint8)
        sizes = allocations.sizes = []
        delivered, got = 0, []
        for seq, bucket in enumerate(planned):
            layout = bucket.pack_into(slot)
            header = BucketHeader(sync_id, seq, 0, bucket.nbytes, layout)
            got += unpacker.feed(header, slot)
            delivered += bucket.nbytes
            assert sum(sizes) <= 4 * delivered
        assert torch.equal(got[0][1], big)
        if sync_id == 2:
            assert sizes == []  # the buffer from the first sync is big enough


# -- the pure checks -------------------------------------------------------------------
@FUZZ
@given(entry=entries, limit=st.sampled_from([0, 64, 1 << 30, 1 << 40]))
def test_check_entry_raises_only_wire_errors_and_passes_only_what_fits(
    entry: Entry, limit: int
) -> None:
    try:
        dtype = check_entry(entry, limit)
    except WireFormatError:
        return
    itemsize = dtype.itemsize
    total = math.prod(entry.shape) * itemsize
    assert dtype == DTYPES[entry.dtype] and total <= limit
    assert entry.offset >= 0 and entry.offset % ALIGN == 0
    assert entry.nbytes >= 0 and entry.nbytes % itemsize == 0
    assert 0 <= entry.chunk < entry.chunks
    if entry.patch:
        assert 0 < entry.patch <= math.prod(entry.shape)
    else:
        assert entry.tensor_offset >= 0 and entry.tensor_offset + entry.nbytes <= total
        assert entry.chunks > 1 or entry.nbytes == total


@FUZZ
@given(layout=layouts, nbytes=st.one_of(st.sampled_from([0, 64, SLOT_BYTES]), edgy_ints))
def test_check_layout_and_check_fits_raise_only_wire_errors(layout: Layout, nbytes: int) -> None:
    if layout.extras:
        return  # only layouts of whole, plain tensors are checked as a whole
    try:
        checked = check_layout(layout, 1 << 30)
    except WireFormatError:
        return
    items = layout.entries()
    assert checked == check_layout(Layout(*msgspec.structs.astuple(layout)), 1 << 30)
    assert list(checked.names) == [e.name for e in items]
    assert list(checked.shapes()) == [e.shape for e in items]
    assert checked.views() == [
        (e.shape, torch.empty(e.shape, device="meta").stride()) for e in items
    ]
    assert list(checked.dtypes) == [check_entry(e, 1 << 30) for e in items]
    fits = all(e.offset + e.nbytes <= nbytes for e in items)
    try:
        assert check_fits(checked, nbytes) is checked and fits
    except WireFormatError:
        assert not fits


@FUZZ
@given(header=headers, slot=edgy_ints, sync_id=st.one_of(st.none(), edgy_ints), seq=edgy_ints)
def test_check_bucket_passes_only_this_syncs_next_bucket_within_its_slot(
    header: BucketHeader, slot: int, sync_id: int | None, seq: int
) -> None:
    try:
        check_bucket(header, slot, sync_id, seq)
    except WireFormatError:
        return
    assert header.sync_id == sync_id and header.seq == seq and 0 <= header.nbytes <= slot
