"""Delta syncs, sender side: the baseline an open sender keeps, and the stage that turns a
sync's named tensors into buckets of whole tensors and patches against it.

The baseline is the wire bytes (after the pipeline: casts, FP8 quantization, MoE expansion
applied) of the last sync every member confirmed, one host copy per tensor. A sync either
diffs against it (when every member holds its version) or is full; either way the tensors
it sends become the next baseline only once every member confirmed the sync
(:meth:`DeltaRun.commit`): a failed sync leaves the baseline where it was, except that a full
sync drops the old baseline first (its memory is needed for the new one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from streamsync._copies import clone
from streamsync.wire import patch as patches
from streamsync.wire.bucket import BucketBuilder, CastRule


@dataclass
class Baseline:
    """The wire bytes of the version every member of the last delta-tracked sync holds."""

    version: int | None = None
    #: Why deltas do not pay on this channel (see :func:`decline`): syncs go dense, with
    #: no baseline kept, until a full sync is asked for.
    declined: str | None = None
    #: What moving the whole model cost per byte in the last full sync, and whether a
    #: delta has been judged against it.
    dense_seconds_per_byte: float | None = None
    judged: bool = False
    #: name -> (dtype, shape, bytes as a flat uint8 tensor)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor]] = field(
        default_factory=dict
    )

    @property
    def nbytes(self) -> int:
        """Host bytes the baseline holds."""
        return sum(raw.numel() for _, _, raw in self.tensors.values())

    def drop(self) -> None:
        self.version = None
        self.tensors = {}


def choose(baseline: Baseline, held: dict[int, int | None], *, full: bool) -> str | None:
    """Why this sync must be full, or ``None``: it can be a delta on ``baseline``."""
    if full:
        return "a full sync was asked for"
    if baseline.version is None:
        return "no baseline yet (the first sync on this sender, or the last one failed)"
    if not held:
        return "no receiver is there to say what it holds"
    for index, version in held.items():
        if version != baseline.version:
            holds = f"version {version}" if version is not None else "no known version"
            return f"receiver {index} holds {holds}, not the baseline's {baseline.version}"
    return None


#: Below this many bytes a sync is too short to time: deltas are never declined for it.
DECLINE_MIN_BYTES = 16 << 20
#: A delta sync must take at most this share of what the transport took for the whole
#: model, or the channel declines deltas.
DECLINE_SHARE = 0.9


def transport_seconds(report: Any) -> float:
    """Seconds a sync spent moving its bytes: its send and end phases (the receivers'
    copies and reports included; the source, the pipeline and any comparison excluded)."""
    phases = report.phases
    return float(phases.get("send", 0.0) + phases.get("end", 0.0))


def decline(baseline: Baseline, report: Any, tensor_bytes: int, *, delta: bool) -> str | None:
    """Whether deltas pay on this channel, measured: a full sync records what moving the
    whole model costs here (per byte); the first delta sync after it is timed whole
    (comparing, encoding, sending, the receivers' patching). If the delta took more than
    :data:`DECLINE_SHARE` of the full transfer, deltas do not pay: the reason, else
    ``None``. Syncs under :data:`DECLINE_MIN_BYTES` are not judged."""
    if tensor_bytes < DECLINE_MIN_BYTES:
        return None
    if not delta:
        moving = transport_seconds(report)
        baseline.dense_seconds_per_byte = moving / tensor_bytes if moving > 0 else None
        return None
    if baseline.dense_seconds_per_byte is None or baseline.judged:
        return None
    baseline.judged = True
    full = baseline.dense_seconds_per_byte * tensor_bytes
    if report.seconds <= DECLINE_SHARE * full:
        return None
    return (
        f"deltas do not pay on this channel: a delta sync took {report.seconds:.3f} s where "
        f"moving the whole model takes {full:.3f} s; syncs go dense until a full sync is "
        "asked for"
    )


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class DeltaRun:
    """One sync's encoding against ``baseline`` (``base``: the version it diffs against, or
    ``None`` for a full sync that records a new baseline)."""

    baseline: Baseline
    base: int | None
    bucket_bytes: int
    #: The bucketer's ``cast`` (fused into the comparison where it can be).
    cast: CastRule | None = None
    unchanged: int = 0
    sparse: int = 0
    dense: int = 0
    #: Bytes of the tensors this sync represents (unchanged ones included).
    tensor_bytes: int = 0
    #: Seconds spent comparing against the baseline, and the bytes compared.
    scan_seconds: float = 0.0
    scanned_bytes: int = 0
    _pending: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor]] = field(
        default_factory=dict
    )
    _patches: dict[str, patches.Patch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.base is None:
            self.baseline.drop()  # a full sync: its tensors become the whole new baseline

    def place(self, builder: BucketBuilder, name: str, tensor: torch.Tensor) -> Any:
        """Place ``tensor`` in ``builder``: whole, as a patch, or not at all (unchanged)."""
        if not isinstance(tensor, torch.Tensor):
            return builder.add(name, tensor)  # raises, naming the tensor
        given = tensor.data_ptr()
        tensor = tensor.detach()
        if not tensor.is_cpu:
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        to = self.cast(name, tensor.dtype) if self.cast is not None else None
        wire_dtype = to or tensor.dtype
        shape = tuple(tensor.shape)
        itemsize = wire_dtype.itemsize
        nbytes = tensor.numel() * itemsize
        self.tensor_bytes += nbytes
        base = self.baseline.tensors.get(name) if self.base is not None else None
        found: patches.Patch | str | None = patches.UNCAST
        if base is not None and base[0] == wire_dtype and base[1] == shape and nbytes:
            t0 = time.perf_counter()
            if to == torch.bfloat16 and tensor.dtype == torch.float32:
                found = patches.diff_cast(tensor, base[2])
            if isinstance(found, str):  # not fused: convert, then compare
                if to is not None:
                    tensor = tensor.to(to)
                    to = None
                found = patches.diff(_bytes(tensor), base[2], itemsize)
            self.scan_seconds += time.perf_counter() - t0
            self.scanned_bytes += nbytes
            if isinstance(found, tuple):
                if found[0].size == 0:
                    self.unchanged += 1
                    return ()
                self.sparse += 1
                self._patches[name] = found
                pieces = self._pieces(found, tensor.numel(), itemsize)
                return builder.add_patch(name, wire_dtype, shape, pieces)
        if to is not None:
            tensor = tensor.to(to)
        self.dense += 1
        # The baseline keeps its own copy, unless this tensor is already one (a cast's).
        raw = _bytes(tensor) if tensor.data_ptr() != given else clone(_bytes(tensor))
        self._pending[name] = (wire_dtype, shape, raw)
        return builder.add(name, tensor)

    def _pieces(
        self, found: patches.Patch, numel: int, itemsize: int
    ) -> list[tuple[int, torch.Tensor]]:
        """The patch as encoded pieces that each fit a bucket."""
        pos, vals = found
        per = max(1, (self.bucket_bytes - 64) // (pos.itemsize + itemsize))
        out: list[tuple[int, torch.Tensor]] = []
        for lo in range(0, pos.size, per):
            piece = (pos[lo : lo + per], vals[lo : lo + per])
            k = piece[0].size
            buf = torch.empty(patches.patch_nbytes(k, numel, itemsize), dtype=torch.uint8)
            patches.encode(piece, numel, itemsize, buf)
            out.append((k, buf))
        return out

    def commit(self, version: int) -> None:
        """Every member confirmed the sync: its tensors are the baseline now."""
        tensors = self.baseline.tensors
        for name, found in self._patches.items():
            dtype, _, raw = tensors[name]
            patches.apply(raw.view(-1), found, dtype.itemsize)
        tensors.update(self._pending)
        self.baseline.version = version
        self._pending, self._patches = {}, {}
