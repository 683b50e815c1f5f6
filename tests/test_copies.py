"""The library's copies (streamsync._copies): the same bytes as ``Tensor.copy_``, on every
path (inline memmove, split memmove, pool casts, non-contiguous), without touching the
process's torch thread count and without starting OpenMP worker threads."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streamsync as ss
from streamsync import _copies as copies
from streamsync._dtypes import CASTABLE
from streamsync.testing.buckets import pack_bucket
from streamsync.wire.frames import BucketHeader, Layout
from streamsync.wire.pack import BucketBuilder
from streamsync.wire.unpack import Unpacker

PIECE = copies.PIECE_BYTES
CAST_PAIRS = [(a, b) for a in sorted(CASTABLE, key=str) for b in sorted(CASTABLE, key=str)]


def _source(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(0, 250, (numel,), generator=gen).to(dtype)


@pytest.mark.parametrize(
    "nbytes",
    [0, 1, 63, 4097, copies.INLINE_BYTES - 1, copies.INLINE_BYTES, 2 * PIECE + 3, 5 * PIECE - 1],
)
def test_memmoves_of_every_size_copy_every_byte(nbytes: int) -> None:
    src = _source(nbytes, torch.uint8, seed=nbytes)
    dst = torch.zeros(nbytes + 128, dtype=torch.uint8)  # bytes past the copy stay zero
    copies.copy_tensors([(dst[64 : 64 + nbytes], src)])
    assert torch.equal(dst[64 : 64 + nbytes], src)
    assert not dst[:64].any() and not dst[64 + nbytes :].any()


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), CAST_PAIRS, ids=str)
@pytest.mark.parametrize("numel", [1, 1000, PIECE // 2 + 7])
def test_casts_match_torch_for_every_castable_pair(
    src_dtype: torch.dtype, dst_dtype: torch.dtype, numel: int
) -> None:
    src = _source(numel, src_dtype, seed=numel)
    got = torch.empty(numel, dtype=dst_dtype)
    copies.copy_tensors([(got, src)])
    assert torch.equal(got, src.to(dst_dtype))


@pytest.mark.parametrize("rows", [1, 3, 1025])
def test_non_contiguous_sources_and_destinations(rows: int) -> None:
    cols = PIECE // 512 + 5  # large enough, at 1025 rows, to be split across the pool
    base = _source(rows * cols, torch.float32).view(cols, rows)
    src = base.t()  # (rows, cols), not contiguous
    dst = torch.empty(rows, cols, dtype=torch.bfloat16)
    dst_nc = torch.empty(cols, rows, dtype=torch.float32).t()
    copies.copy_tensors([(dst, src), (dst_nc, src)])
    assert torch.equal(dst, src.to(torch.bfloat16))
    assert torch.equal(dst_nc, src)


def test_a_batch_mixes_moves_casts_and_raw_addresses() -> None:
    a, b = _source(3 * PIECE, torch.uint8), _source(999, torch.float32)
    out_a, out_b = torch.empty_like(a), torch.empty(999, dtype=torch.float16)
    raw_src, raw_dst = _source(77, torch.uint8), torch.zeros(77, dtype=torch.uint8)
    batch = copies.CopyBatch()
    batch.copy(out_a, a)
    batch.copy(out_b, b)
    batch.move(raw_dst.data_ptr(), raw_src.data_ptr(), 77)
    batch.run()
    assert torch.equal(out_a, a) and torch.equal(out_b, b.half()) and torch.equal(raw_dst, raw_src)


def test_an_error_in_a_pool_copy_is_raised_after_every_piece_finished() -> None:
    big = _source(3 * PIECE, torch.uint8)
    out = torch.empty_like(big)
    with pytest.raises(RuntimeError):
        copies.copy_tensors([(out, big), (torch.empty(3, 4), torch.empty(5, 4))])
    assert torch.equal(out, big)  # the move went on; nothing still writes into ``out``


def test_the_process_torch_thread_count_is_never_changed() -> None:
    before = torch.get_num_threads()
    src = _source(3 * PIECE // 4, torch.float32)
    copies.copy_tensors([(torch.empty(src.numel(), dtype=torch.bfloat16), src)])
    assert torch.get_num_threads() == before
    # The pool's threads run single-threaded where the OpenMP runtime allows pinning them.
    seen = copies._pool.get().submit(torch.get_num_threads).result()
    assert seen == (1 if copies.openmp_runtime() else before)


_VENDORED_OPENMP = textwrap.dedent(
    """
    import torch
    import sentencepiece  # vendors its own libgomp, loaded beside torch's (tokenizers, peft)
    from streamsync import _copies as copies

    maps = open("/proc/self/maps").read()
    assert "sentencepiece.libs/libgomp" in maps and "torch/lib/libgomp" in maps
    src = torch.ones(1 << 20)
    copies.copy_tensors([(torch.empty(src.numel(), dtype=torch.bfloat16), src)])
    print(copies._pool.get().submit(torch.get_num_threads).result())
    """
)


def test_the_pool_pins_torchs_openmp_runtime_when_another_wheel_vendors_one() -> None:
    # Another wheel's libgomp sorts before torch's; pinning that one leaves torch's pool
    # threads at the process's count, spinning beside the trainer.
    out = subprocess.run(
        [sys.executable, "-c", _VENDORED_OPENMP], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]


_NO_OPENMP_WORKERS = textwrap.dedent(
    """
    import os, sys, torch
    torch.set_num_threads(2)  # what torch picks on a 2-core machine
    import streamsync as ss
    from streamsync import _copies as copies

    def threads():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as fh:
                out[tid] = fh.read().strip()
        return out

    # Sources made without a torch kernel (which could itself start OpenMP workers).
    n = 8 << 20
    bf16 = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8).view(torch.bfloat16)
    f32 = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8).view(torch.float32)
    module = torch.nn.Module()
    module.register_buffer("a", torch.empty(bf16.shape, dtype=torch.bfloat16))
    module.register_buffer("b", torch.empty(f32.shape, dtype=torch.bfloat16))
    before = threads()
    for _ in range(3):
        ss.ModuleSink(module)  # warm-up of its own imports
        rule = lambda name, dtype: torch.bfloat16 if dtype == torch.float32 else None
        from streamsync.testing.buckets import pack_bucket
        from streamsync.wire.pack import BucketBuilder
        from streamsync.wire.unpack import Unpacker
        from streamsync.wire.frames import BucketHeader, Layout
        builder = BucketBuilder(4 << 20, cast=rule)
        buckets = [*builder.add("a", bf16), *builder.add("b", f32), builder.flush()]
        unpacker = Unpacker()
        unpacker.begin(0)
        sink = ss.ModuleSink(module)
        sink.prepare()
        for seq, bucket in enumerate(buckets):
            packed = pack_bucket(bucket)
            header = BucketHeader(0, seq, 0, bucket.nbytes, Layout.of(packed.entries))
            sink.load(unpacker.feed(header, packed.data, target=sink.target))
    after = threads()
    new = {t: c for t, c in after.items() if t not in before}
    library = {t: c for t, c in new.items() if c.startswith("streamsync-cp")}
    others = {t: c for t, c in new.items() if t not in library}
    assert torch.get_num_threads() == 2
    assert torch.equal(module.a.view(torch.uint8), bf16.view(torch.uint8))
    print("library", len(library), "others", len(others))
    # The control: torch's own copy at two threads does start OpenMP workers.
    torch.empty_like(f32).copy_(f32)
    control = {t for t in threads() if t not in after}
    print("control", len(control))
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.slow  # a fresh interpreter: make test, not the edit loop
def test_library_copies_start_no_openmp_worker_threads(tmp_path: Path) -> None:
    if not copies.openmp_runtime():
        pytest.skip("torch here does not use an OpenMP runtime the copies could avoid")
    script = tmp_path / "probe.py"
    script.write_text(_NO_OPENMP_WORKERS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(maxsplit=1) for line in out.stdout.splitlines() if " " in line)
    counts = {k: v.split() for k, v in lines.items()}
    library, others = int(counts["library"][0]), int(counts["library"][2])
    assert library >= 1  # the copies did use the pool
    assert others == 0, out.stdout
    assert int(counts["control"][0]) >= 1, "the probe cannot see OpenMP workers start"


