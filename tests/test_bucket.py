"""The bucket format: alignment, every dtype, chunking, validation of untrusted headers."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import msgspec
import pytest
import torch
from conftest import WIRE_DTYPES, random_tensor, same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsync.errors import (
    ChecksumError,
    ConfigError,
    DuplicateTensorError,
    WireFormatError,
)
from streamsync.testing.buckets import pack_bucket
from streamsync.wire.frames import BucketHeader, End, Entry, Layout
from streamsync.wire.pack import KEPT_PLAN_ENTRIES, BucketBuilder
from streamsync.wire.slot import ALIGN, allocate_slot
from streamsync.wire.unpack import BucketTensors, Unpacker


def roundtrip(
    tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, *, checksum: bool = False
) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Pack through the builder, unpack through the unpacker; returns copies and #buckets."""
    builder = BucketBuilder(bucket_bytes)
    buckets = [b for name, t in tensors for b in builder.add(name, t)]
    last = builder.flush()
    if last is not None:
        buckets.append(last)
    unpacker = Unpacker()
    unpacker.begin(7)
    out: list[tuple[str, torch.Tensor]] = []
    total = 0
    slot = torch.empty(bucket_bytes, dtype=torch.uint8)  # reused, as transports do
    for seq, bucket in enumerate(buckets):
        assert bucket.nbytes <= bucket_bytes
        slot.fill_(0xA5)
        layout = bucket.pack_into(slot, checksum=checksum)
        header = BucketHeader(7, seq, 0, bucket.nbytes, layout)
        out.extend((n, t.clone()) for n, t in unpacker.feed(header, slot))
        total += bucket.nbytes
    tensor_count = sum(b.tensors for b in buckets)
    unpacker.finish(End(7, len(buckets), tensor_count, total))
    return out, len(buckets)


def test_odd_bf16_then_fp32_is_aligned() -> None:
    # A bf16 tensor of odd length followed by an fp32 one: the case that crashes verl.
    a = torch.randn(3).to(torch.bfloat16)
    b = torch.randn(5)
    builder = BucketBuilder(4096)
    assert list(builder.add("a", a)) == []
    assert list(builder.add("b", b)) == []
    bucket = builder.flush()
    assert bucket is not None
    assert [e.offset % ALIGN for e in bucket.entries] == [0, 0]
    assert bucket.entries[1].offset == ALIGN
    out, _ = roundtrip([("a", a), ("b", b)], 4096)
    assert same_bits(out[0][1], a) and same_bits(out[1][1], b)


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_every_dtype_roundtrips_bit_exactly(dtype: torch.dtype) -> None:
    tensors = [
        ("odd", random_tensor((7,), dtype, 1)),
        ("matrix", random_tensor((5, 3), dtype, 2)),
        ("scalar", random_tensor((), dtype, 3)),
        ("empty", random_tensor((0, 4), dtype, 4)),
        ("big", random_tensor((1100,), dtype, 5)),  # > 1 KiB even at 1 byte: chunked
    ]
    out, nbuckets = roundtrip(tensors, 1024, checksum=True)
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (_, got), (name, want) in zip(out, tensors, strict=True):
        assert same_bits(got, want), name
    assert nbuckets >= 2


def test_non_contiguous_inputs_roundtrip() -> None:
    base = torch.randn(8, 6)
    views = [("t", base.t()), ("step", base[:, ::2]), ("big_t", torch.randn(40, 30).t())]
    out, _ = roundtrip(views, 1024)
    for (_, got), (_, want) in zip(out, views, strict=True):
        assert got.is_contiguous()
        assert torch.equal(got, want)


def test_oversize_tensor_is_chunked_and_reassembled() -> None:
    big = torch.arange(10_000, dtype=torch.float32)
    out, nbuckets = roundtrip(
        [("small", torch.ones(3)), ("big", big), ("after", torch.zeros(2))], 4096
    )
    assert nbuckets >= 10
    assert torch.equal(dict(out)["big"], big)
    assert [n for n, _ in out] == ["small", "big", "after"]


def test_first_chunk_fills_the_current_bucket() -> None:
    builder = BucketBuilder(4096)
    list(builder.add("small", torch.ones(16)))  # 64 bytes used
    full = list(builder.add("big", torch.zeros(3000)))  # 12000 bytes
    assert full[0].entries[0].name == "small"
    assert full[0].entries[1].chunk == 0 and full[0].entries[1].nbytes == 4096 - 64


