"""Patches: the elements of a tensor that changed since a baseline, as positions and values.

A patch of ``k`` elements of a tensor with ``numel`` elements of ``itemsize`` bytes travels
as one bucket entry (``Entry.patch == k``): ``k`` positions (int32 below 2**31 elements,
else int64), strictly ascending, then at the next :data:`~streamsync.wire.bucket.ALIGN`
boundary the ``k`` new elements' bytes. Elements are compared as bit patterns, never as
floats: a NaN that stays NaN is unchanged, ``-0.0`` against ``0.0`` is a change, FP8 bytes
are bytes.

:func:`diff` finds the changed elements in one pass over both tensors (8-byte words first,
then the elements of a word that differs) with a compiled kernel when numba is installed
(the ``delta`` extra), else with torch's ``!=`` and ``nonzero``. A patch is only made when
it is smaller than the tensor; otherwise the tensor travels whole.
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import Future
from typing import Any, Final

import numpy as np
import torch

from streamsync._copies import POOL_THREADS, _pool, _wait
from streamsync.errors import WireFormatError

__all__ = [
    "KERNEL",
    "Patch",
    "apply",
    "check",
    "decode",
    "diff",
    "encode",
    "patch_nbytes",
    "position_dtype",
    "positions_nbytes",
]

#: Which implementation :func:`diff` uses: ``"numba"`` (compiled, one pass) or ``"torch"``.
KERNEL: Final = "numba" if importlib.util.find_spec("numba") is not None else "torch"
#: A tensor at least this large is compared in parallel pieces, one per pool thread.
_PARALLEL_BYTES: Final = 4 << 20
_ALIGN: Final = 64
_UINT: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The numpy types torch.from_numpy takes for each size (it has no uint16/32/64 tensors).
_SIGNED: Final = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

#: ``(positions, values)``: int32/int64 positions, and values as unsigned integers of the
#: element's size (bit patterns).
Patch = tuple[np.ndarray, np.ndarray]


def position_dtype(numel: int) -> Any:
    """The positions' dtype for a tensor of ``numel`` elements."""
    return np.int32 if numel < 2**31 else np.int64


def positions_nbytes(k: int, numel: int) -> int:
    """Bytes of ``k`` positions, rounded up to the alignment the values start at."""
    raw = k * int(np.dtype(position_dtype(numel)).itemsize)
    return (raw + _ALIGN - 1) // _ALIGN * _ALIGN


def patch_nbytes(k: int, numel: int, itemsize: int) -> int:
    """Bytes on the wire of a patch of ``k`` elements."""
    return positions_nbytes(k, numel) + k * itemsize


