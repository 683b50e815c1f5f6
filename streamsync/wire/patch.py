"""Patches: the elements of a tensor that changed since a baseline, as positions and values.

A patch of ``k`` elements of a tensor with ``numel`` elements of ``itemsize`` bytes travels
as one bucket entry (``Entry.patch == k``): ``k`` positions (int32 below 2**31 elements,
else int64), strictly ascending, then at the next :data:`~streamsync.wire.slot.ALIGN`
boundary the ``k`` new elements' bytes. Elements are compared as bit patterns, never as
floats: a NaN that stays NaN is unchanged, ``-0.0`` against ``0.0`` is a change, FP8 bytes
are bytes.

:func:`diff` finds the changed elements in one pass over both tensors (32 bytes at a time,
then the elements of a block that differs) with the compiled kernel of
:mod:`streamsync._copies` (built when the package is installed), else with torch's ``!=`` and
``nonzero``. A patch is only made when it is smaller than the tensor; otherwise the tensor
travels whole.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Final

import numpy as np
import torch

from streamsync._copies import POOL_THREADS, _library, _pool, _wait, kernel
from streamsync.errors import WireFormatError

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


def _addr(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def _pos_args(pos: np.ndarray) -> tuple[int | None, int | None]:
    return (_addr(pos), None) if pos.dtype == np.int32 else (None, _addr(pos))


class _HasNaN(Exception):
    """The fused cast met a NaN (see ``ss_diff_f32_bf16``)."""


def _diff_c(
    fn: Any, new: int, base: int, numel: int, itemsize: int, limit: int, in_bytes: int
) -> Patch | None:
    """Run a compiled diff over elements ``[0, numel)`` of the arrays at addresses ``new``
    (``in_bytes`` per element) and ``base`` (``itemsize``), in pieces on the pool."""
    pdt = position_dtype(numel)
    per = 32 // itemsize
    pieces = POOL_THREADS if numel * in_bytes >= _PARALLEL_BYTES else 1
    share_of = -(-numel // pieces)  # ceil
    step = max(per, -(-share_of // per) * per)
    spans = [(lo, min(numel, lo + step)) for lo in range(0, numel, step)] or [(0, 0)]

    def run(span: tuple[int, int], share: int) -> tuple[np.ndarray, np.ndarray, int]:
        pos = np.empty(share + per, pdt)  # the kernel's slack (see _kernel.c)
        vals = np.empty(share + per, _UINT[itemsize])
        p32, p64 = _pos_args(pos)
        k = fn(new, base, span[0], span[1], p32, p64, _addr(vals), share)
        return pos, vals, int(k)

    if len(spans) == 1:
        outs = [run(spans[0], limit)]
    else:
        share = max(1, limit // len(spans))
        futures: list[Future[Any]] = [_pool.get().submit(run, span, share) for span in spans]
        _wait(futures)
        outs = [f.result() for f in futures]
    if any(k == -2 for _, _, k in outs):
        raise _HasNaN
    if any(k < 0 for _, _, k in outs):
        return None
    if len(outs) == 1:
        pos, vals, k = outs[0]
        return pos[:k].copy(), vals[:k].copy()
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


def diff(new: torch.Tensor, base: torch.Tensor, itemsize: int) -> Patch | None:
    """The elements of ``new`` whose bits differ from ``base`` (both contiguous CPU uint8
    tensors of the same size, ``itemsize`` bytes per element), or ``None`` when a patch
    would not be smaller than ``new`` itself."""
    if new.numel() != base.numel() or new.numel() % itemsize:
        raise ValueError("diff needs two byte tensors of the same whole number of elements")
    a, b = _elements(new, itemsize), _elements(base, itemsize)
    limit = _limit(a.size, itemsize)
    if kernel() == "c":
        fn = getattr(_library(), f"ss_diff_{itemsize}")
        return _diff_c(fn, _addr(a), _addr(b), a.size, itemsize, limit, itemsize)
    return _diff_torch(a, b, itemsize, limit)


#: What :func:`diff_cast` returns for a tensor it cannot convert as torch would (a NaN).
UNCAST: Final = "uncast"


def diff_cast(source: torch.Tensor, base: torch.Tensor) -> Patch | str | None:
    """:func:`diff` of ``source.to(torch.bfloat16)`` (``source``: contiguous CPU float32)
    against the bf16 bytes ``base``, without converting it first: the cast is fused into
    the comparison. :data:`UNCAST` when the compiled kernel is missing or the tensor holds a
    NaN (convert it with torch, then :func:`diff`)."""
    if kernel() != "c" or source.dtype != torch.float32 or not source.is_contiguous():
        return UNCAST
    numel = source.numel()
    if base.numel() != 2 * numel:
        raise ValueError("diff_cast: the baseline is not the bf16 bytes of the source")
    fn = _library().ss_diff_f32_bf16
    try:
        return _diff_c(fn, source.data_ptr(), base.data_ptr(), numel, 2, _limit(numel, 2), 4)
    except _HasNaN:
        return UNCAST


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
    """The positions and values of a patch entry's bytes (views into ``data``, or into a host
    copy of a device's bytes); the caller has checked that ``data`` is :func:`patch_nbytes`
    long."""
    raw = (data if data.is_cpu else data.cpu()).numpy()
    pdt = position_dtype(numel)
    split = positions_nbytes(k, numel)
    pos = raw[: k * np.dtype(pdt).itemsize].view(pdt)
    vals = raw[split : split + k * itemsize].view(_UINT[itemsize])
    return pos, vals


def check(pos: np.ndarray, numel: int, after: int, name: str) -> int:
    """Raise :class:`WireFormatError` unless every position is inside the tensor and the
    positions ascend strictly from above ``after`` (the last position of the tensor's
    previous patch piece, or -1); returns the last position."""
    if pos.size == 0:
        return after
    if kernel() == "c":
        p32, p64 = _pos_args(pos)
        bad = int(_library().ss_check(p32, p64, pos.size, numel, after))
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


def apply(dst: torch.Tensor, patch: Patch, itemsize: int) -> None:
    """Write a checked patch's values into ``dst`` (any device, any dtype of that element
    size: bit patterns are written as they are)."""
    pos, vals = patch
    if dst.is_cpu and dst.is_contiguous():
        target = dst.reshape(-1).view(torch.uint8).numpy().view(_UINT[itemsize])
        if kernel() == "c":
            p32, p64 = _pos_args(pos)
            fn = getattr(_library(), f"ss_apply_{itemsize}")
            fn(_addr(target), p32, p64, _addr(vals), pos.size)
        else:
            target[pos] = vals
        return
    flat = dst.view(-1).view(_TORCH_INT[itemsize])
    index = torch.from_numpy(pos.astype(np.int64)).to(dst.device)
    values = torch.from_numpy(vals.view(_SIGNED[itemsize])).to(dst.device)
    flat.index_copy_(0, index, values)