def test_fused_cast_converts_while_packing() -> None:
    src = torch.randn(100, dtype=torch.float32)
    builder = BucketBuilder(1024, cast=lambda name, t: torch.bfloat16)
    buckets = list(builder.add("w", src))
    last = builder.flush()
    buckets += [last] if last else []
    assert {e.dtype for b in buckets for e in b.entries} == {"bfloat16"}
    unpacker = Unpacker()
    unpacker.begin(1)
    got = None
    for seq, b in enumerate(buckets):
        packed = pack_bucket(b)
        for _, t in unpacker.feed(
            BucketHeader(1, seq, 0, b.nbytes, Layout.of(packed.entries)), packed.data
        ):
            got = t.clone()
    assert got is not None and same_bits(got, src.to(torch.bfloat16))


def test_bucket_size_below_minimum_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 1024"):
        BucketBuilder(512)


def _header(entries: tuple[Entry, ...], nbytes: int = 256, seq: int = 0) -> BucketHeader:
    return BucketHeader(1, seq, 0, nbytes, Layout.of(entries))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (Entry("x", "float32", (1000,), 0, 4000), "outside its bucket"),
        (Entry("x", "float32", (4,), 8, 16), "unaligned"),
        (Entry("x", "float32", (5,), 0, 16), "needs 20"),
        (Entry("x", "complex256", (1,), 0, 4), "unknown dtype"),
        (Entry("x", "float32", (-1, 4), 0, 16), "negative"),
        (Entry("x", "float32", (1 << 40, 1 << 20), 0, 16), "limit"),
        (Entry("x", "float32", (4,), 0, 16, 3, 2), "chunk 3 of 2"),
        (Entry("x", "float32", (8,), 0, 16, 1, 2, 16), "out of order"),
    ],
)
def test_untrusted_header_is_rejected_naming_the_tensor(entry: Entry, match: str) -> None:
    unpacker = Unpacker(max_tensor_bytes=1 << 30)
    unpacker.begin(1)
    with pytest.raises(WireFormatError, match=match) as info:
        unpacker.feed(_header((entry,)), torch.zeros(256, dtype=torch.uint8))
    assert "x" in str(info.value) or "dtype" in str(info.value)


def test_checked_entries_are_checked_again_under_a_lower_limit_or_a_smaller_bucket() -> None:
    """The unpacker remembers entries that passed its checks (a model's entries repeat every
    sync); a lower ``max_tensor_bytes`` or a bucket too short for the entry still refuses."""
    entry = Entry("x", "float32", (64,), 0, 256)
    data = torch.zeros(256, dtype=torch.uint8)
    unpacker = Unpacker(max_tensor_bytes=1 << 30)
    for sync in (1, 2):
        unpacker.begin(sync)
        ((name, view),) = unpacker.feed(BucketHeader(sync, 0, 0, 256, Layout.of([entry])), data)
        assert name == "x" and view.shape == (64,) and view.dtype == torch.float32
    unpacker.begin(3)
    with pytest.raises(WireFormatError, match="outside its bucket of 128"):
        unpacker.feed(BucketHeader(3, 0, 0, 128, Layout.of([entry])), data)
    unpacker.max_tensor_bytes = 128
    unpacker.begin(4)
    with pytest.raises(WireFormatError, match="limit is 128"):
        unpacker.feed(BucketHeader(4, 0, 0, 256, Layout.of([entry])), data)


def test_views_of_mixed_dtypes_in_one_bucket_are_where_their_entries_say() -> None:
    builder = BucketBuilder(4096)
    weights = {
        "a": torch.arange(3, dtype=torch.bfloat16),
        "b": torch.arange(5, dtype=torch.float32).view(5, 1),
        "c": torch.arange(7, dtype=torch.int64),
        "d": torch.arange(9, dtype=torch.bfloat16).view(3, 3),
    }
    for name, tensor in weights.items():
        assert not list(builder.add(name, tensor))
    bucket = builder.flush()
    assert bucket is not None
    packed = pack_bucket(bucket)
    unpacker = Unpacker()
    unpacker.begin(1)
    got = dict(unpacker.feed(_header(packed.entries, bucket.nbytes), packed.data))
    for name, tensor in weights.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_header_larger_than_slot_is_rejected() -> None:
    unpacker = Unpacker()
    unpacker.begin(1)
    with pytest.raises(WireFormatError, match="slot holds 256"):
        unpacker.feed(_header((), nbytes=10_000), torch.zeros(256, dtype=torch.uint8))