def _limit(numel: int, itemsize: int) -> int:
    """The most changed elements for which a patch is smaller than the whole tensor."""
    per = int(np.dtype(position_dtype(numel)).itemsize) + itemsize
    return max(0, (numel * itemsize - _ALIGN) // per)


def _elements(flat: torch.Tensor, itemsize: int) -> np.ndarray:
    """A contiguous CPU uint8 tensor as unsigned integers of ``itemsize`` bytes (no copy)."""
    return flat.numpy().view(_UINT[itemsize])


if KERNEL == "numba":
    from numba import njit

    @njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
    def _diff_kernel(
        new_w: Any,
        base_w: Any,
        new_e: Any,
        base_e: Any,
        lanes: int,
        lo: int,
        hi: int,
        pos: Any,
        vals: Any,
        limit: int,
    ) -> int:
        # Words [lo, hi) of 8 bytes; then, in the last piece, the elements after the words.
        k = 0
        for w in range(lo, hi):
            if new_w[w] != base_w[w]:
                first = w * lanes
                for i in range(first, first + lanes):
                    if new_e[i] != base_e[i]:
                        if k == limit:
                            return -1
                        pos[k] = i
                        vals[k] = new_e[i]
                        k += 1
        if hi == new_w.size:
            for i in range(hi * lanes, new_e.size):
                if new_e[i] != base_e[i]:
                    if k == limit:
                        return -1
                    pos[k] = i
                    vals[k] = new_e[i]
                    k += 1
        return k

    @njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
    def _check_kernel(pos: Any, numel: int, after: int) -> int:
        # The index of the first position that is not ascending or not inside the tensor.
        prev = after
        for j in range(pos.size):
            p = pos[j]
            if p <= prev or p >= numel:
                return j
            prev = p
        return -1

    @njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
    def _apply_kernel(dst: Any, pos: Any, vals: Any) -> None:
        for j in range(pos.size):
            dst[pos[j]] = vals[j]


def _diff_numba(new: np.ndarray, base: np.ndarray, itemsize: int, limit: int) -> Patch | None:
    numel = new.size
    pdt = position_dtype(numel)
    lanes = 8 // itemsize
    words = numel // lanes
    new_w = new[: words * lanes].view(np.uint64)
    base_w = base[: words * lanes].view(np.uint64)
    pieces = POOL_THREADS if numel * itemsize >= _PARALLEL_BYTES and words >= POOL_THREADS else 1
    step = -(-words // pieces) if words else 0
    spans = [(lo, min(words, lo + step)) for lo in range(0, max(words, 1), max(step, 1))]
    outs: list[tuple[np.ndarray, np.ndarray, int]] = []

    def run(span: tuple[int, int], share: int) -> tuple[np.ndarray, np.ndarray, int]:
        pos = np.empty(share, pdt)
        vals = np.empty(share, new.dtype)
        k = _diff_kernel(new_w, base_w, new, base, lanes, span[0], span[1], pos, vals, share)
        return pos, vals, int(k)

    if len(spans) == 1:
        outs.append(run((0, words), limit))
    else:
        share = max(1, limit // len(spans))
        futures: list[Future[Any]] = [_pool.get().submit(run, span, share) for span in spans]
        _wait(futures)
        outs = [f.result() for f in futures]
    if any(k < 0 for _, _, k in outs):
        return None
    if len(outs) == 1:
        pos, vals, k = outs[0]
        return pos[:k], vals[:k]
    return (
        np.concatenate([p[:k] for p, _, k in outs]),
        np.concatenate([v[:k] for _, v, k in outs]),
    )


def _diff_torch(new: np.ndarray, base: np.ndarray, itemsize: int, limit: int) -> Patch | None:
    signed = _SIGNED[itemsize]
    changed = (torch.from_numpy(new.view(signed)) != torch.from_numpy(base.view(signed))).nonzero()
    if changed.shape[0] > limit:
        return None
    pos = changed.squeeze(1).numpy().astype(position_dtype(new.size))
    return pos, new[pos]


def diff(
    new: torch.Tensor, base: torch.Tensor, itemsize: int, *, kernel: str = KERNEL
) -> Patch | None:
    """The elements of ``new`` whose bits differ from ``base`` (both contiguous CPU uint8
    tensors of the same size, ``itemsize`` bytes per element), or ``None`` when a patch
    would not be smaller than ``new`` itself."""
    if new.numel() != base.numel() or new.numel() % itemsize:
        raise ValueError("diff needs two byte tensors of the same whole number of elements")
    a, b = _elements(new, itemsize), _elements(base, itemsize)
    limit = _limit(a.size, itemsize)
    if kernel == "numba":
        return _diff_numba(a, b, itemsize, limit)
    return _diff_torch(a, b, itemsize, limit)


def encode(patch: Patch, numel: int, itemsize: int, out: torch.Tensor) -> None:
    """Write ``patch`` into ``out`` (uint8, :func:`patch_nbytes` long) in the wire layout."""
    pos, vals = patch
    k = pos.size
    split = positions_nbytes(k, numel)
    dst = out.numpy()
    dst[: k * pos.itemsize] = pos.view(np.uint8)
    dst[k * pos.itemsize : split] = 0
    dst[split : split + k * itemsize] = vals.view(np.uint8)


def decode(data: torch.Tensor, k: int, numel: int, itemsize: int) -> Patch:
    """The positions and values of a patch entry's bytes (views into ``data``); the caller
    has checked that ``data`` is :func:`patch_nbytes` long."""
    raw = data.numpy()
    pdt = position_dtype(numel)
    split = positions_nbytes(k, numel)
    pos = raw[: k * np.dtype(pdt).itemsize].view(pdt)
    vals = raw[split : split + k * itemsize].view(_UINT[itemsize])
    return pos, vals


def check(pos: np.ndarray, numel: int, after: int, name: str, *, kernel: str = KERNEL) -> int:
    """Raise :class:`WireFormatError` unless every position is inside the tensor and the
    positions ascend strictly from above ``after`` (the last position of the tensor's
    previous patch piece, or -1); returns the last position."""
    if pos.size == 0:
        return after
    if kernel == "numba":
        bad = int(_check_kernel(pos, numel, after))
    else:
        t = torch.from_numpy(pos).to(torch.int64)
        before = torch.cat([torch.tensor([after], dtype=torch.int64), t[:-1]])
        wrong = ((t <= before) | (t >= numel)).nonzero()
        bad = int(wrong[0, 0]) if wrong.numel() else -1
    if bad >= 0:
        p = int(pos[bad])
        prev = after if bad == 0 else int(pos[bad - 1])
        if p >= numel or p < 0:
            why = f"position {p} is outside its {numel} elements"
        elif p == prev:
            why = f"position {p} is given twice"
        else:
            why = f"position {p} follows position {prev} (positions must ascend)"
        raise WireFormatError(f"patch of tensor {name!r}: {why}")
    return int(pos[-1])


def apply(dst: torch.Tensor, patch: Patch, itemsize: int, *, kernel: str = KERNEL) -> None:
    """Write a checked patch's values into ``dst`` (any device, any dtype of that element
    size: bit patterns are written as they are)."""
    pos, vals = patch
    if dst.is_cpu and dst.is_contiguous():
        target = dst.reshape(-1).view(torch.uint8).numpy().view(_UINT[itemsize])
        if kernel == "numba":
            _apply_kernel(target, pos, vals)
        else:
            target[pos] = vals
        return
    flat = dst.view(-1).view(_TORCH_INT[itemsize])
    index = torch.from_numpy(pos.astype(np.int64)).to(dst.device)
    values = torch.from_numpy(vals.view(_SIGNED[itemsize])).to(dst.device)
    flat.index_copy_(0, index, values)
