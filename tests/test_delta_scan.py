"""The fused fp32 -> bf16 comparison of the compiled kernel (``ss_diff_f32_bf16``, and its
``_portable`` loop every CPU runs) against torch: ``src.to(torch.bfloat16) != base``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsync import _copies as copies
from streamsync.wire import patch as patches

ENTRIES = ["ss_diff_f32_bf16", "ss_diff_f32_bf16_portable"]
#: Bit patterns the kernel must treat as torch does: both infinities, the largest normal, the
#: smallest denormal, rounding ties to even either way, negative zero, quiet and signalling
#: NaNs of both signs.
_SPECIAL = np.array(
    [
        *(0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000),
        *(0x80000000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF800001),
    ],
    dtype=np.uint32,
)
_GUARD = 64
_SENTINEL = 0x5A5A

needs_kernel = pytest.mark.skipif(copies.kernel() != "c", reason="the kernel is not built")


def _source(seed: int, n: int, specials: float, nans: bool) -> np.ndarray:
    """``n`` fp32 bit patterns: normals, a share ``specials`` of special patterns (NaNs
    among them only with ``nans``) and random bits (denormals, infinities, anything)."""
    rng = np.random.default_rng(seed)
    bits = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32)
    pool = _SPECIAL if nans else _SPECIAL[~np.isnan(_SPECIAL.view(np.float32))]
    special = rng.random(n) < specials
    bits[special] = rng.choice(pool, special.sum())
    noise = rng.random(n) < specials / 2
    raw = rng.integers(0, 1 << 32, noise.sum(), dtype=np.uint64).astype(np.uint32)
    if not nans:
        raw = raw[~np.isnan(raw.view(np.float32))]
        noise[np.flatnonzero(noise)[raw.size :]] = False
    bits[noise] = raw
    return bits


def _expected(cast: np.ndarray, base: np.ndarray, nan: np.ndarray, lo: int, limit: int) -> int:
    """The kernel's answer for elements ``[lo, hi)`` (``cast``, ``base``, ``nan`` already
    sliced): in order of its units (blocks of 16 from ``lo``, then single elements), -2 at
    a unit holding a NaN, -1 once more than ``limit`` changed, else the count."""
    n = cast.size
    whole = n // 16 * 16
    unit = np.concatenate([np.arange(whole) // 16, whole // 16 + np.arange(n - whole)])
    units = int(unit[-1]) + 1 if n else 0
    changes = np.bincount(unit, weights=cast != base, minlength=units).cumsum()
    first_nan = int(unit[np.argmax(nan)]) if nan.any() else units
    over = np.flatnonzero(changes > limit)
    first_over = int(over[0]) if over.size else units
    if first_nan < units and first_nan <= first_over:
        return -2
    return -1 if first_over < units else int(changes[-1]) if n else 0


def _run(
    entry: str, src: torch.Tensor, base: torch.Tensor, lo: int, hi: int, limit: int, wide: bool
):
    pdt = np.int64 if wide else np.int32
    pos = np.full(limit + 16 + _GUARD, _SENTINEL, pdt)
    vals = np.full(limit + 16 + _GUARD, _SENTINEL, np.uint16)
    p32, p64 = (None, pos.ctypes.data) if wide else (pos.ctypes.data, None)
    fn = getattr(copies._library(), entry)
    k = fn(src.data_ptr(), base.data_ptr(), lo, hi, p32, p64, vals.ctypes.data, limit)
    # Nothing written past the room the caller leaves (the limit plus one block).
    assert (pos[limit + 16 :] == _SENTINEL).all() and (vals[limit + 16 :] == _SENTINEL).all()
    return int(k), pos, vals


def _check(
    entry: str,
    bits: np.ndarray,
    flip: np.ndarray,
    at: int,
    lo: int,
    hi: int,
    limit: int,
    wide: bool,
) -> None:
    # `at` elements before the source and the baseline move both off any alignment.
    store = torch.zeros(bits.size + at, dtype=torch.int32)
    store[at:] = torch.from_numpy(bits.view(np.int32))
    src = store[at:].view(torch.float32)
    nan = torch.isnan(src)
    cast = src.to(torch.bfloat16).view(torch.int16).clone()
    cast[nan] = 0x7FC0
    base_store = torch.zeros(bits.size + at, dtype=torch.int16)
    base_store[at:] = cast ^ torch.from_numpy(flip.astype(np.int16))
    base = base_store[at:]
    k, pos, vals = _run(entry, src, base, lo, hi, limit, wide)
    c, b, m = cast[lo:hi].numpy(), base[lo:hi].numpy(), nan[lo:hi].numpy()
    assert k == _expected(c, b, m, lo, limit)
    if k >= 0:
        want = np.flatnonzero(c != b)
        assert np.array_equal(pos[:k], lo + want)
        assert np.array_equal(vals[:k], c[want].view(np.uint16))


@needs_kernel
@pytest.mark.parametrize("entry", ENTRIES)
@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 400),
    at=st.integers(0, 31),
    span=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    changed=st.sampled_from([0.0, 0.003, 0.05, 0.5, 1.0]),
    specials=st.sampled_from([0.0, 0.01, 0.2]),
    nans=st.booleans(),
    limit=st.one_of(st.just(None), st.integers(0, 40)),
    wide=st.booleans(),
)
def test_the_fused_comparison_finds_what_torch_finds(
    entry: str,
    seed: int,
    n: int,
    at: int,
    span: tuple[float, float],
    changed: float,
    specials: float,
    nans: bool,
    limit: int | None,
    wide: bool,
) -> None:
    # Any span [lo, hi) of a source at any alignment, any share of changes, NaNs,
    # infinities and denormals, int32 or int64 positions: torch's changed positions and its
    # bf16 bits, in order; -2 at the first unit with a NaN and -1 past the limit, whichever
    # comes first.
    bits = _source(seed, n, specials, nans)
    rng = np.random.default_rng(seed + 1)
    flip = np.where(rng.random(n) < changed, rng.integers(1, 1 << 16, n), 0)
    lo, hi = sorted(int(f * n) for f in span)
    _check(entry, bits, flip, at, lo, hi, n if limit is None else limit, wide)


@needs_kernel
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("changed", [0.0, 1e-4, 0.01, 0.5])
def test_the_fused_comparison_of_a_large_tensor_matches_torch(entry: str, changed: float) -> None:
    # Enough blocks that every loop runs long, from an odd start.
    n = (1 << 20) + 37
    bits = _source(7, n, 0.001, nans=False)
    rng = np.random.default_rng(8)
    flip = np.where(rng.random(n) < changed, 1, 0)
    _check(entry, bits, flip, 3, 5, n, n, wide=False)


@needs_kernel
@pytest.mark.parametrize("numel", [1000, 3 << 20])
def test_diff_cast_gives_torch_changes_in_one_piece_or_several(numel: int) -> None:
    # Through the entry point the channel uses: below its parallel threshold one call, above
    # it one piece per pool thread, joined in order.
    src = torch.randn(numel, generator=torch.Generator().manual_seed(5)) * 0.02
    base = src.to(torch.bfloat16)
    base[::997] = 1.0
    found = patches.diff_cast(src, base.view(torch.uint8))
    assert isinstance(found, tuple)
    cast = src.to(torch.bfloat16).view(torch.int16)
    want = (cast != base.view(torch.int16)).nonzero().squeeze(1).numpy()
    assert np.array_equal(found[0], want)
    assert np.array_equal(found[1], cast.numpy()[want].view(np.uint16))