def test_checksum_mismatch_names_the_tensor() -> None:
    builder = BucketBuilder(1024)
    list(builder.add("w", torch.ones(8)))
    bucket = builder.flush()
    assert bucket is not None
    slot = torch.zeros(1024, dtype=torch.uint8)
    layout = bucket.pack_into(slot, checksum=True)
    slot[3] ^= 0xFF
    unpacker = Unpacker()
    unpacker.begin(1)
    with pytest.raises(ChecksumError, match="'w'"):
        unpacker.feed(_header(layout.entries(), bucket.nbytes), slot)


def test_duplicate_name_in_one_sync_is_refused() -> None:
    unpacker = Unpacker()
    unpacker.begin(1)
    data = torch.zeros(256, dtype=torch.uint8)
    entry = Entry("w", "float32", (4,), 0, 16)
    unpacker.feed(_header((entry,)), data)
    with pytest.raises(DuplicateTensorError, match="'w'"):
        unpacker.feed(_header((entry,), seq=1), data)


def test_end_counts_must_match() -> None:
    unpacker = Unpacker()
    unpacker.begin(1)
    unpacker.feed(
        _header((Entry("w", "float32", (4,), 0, 16),), 16), torch.zeros(256, dtype=torch.uint8)
    )
    with pytest.raises(WireFormatError, match="sent 2 buckets"):
        unpacker.finish(End(1, 2, 1, 16))
    unpacker.finish(End(1, 1, 1, 16))


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(WIRE_DTYPES), shapes, st.booleans()), max_size=12),
    bucket_bytes=st.integers(1024, 4096),
    big=st.integers(0, 2000),
)
def test_bucket_format_property(
    specs: list[tuple[torch.dtype, tuple[int, ...], bool]], bucket_bytes: int, big: int
) -> None:
    tensors = []
    for i, (dtype, shape, transpose) in enumerate(specs):
        t = random_tensor(shape, dtype, i)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)
        tensors.append((f"t{i}", t))
    tensors.append(("big", random_tensor((big,), torch.float32, 99)))
    out, _ = roundtrip(tensors, bucket_bytes, checksum=True)
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (_, got), (_, want) in zip(out, tensors, strict=True):
        assert same_bits(got, want)


def test_chunked_tensor_never_starts_where_another_ends() -> None:
    # Two chunked tensors back to back: the second must begin in a fresh bucket, since the
    # receiver hands the first to the sink from its one staging buffer.
    tensors = [("a", torch.arange(300.0)), ("b", torch.arange(300.0) + 1000)]
    out, _ = roundtrip(tensors, 1024)
    assert torch.equal(dict(out)["a"], tensors[0][1]) and torch.equal(dict(out)["b"], tensors[1][1])


def test_unpacker_refuses_chunk_starting_where_another_ends() -> None:
    unpacker = Unpacker()
    unpacker.begin(1)
    data = torch.zeros(1024, dtype=torch.uint8)
    unpacker.feed(_header((Entry("a", "float32", (8,), 0, 16, 0, 2, 0),), 1024), data)
    with pytest.raises(WireFormatError, match="'b' starts in the bucket"):
        unpacker.feed(
            _header(
                (
                    Entry("a", "float32", (8,), 0, 16, 1, 2, 16),
                    Entry("b", "float32", (8,), 64, 16, 0, 2, 0),
                ),
                1024,
                seq=1,
            ),
            data,
        )


# -- every guard of the unpacker, each with a header only it refuses ------------------------
_LIMIT = 4096  # max_tensor_bytes of the unpacker below
_A0 = Entry("a", "float32", (8,), 0, 16, 0, 2, 0)  # the first half of a 32-byte tensor


def _bucket(seq: int, *entries: Entry, nbytes: int = 256, sync_id: int = 1) -> BucketHeader:
    return BucketHeader(sync_id, seq, 0, nbytes, Layout.of(entries))