def _copy_in_child(queue: multiprocessing.Queue[bool]) -> None:
    # No torch kernel here: libgomp itself cannot run in a child forked after the parent
    # used OpenMP (a torch limitation, not the library's); the copies must not need it.
    src = torch.frombuffer(bytearray(os.urandom(3 * PIECE)), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copies.copy_tensors([(dst, src)])
    queue.put(bool((dst.numpy() == src.numpy()).all()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    copies.copy_tensors(
        [(torch.empty(3 * PIECE, dtype=torch.uint8), _source(3 * PIECE, torch.uint8))]
    )
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[bool] = ctx.Queue()
    proc = ctx.Process(target=_copy_in_child, args=(queue,))
    proc.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def test_shutdown_stops_the_pool_and_the_next_copy_starts_it_again() -> None:
    copies.copy_tensors(
        [(torch.empty(3 * PIECE, dtype=torch.uint8), _source(3 * PIECE, torch.uint8))]
    )
    copies.shutdown()
    assert not [t for t in _thread_names() if t.startswith("streamsync-copy")]
    src = _source(3 * PIECE, torch.uint8)
    dst = torch.empty_like(src)
    copies.copy_tensors([(dst, src)])
    assert torch.equal(dst, src)


def _thread_names() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate()]


@pytest.mark.parametrize("cast", [False, True])
@pytest.mark.parametrize("bucket_bytes", [1024, 4096 + 64, 3 * PIECE])
def test_pack_and_unpack_across_pieces_chunks_and_tiny_tensors(
    cast: bool, bucket_bytes: int
) -> None:
    weights = {
        "tiny": _source(1, torch.float32),
        "odd": _source(1001, torch.float32),
        "big": _source(PIECE + 13, torch.float32),
        "nc": _source(300 * 7, torch.float32).view(7, 300).t(),
        "ints": _source(333, torch.int32),
        "empty": torch.empty(0, 5),
    }
    rule = (
        (lambda name, dtype: torch.bfloat16 if dtype == torch.float32 else None) if cast else None
    )
    builder = BucketBuilder(bucket_bytes, cast=rule)
    buckets = [b for n, t in weights.items() for b in builder.add(n, t)]
    last = builder.flush()
    buckets += [last] if last is not None else []
    unpacker = Unpacker()
    unpacker.begin(0)
    got: dict[str, torch.Tensor] = {}
    for seq, bucket in enumerate(buckets):
        packed = pack_bucket(bucket)
        header = BucketHeader(0, seq, 0, bucket.nbytes, Layout.of(packed.entries))
        got.update((n, t.clone()) for n, t in unpacker.feed(header, packed.data))
    for name, tensor in weights.items():
        want = tensor.to(torch.bfloat16) if cast and tensor.dtype == torch.float32 else tensor
        assert torch.equal(got[name], want), name
    assert ss.__version__


# -- the compiled kernel's copies: streamed past the cache, and the fp32 -> bf16 cast -----------
needs_kernel = pytest.mark.skipif(
    copies.kernel() != "c",
    reason="the compiled kernel is not built here: the copies use ctypes.memmove and torch",
)


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(
    nbytes=st.one_of(st.integers(0, 8192), st.integers(0, 300_000)),
    ahead=st.one_of(st.integers(0, 320), st.integers(3776, 4095), st.integers(0, 4095)),
    src_at=st.integers(0, 4095),
    seed=st.integers(0, 2**16),
)
def test_the_streaming_copy_moves_exactly_its_bytes(
    nbytes: int, ahead: int, src_at: int, seed: int
) -> None:
    # Sizes on both sides of the kernel's 4 KiB streaming threshold, any alignment, and the
    # destination any distance past the source modulo 4 KiB (where it is a little past, the
    # kernel copies downwards): the bytes arrive and nothing around them is written, whether
    # one copy or many in a batch.
    src = _source(nbytes + 4096, torch.uint8, seed=seed)
    source = src.data_ptr() + src_at
    for run in (
        lambda d, s: copies.large_copy()(d, s, nbytes),
        lambda d, s: copies.memmove_many([(d, s, nbytes)] * 4),
    ):
        dst = torch.zeros(nbytes + 8192, dtype=torch.uint8)
        dst_at = (source + ahead - dst.data_ptr()) % 4096
        run(dst.data_ptr() + dst_at, source)
        assert (dst.data_ptr() + dst_at - source) % 4096 == ahead
        assert torch.equal(dst[dst_at : dst_at + nbytes], src[src_at : src_at + nbytes])
        assert not dst[:dst_at].any() and not dst[dst_at + nbytes :].any()


@needs_kernel
@pytest.mark.parametrize("shift", [-4096, -1, 1, 4096])
def test_the_streaming_copy_of_overlapping_ranges_is_a_memmove(shift: int) -> None:
    nbytes = 1 << 20
    buf = _source(nbytes + 8192, torch.uint8, seed=3)
    want = buf.clone()
    src = 4096
    want[src + shift : src + shift + nbytes] = buf[src : src + nbytes].clone()
    copies.large_copy()(buf.data_ptr() + src + shift, buf.data_ptr() + src, nbytes)
    assert torch.equal(buf, want)


_FLOAT_BITS = st.one_of(
    st.integers(-(2**31), 2**31 - 1),  # any pattern: normals, denormals, infinities, NaNs
    st.sampled_from([0x7F800000, -0x00800000, 0x7F7FFFFF, 0x00000001, 0x3F808000, 0x3F818000]),
)


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(bits=st.lists(_FLOAT_BITS, max_size=200), at=st.integers(0, 31))
def test_the_kernel_cast_rounds_every_float_as_torch_does(bits: list[int], at: int) -> None:
    # Through copy_tensors, at any alignment of the destination: every number rounds to the
    # very bf16 torch gives (ties to even, infinities, denormals); a NaN stays a NaN. Up to
    # 200 elements: past a 64-byte boundary of the destination, the AVX-512 loop's blocks of
    # 32 where the CPU has it, and the SSE2 loop's blocks of 16 after them.
    src = torch.tensor([0] * at + bits, dtype=torch.int32).view(torch.float32)[at:]
    got = torch.full((len(bits) + at,), 7.0, dtype=torch.bfloat16)[at:]
    copies.copy_tensors([(got, src)])
    want = src.to(torch.bfloat16)
    nan = torch.isnan(src)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert bool(torch.isnan(got[nan]).all())


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(bits=st.lists(_FLOAT_BITS, max_size=200), at=st.integers(0, 7))
def test_the_portable_kernel_cast_rounds_as_torch_does_and_stops_at_a_nan(
    bits: list[int], at: int
) -> None:
    # The loop every CPU runs (the AVX-512 one taken out): torch's bits up to where it
    # stops, and it stops only at a block that holds a NaN.
    src = torch.tensor([0] * at + bits, dtype=torch.int32).view(torch.float32)[at:]
    got = torch.full((len(bits) + at,), 7.0, dtype=torch.bfloat16)[at:]
    stopped = copies._library().ss_cast_f32_bf16_portable(got.data_ptr(), src.data_ptr(), len(bits))
    done = len(bits) if stopped == -1 else stopped
    want = src.to(torch.bfloat16)
    assert torch.equal(got[:done].view(torch.int16), want[:done].view(torch.int16))
    nan = torch.isnan(src)
    assert bool(nan[done : done + 16].any()) if stopped != -1 else not bool(nan.any())


@needs_kernel
@pytest.mark.parametrize("entry", ["ss_cast_f32_bf16", "ss_cast_f32_bf16_portable"])
def test_each_kernel_cast_puts_every_element_in_its_place(entry: str) -> None:
    # Distinct values at every length up to a few blocks of each loop and every alignment of
    # the destination within 64 bytes: an element written to another's place shows.
    cast = getattr(copies._library(), entry)
    gen = torch.Generator().manual_seed(0)
    for n in (*range(160), 1000, 4099):
        for at in (0, 1, 7, 8, 31):
            src = torch.randn(n + at, generator=gen)[at:]
            got = torch.zeros(n + 32, dtype=torch.bfloat16)[at:][:n]
            assert cast(got.data_ptr(), src.data_ptr(), n) == -1
            want = src.to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, at)


@needs_kernel
@pytest.mark.parametrize("where", [0, 1, 15, 16, 999])
def test_a_nan_anywhere_leaves_the_whole_cast_to_torch(where: int) -> None:
    # First element included: the kernel's "stopped at 0" is not "done".
    src = _source(1000, torch.float32, seed=where)
    src[where] = float("nan")
    got = torch.zeros(1000, dtype=torch.bfloat16)
    copies.copy_tensors([(got, src)])
    assert torch.equal(got.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(halves=st.lists(st.integers(-(2**15), 2**15 - 1), max_size=70), at=st.integers(0, 7))
def test_the_kernel_upcast_is_torchs_bit_for_bit(halves: list[int], at: int) -> None:
    # bf16 -> fp32 of every pattern, NaNs too, at any alignment of the destination.
    src = torch.tensor(halves, dtype=torch.int16).view(torch.bfloat16)
    got = torch.full((len(halves) + at,), 7.0)[at:]
    copies.copy_tensors([(got, src)])
    assert torch.equal(got.view(torch.int32), src.to(torch.float32).view(torch.int32))


@needs_kernel
def test_a_piece_of_a_cast_holding_a_nan_is_cast_by_torch() -> None:
    # Large enough to be split across the pool; the NaN's piece is torch's, bit for bit.
    src = _source(3 * PIECE // 4 + 5, torch.float32, seed=9)
    src[len(src) // 2] = float("nan")
    got = torch.empty(len(src), dtype=torch.bfloat16)
    copies.copy_tensors([(got, src)])
    pieces = copies._split(got, src)
    assert len(pieces) == copies.POOL_THREADS
    for g, s in pieces:
        assert torch.equal(g.view(torch.int16), s.to(torch.bfloat16).view(torch.int16))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(
        st.one_of(st.integers(0, 600_000), st.integers(1 << 20, 12 << 20)), min_size=1, max_size=80
    ),
    gaps=st.integers(0, 64),
    dst_base=st.integers(0, 4096),
    spread=st.booleans(),
)
def test_a_move_plan_cuts_its_moves_into_runs_of_about_equal_bytes_and_moves_every_byte(
    sizes: list[int], gaps: int, dst_base: int, spread: bool
) -> None:
    # A plan's moves, large (INLINE_BYTES and up) and small, are shared out in runs of
    # about equal bytes, one per thread, the last the caller's; a move across a cut is split
    # at a page of its bytes. A receiver's plan (spread_small=False) keeps its small moves
    # on the caller. Every byte lands where it should, once.
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + gaps
    src = torch.randint(0, 256, (max(at, 1),), dtype=torch.uint8)
    dst = torch.zeros(max(at, 1) + dst_base, dtype=torch.uint8)
    plan = copies.MovePlan(
        offsets, [src.data_ptr() + o for o in offsets], sizes, spread_small=spread
    )
    runs = plan._runs
    assert len(plan) == len([n for n in sizes if n])
    # Each run's moves are pieces of the plan's moves; together they are every byte once.
    pieces = sorted((s, n) for run in runs for _, s, n in run.tolist())
    assert sum(n for _, n in pieces) == sum(sizes) == plan.nbytes
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(pieces))
    small = sum(n for n in sizes if n < copies.INLINE_BYTES)
    shared = sum(sizes) - (0 if spread else small)
    parts = min(copies.POOL_THREADS, shared // copies.PIECE_BYTES)
    if parts >= 2:
        assert len(runs) == parts
        # Runs of about equal bytes: a cut falls on a page of a move, so each run is within
        # a page of its share (the caller's carries the small moves it keeps besides).
        shares = [int(run[:, 2].sum()) for run in runs]
        shares[-1] -= 0 if spread else small
        assert max(shares) - min(shares) <= 4096 * parts
    else:
        assert len(runs) == 1
    plan.run(dst.data_ptr() + dst_base, 0)
    for o, n in zip(offsets, sizes, strict=True):
        assert torch.equal(dst[dst_base + o : dst_base + o + n], src[o : o + n])
    gaps_left = torch.ones_like(dst, dtype=torch.bool)
    for o, n in zip(offsets, sizes, strict=True):
        gaps_left[dst_base + o : dst_base + o + n] = False
    assert not dst[gaps_left].any()  # nothing written outside the moves