# Steps fed to a fresh unpacker in sync 1 over a 256-byte slot: every step but the last is
# accepted, the last is refused with a WireFormatError matching the pattern.
_REFUSED: dict[str, tuple[list[BucketHeader | End], str]] = {
    "bucket-of-another-sync": ([_bucket(0, sync_id=2)], "bucket of sync 2 arrived during sync 1"),
    "bucket-skipped": ([_bucket(1)], "bucket 1 of sync 1 arrived; expected bucket 0"),
    "bucket-of-negative-size": ([_bucket(0, nbytes=-64)], "claims -64 bytes"),
    "tensor-over-the-limit": (
        [_bucket(0, Entry("x", "float32", (2048,), 0, 64, 0, 128, 0))],
        f"'x' claims 8192 bytes .* the limit is {_LIMIT}",
    ),
    "entry-before-the-bucket": (
        [_bucket(0, Entry("x", "float32", (4,), -64, 16))],
        r"'x' claims bytes \[-64, -48\) outside its bucket",
    ),
    "entry-of-negative-size": (
        [_bucket(0, Entry("x", "float32", (8,), 0, -4, 0, 2, 0))],
        r"'x' claims bytes \[0, -4\) outside its bucket",
    ),
    "entry-of-part-of-an-element": (
        [_bucket(0, Entry("x", "float32", (8,), 0, 6, 0, 2, 0))],
        "'x': 6 bytes is not a whole number of float32",
    ),
    "chunk-past-its-tensor": (
        [_bucket(0, Entry("x", "float32", (8,), 0, 64, 0, 2, 0))],
        "chunk 0 of tensor 'x' claims bytes beyond its 32",
    ),
    "chunk-before-its-tensor": (
        [_bucket(0, Entry("x", "float32", (8,), 0, 16, 0, 2, -64))],
        "chunk 0 of tensor 'x' claims bytes beyond its 32",
    ),
    "tensor-inside-a-chunked-one": (
        [_bucket(0, _A0), _bucket(1, Entry("b", "float32", (4,), 0, 16))],
        "'b' arrived before chunked tensor 'a' was complete",
    ),
    "chunked-inside-a-chunked-one": (
        [_bucket(0, _A0), _bucket(1, Entry("b", "float32", (8,), 0, 16, 0, 2, 0))],
        "'b' started before tensor 'a' was complete",
    ),
    "chunk-of-another-tensor": (
        [_bucket(0, _A0), _bucket(1, Entry("b", "float32", (8,), 0, 16, 1, 2, 16))],
        "chunk 1 of tensor 'b' arrived out of order",
    ),
    "chunk-skipped": (
        [
            _bucket(0, Entry("a", "float32", (12,), 0, 16, 0, 3, 0)),
            _bucket(1, Entry("a", "float32", (12,), 0, 16, 2, 3, 16)),  # at the right offset
        ],
        "chunk 2/3 of tensor 'a' does not continue chunk 0",
    ),
    "chunk-count-changes": (
        [_bucket(0, _A0), _bucket(1, Entry("a", "float32", (8,), 0, 16, 1, 3, 16))],
        "chunk 1/3 of tensor 'a' does not continue",
    ),
    "chunk-overwrites-the-last": (
        [_bucket(0, _A0), _bucket(1, Entry("a", "float32", (8,), 0, 16, 1, 2, 0))],
        "chunk 1/2 of tensor 'a' does not continue .*expected offset 16",
    ),
    "chunk-changes-dtype": (
        [_bucket(0, _A0), _bucket(1, Entry("a", "int32", (8,), 0, 16, 1, 2, 16))],
        "chunk 1/2 of tensor 'a' does not continue",
    ),
    "chunk-changes-shape": (
        [_bucket(0, _A0), _bucket(1, Entry("a", "float32", (2, 4), 0, 16, 1, 2, 16))],
        "chunk 1/2 of tensor 'a' does not continue",
    ),
    "chunks-fall-short": (
        [_bucket(0, _A0), _bucket(1, Entry("a", "float32", (8,), 0, 8, 1, 2, 16))],
        "'a': chunks add up to 24 bytes, expected 32",
    ),
    "end-of-another-sync": ([End(2, 0, 0, 0)], "end of sync 2 arrived during sync 1"),
    "end-with-a-tensor-incomplete": (
        [_bucket(0, _A0), End(1, 1, 0, 256)],
        r"sync 1 ended with tensor 'a' incomplete \(1 of 2 chunks\)",
    ),
}


@pytest.mark.parametrize(("steps", "match"), list(_REFUSED.values()), ids=list(_REFUSED))
def test_each_unpacker_guard_refuses_what_only_it_catches(
    steps: list[BucketHeader | End], match: str
) -> None:
    unpacker = Unpacker(max_tensor_bytes=_LIMIT)
    unpacker.begin(1)
    data = torch.zeros(256, dtype=torch.uint8)

    def step(item: BucketHeader | End) -> None:
        if isinstance(item, End):
            unpacker.finish(item)
        else:
            unpacker.feed(item, data)

    *accepted, refused = steps
    for item in accepted:
        step(item)
    with pytest.raises(WireFormatError, match=match):
        step(refused)


def _chunked(
    name: str, tensor: torch.Tensor, bucket_bytes: int = 1024, sync_id: int = 1
) -> list[tuple[BucketHeader, torch.Tensor]]:
    """``tensor`` packed in buckets of ``bucket_bytes`` (it is larger: chunked), each with
    its own slot."""
    builder = BucketBuilder(bucket_bytes)
    planned = list(builder.add(name, tensor))
    last = builder.flush()
    planned += [last] if last is not None else []
    out = []
    for seq, bucket in enumerate(planned):
        slot = torch.zeros(bucket_bytes, dtype=torch.uint8)
        layout = bucket.pack_into(slot)
        out.append((BucketHeader(sync_id, seq, 0, bucket.nbytes, layout), slot))
    return out


@pytest.mark.parametrize(
    "offered",
    [
        pytest.param(lambda: torch.zeros(600, dtype=torch.int32), id="another-dtype"),
        pytest.param(lambda: torch.zeros(300, 2), id="another-shape"),
        pytest.param(lambda: torch.zeros(600, 2)[:, 0], id="not-contiguous"),
        pytest.param(lambda: torch.zeros(600, device="meta"), id="not-on-the-cpu"),
    ],
)
def test_a_target_that_does_not_fit_is_not_written_into(
    offered: Callable[[], torch.Tensor],
) -> None:
    # A sink's target must be exactly the tensor's dtype, shape, contiguous and on the CPU;
    # anything else is left alone and the chunks are reassembled in the staging buffer.
    big = torch.arange(600.0)
    target = offered()
    before = target.clone() if target.device.type == "cpu" else None
    unpacker = Unpacker()
    unpacker.begin(1)
    got = []
    for header, slot in _chunked("big", big):
        got += unpacker.feed(header, slot, target=lambda name, dtype, shape: target)
    assert [name for name, _ in got] == ["big"] and torch.equal(got[0][1], big)
    assert got[0][1] is not target and unpacker.touched == []
    if before is not None:
        assert torch.equal(target, before)


def test_a_target_that_fits_receives_the_chunks() -> None:
    big = torch.arange(600.0)
    target = torch.zeros(600)
    unpacker = Unpacker()
    unpacker.begin(1)
    got = []
    for header, slot in _chunked("big", big):
        got += unpacker.feed(header, slot, target=lambda name, dtype, shape: target)
    assert got[0][1] is target and torch.equal(target, big) and unpacker.touched == ["big"]


def test_staging_never_grows_past_the_tensor() -> None:
    # 1000 bytes of chunks after a 1 KiB first chunk: doubling would allocate 2 KiB.
    sizes = []

    def recording(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return allocate_slot(nbytes)

    unpacker = Unpacker(allocate=recording)
    unpacker.begin(1)
    for header, slot in _chunked("t", torch.arange(506.0)):  # 2024 bytes
        unpacker.feed(header, slot)
    assert max(sizes) == 2024, sizes


def test_the_old_staging_buffer_is_freed_before_a_larger_one_is_allocated() -> None:
    # Peak memory: a tensor whose first chunk does not fit the staging buffer does not hold
    # the old buffer (whose bytes nobody needs any more) while the new one is allocated.
    buffers: list[weakref.ref[torch.Tensor]] = []  # every buffer the unpacker allocated
    alive: list[int] = []  # how many of them were alive at each allocation

    def recording(nbytes: int) -> torch.Tensor:
        alive.append(sum(ref() is not None for ref in buffers))
        buf = allocate_slot(nbytes)
        buffers.append(weakref.ref(buf))
        return buf

    unpacker = Unpacker(allocate=recording)
    unpacker.begin(1)
    for header, slot in _chunked("small", torch.arange(300.0)):  # staging: 1200 bytes
        unpacker.feed(header, slot)
    first_sync = len(alive)
    unpacker.begin(2)
    got = []
    for header, slot in _chunked("big", torch.arange(3000.0), 4096, sync_id=2):
        got += unpacker.feed(header, slot)
    assert torch.equal(got[0][1], torch.arange(3000.0))
    # Sync 2's first allocation (its first chunk, 4 KiB) found no buffer alive.
    assert len(alive) > first_sync and alive[first_sync] == 0, (first_sync, alive)


# -- layouts: checked once, recognised after -----------------------------------------------
def _packed(tensors: dict[str, torch.Tensor], nbytes: int = 4096) -> tuple[Layout, torch.Tensor]:
    builder = BucketBuilder(nbytes)
    for name, t in tensors.items():
        assert not builder.add(name, t)
    bucket = builder.flush()
    assert bucket is not None
    slot = torch.zeros(nbytes, dtype=torch.uint8)
    return bucket.pack_into(slot), slot


def test_a_repeated_layout_is_recognised_and_gives_the_same_tensors() -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.ones(0)}
    layout, slot = _packed(tensors)
    unpacker = Unpacker()
    batches = []
    for sync in (1, 2):
        unpacker.begin(sync)
        # A layout decoded afresh each sync (equal, not the same object), as off the wire.
        header = BucketHeader(sync, 0, 0, 4096, Layout(*msgspec.structs.astuple(layout)))
        batches.append(unpacker.feed(header, slot))
    first, second = batches
    assert isinstance(first, BucketTensors) and isinstance(second, BucketTensors)
    assert second.layout is not None and second.layout is first.layout
    assert list(second.names) == ["a", "b", "c"]
    for (name, got), (want_name, want) in zip(second, tensors.items(), strict=True):
        assert name == want_name and got.shape == want.shape and same_bits(got, want)


def test_a_recognised_layout_is_still_checked_against_its_bucket() -> None:
    layout, slot = _packed({"a": torch.randn(64), "b": torch.randn(64)})
    unpacker = Unpacker()
    unpacker.begin(1)
    unpacker.feed(BucketHeader(1, 0, 0, 4096, layout), slot)
    # The same layout in a bucket that claims fewer bytes than its entries span.
    unpacker.begin(2)
    with pytest.raises(WireFormatError, match="'b' claims bytes"):
        unpacker.feed(BucketHeader(2, 0, 0, 300, layout), slot)
    # Its names twice in one sync.
    unpacker.begin(3)
    unpacker.feed(BucketHeader(3, 0, 0, 4096, layout), slot)
    with pytest.raises(DuplicateTensorError, match="'a' arrived twice"):
        unpacker.feed(BucketHeader(3, 1, 0, 4096, layout), slot)


def test_an_offset_that_would_wrap_int64_is_refused() -> None:
    # offset + nbytes past 2**63: computed in int64 it would wrap to a small number.
    entries = [Entry("a", "uint8", (64,), 0, 64), Entry("b", "uint8", (64,), 2**63 - 64, 64)]
    unpacker = Unpacker()
    unpacker.begin(1)
    with pytest.raises(WireFormatError, match="'b'"):
        unpacker.feed(
            BucketHeader(1, 0, 0, 4096, Layout.of(entries)), torch.zeros(4096, dtype=torch.uint8)
        )


def test_module_sink_copies_a_recognised_layout_in_one_plan() -> None:
    import streamsync as ss

    src = {"w": torch.randn(4, 8), "b": torch.randn(8), "n": torch.randn(3)}
    target = torch.nn.Module()
    for name, t in src.items():
        target.register_buffer(name, torch.zeros_like(t))
    sink = ss.ModuleSink(target)
    layout, slot = _packed(src)
    unpacker = Unpacker()
    for sync in (1, 2):
        unpacker.begin(sync)
        batch = unpacker.feed(BucketHeader(sync, 0, 0, 4096, layout), slot)
        sink.prepare()
        sink.load(batch)
        result = sink.finalize()
        assert result.loaded == ("b", "n", "w") and not result.missing
        for name, t in src.items():
            assert same_bits(getattr(target, name), t)
        # The next sync's bytes differ: the plan copies whatever the slot holds now.
        src = {name: t + 1 for name, t in src.items()}
        layout, slot = _packed(src)
    # A layout the module cannot take whole (a dtype it does not have) goes the general way
    # and fails by name.
    bad, slot = _packed({"w": torch.randn(4, 8).double()})
    unpacker.begin(3)
    sink.prepare()
    with pytest.raises(ss.DtypeMismatchError, match="'w'"):
        sink.load(unpacker.feed(BucketHeader(3, 0, 0, 4096, bad), slot))


def test_remembered_layouts_are_bounded_by_their_entries() -> None:
    # A sender sending ever new layouts cannot make a receiver keep them all.
    unpacker = Unpacker(remember=10)
    for sync in range(1, 6):
        layout, slot = _packed({f"s{sync}t{i}": torch.ones(4) for i in range(4)})
        unpacker.begin(sync)
        assert len(unpacker.feed(BucketHeader(sync, 0, 0, 4096, layout), slot)) == 4
        kept = unpacker._plans.values()
        assert sum(len(plan) for plan in kept) <= 10


# -- claims: a name once per sync, with no set per name when a sync repeats the last ---------
def _sync(unpacker: Unpacker, sync: int, buckets: list[tuple[Layout, torch.Tensor]]) -> None:
    unpacker.begin(sync)
    tensors = nbytes = 0
    for seq, (layout, slot) in enumerate(buckets):
        # Decoded afresh, as off the wire: equal to the last sync's layouts, not the same.
        fresh = Layout(*msgspec.structs.astuple(layout))
        tensors += len(unpacker.feed(BucketHeader(sync, seq, 0, 4096, fresh), slot))
        nbytes += 4096
    unpacker.finish(End(sync, len(buckets), tensors, nbytes))


def test_a_repeated_sync_claims_its_names_without_a_set_of_them() -> None:
    import tracemalloc

    names = [
        f"model.layers.{i}.mlp.experts.{j}.weight_scale_inv" for i in range(8) for j in range(256)
    ]
    buckets = [
        _packed({n: torch.ones(1) for n in names[k : k + 64]}) for k in range(0, len(names), 64)
    ]
    unpacker = Unpacker()
    _sync(unpacker, 1, buckets)  # checks every layout and the names across them
    tracemalloc.start()
    try:
        _sync(unpacker, 2, buckets)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Claimed name by name, the set of the 2,048 names takes about 160 KiB here.
    assert peak < 32 << 10, peak


def test_claims_still_refuse_a_name_twice_after_a_repeated_sync() -> None:
    a = _packed({"a0": torch.ones(4), "a1": torch.ones(4)})
    b = _packed({"b0": torch.ones(4), "b1": torch.ones(4)})
    overlapping = _packed({"c0": torch.ones(4), "a1": torch.ones(4)})
    unpacker = Unpacker()
    _sync(unpacker, 1, [a, b])
    _sync(unpacker, 2, [a, b])  # the known sequence
    with pytest.raises(DuplicateTensorError, match="'a0' arrived twice in sync 3"):
        _sync(unpacker, 3, [a, a])  # a known plan, out of its place
    _sync(unpacker, 4, [b, a])  # another order: claimed name by name, and fine
    with pytest.raises(DuplicateTensorError, match="'a1' arrived twice in sync 5"):
        _sync(unpacker, 5, [b, a, overlapping])
    with pytest.raises(DuplicateTensorError, match="'a1' arrived twice in sync 6"):
        _sync(unpacker, 6, [a, overlapping])  # off the known sequence at its second bucket
    _sync(unpacker, 7, [a])  # a prefix of the known sequence
    with pytest.raises(DuplicateTensorError, match="'a0' arrived twice in sync 8"):
        _sync(unpacker, 8, [b, a, a])


def test_module_sink_reports_each_name_once_when_a_bucket_comes_twice() -> None:
    import streamsync as ss

    src = {"a": torch.randn(4), "b": torch.randn(4)}
    target = torch.nn.Module()
    for name, t in src.items():
        target.register_buffer(name, torch.zeros_like(t))
    sink = ss.ModuleSink(target)
    first, slot_a = _packed({"a": src["a"]})
    second, slot_b = _packed({"b": src["b"]})
    unpacker = Unpacker()
    unpacker.begin(1)
    batch_a = unpacker.feed(BucketHeader(1, 0, 0, 4096, first), slot_a)
    batch_b = unpacker.feed(BucketHeader(1, 1, 0, 4096, second), slot_b)
    sink.prepare()
    sink.load(batch_a)
    sink.load(batch_b)
    assert sink.finalize() == ss.LoadResult(loaded=("a", "b"))
    # The sink fed directly, one bucket twice (no unpacker claims its names): as many
    # names as the module has, but not all of them.
    sink.prepare()
    sink.load(batch_a)
    sink.load(batch_a)
    assert sink.finalize() == ss.LoadResult(loaded=("a",), missing=("b",))


_DEVICE_SLOT = """
import sys, torch
from streamsync.wire.pack import BucketBuilder

def build():
    cast = sys.argv[1] == "cast"
    rule = (lambda _n, dtype: torch.bfloat16 if dtype == torch.float32 else None) if cast else None
    builder = BucketBuilder(4096, cast=rule)
    for name, t in [("a", torch.randn(5)), ("b", torch.arange(7)), ("c", torch.ones(3, 2))]:
        assert list(builder.add(name, t)) == []
    return builder.flush()

expected = build().pack_into(torch.empty(4096, dtype=torch.uint8))
assert build().pack_into(torch.empty(4096, dtype=torch.uint8, device="meta")) == expected
print("packed")
"""


@pytest.mark.parametrize("cast", [False, True], ids=["all-moves", "moves-and-a-cast"])
def test_a_device_slot_gets_torch_copies_never_a_host_memmove(cast: bool) -> None:
    # cuda-ipc:// packs into a GPU slot: a memmove there writes to a device address from the
    # host (a segfault on the first GPU run). The meta device stands in for the GPU: its
    # address is 0, so a memmove crashes the process that packs.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _DEVICE_SLOT, "cast" if cast else "moves"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "packed", (out.returncode, out.stderr)


def test_a_refilled_bucket_reuses_its_copy_plan_only_while_its_sources_stay_put() -> None:
    # A replayed plan's bucket keeps the copy plan of its last packing: the same sources
    # reuse it; a source that moved (a new tensor) gets a new plan and its own bytes packed.
    first = [
        ("a", random_tensor((512, 1024), torch.bfloat16)),
        ("b", random_tensor((7,), torch.float32)),
    ]
    builder = BucketBuilder(4 << 20)
    (bucket,) = [b for name, t in first for b in builder.add(name, t)] + [builder.flush()]
    assert bucket is not None
    slot = torch.empty(4 << 20, dtype=torch.uint8)
    bucket.pack_into(slot)
    ((_, plan),) = bucket.moves_plan

    again = bucket.refilled([t for _, t in first])
    again.pack_into(slot)
    assert again.moves_plan[0][1] is plan

    moved = [random_tensor(tuple(t.shape), t.dtype, seed=1) for _, t in first]
    twin = bucket.refilled(moved)
    twin.pack_into(slot)
    assert twin.moves_plan[0][1] is not plan
    layout = twin.layout()
    for name, tensor in zip(("a", "b"), moved, strict=True):
        index = layout.names.index(name)
        offset, nbytes = layout.entries()[index].offset, tensor.nbytes
        assert torch.equal(slot[offset : offset + nbytes], tensor.reshape(-1).view(torch.uint8))


def test_a_bucket_of_many_entries_keeps_no_copy_plan() -> None:
    # Past KEPT_PLAN_ENTRIES entries the plan is built at each packing: kept, it would cost
    # the sender memory per tensor (small-tensors' peak).
    count = KEPT_PLAN_ENTRIES + 1
    tensors = [(f"t{i}", random_tensor((16,), torch.float32, seed=i)) for i in range(count)]
    builder = BucketBuilder(1 << 20)
    (bucket,) = [b for name, t in tensors for b in builder.add(name, t)] + [builder.flush()]
    assert bucket is not None
    slot = torch.empty(1 << 20, dtype=torch.uint8)
    bucket.pack_into(slot)
    assert bucket.moves_plan == []
    out, _ = roundtrip(tensors, 1 << 20)
    assert all(same_bits(a, b) for (_, a), (_, b) in zip(out, tensors, strict=True))


@pytest.mark.parametrize(
    "change", [{"shape": (1000,)}, {"dtype": "float32"}], ids=["shape", "dtype"]
)
def test_a_later_patch_piece_cannot_change_its_tensors_shape_or_dtype(
    change: dict[str, object],
) -> None:
    # A piece that claimed more elements (or wider ones) than the tensor the first piece
    # patched would write past that tensor's bytes.
    import numpy as np

    from streamsync.wire import patch as patches

    numel = 300
    pieces = []
    for positions in ([1, 2], [5, 290]):
        pos = np.array(positions, dtype=np.int32)
        vals = np.arange(len(positions), dtype=np.uint16) + 7
        buf = torch.empty(patches.patch_nbytes(len(positions), numel, 2), dtype=torch.uint8)
        patches.encode((pos, vals), numel, 2, buf)
        pieces.append((len(positions), buf))
    builder = BucketBuilder(1 << 20)
    assert not list(builder.add_patch("t", torch.bfloat16, (numel,), pieces))
    bucket = builder.flush()
    assert bucket is not None
    data = torch.zeros(1 << 20, dtype=torch.uint8)
    first, second = bucket.pack_into(data).entries()
    second = msgspec.structs.replace(second, **change)
    itemsize = 4 if second.dtype == "float32" else 2
    # As many bytes as the claimed shape and dtype take.
    second = msgspec.structs.replace(
        second, nbytes=patches.patch_nbytes(2, math.prod(second.shape), itemsize)
    )
    guard = torch.zeros(numel + 1000, dtype=torch.bfloat16)  # the tensor, then a fence
    header = BucketHeader(1, 0, 0, data.numel(), Layout.of([first, second]), base=5)
    unpacker = Unpacker()
    unpacker.begin(1)
    with pytest.raises(WireFormatError, match="piece 1 of the patch of tensor 't'"):
        unpacker.feed(header, data, target=lambda n, d, s: guard[:numel])
    assert not guard.view(torch.int16).any()
