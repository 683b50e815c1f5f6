"""Delta syncs, sender side: the baseline an open sender keeps, and the stage that turns a
sync's named tensors into buckets of whole tensors and patches against it.

The baseline is the wire bytes (after the pipeline: casts, FP8 quantization, MoE expansion
applied) of the last sync every member confirmed, one host copy per tensor. A sync either
diffs against it (when every member holds its version) or is full; either way the tensors
it sends become the next baseline only once every member confirmed the sync
(:meth:`DeltaRun.commit`): a failed sync leaves the baseline where it was, except that a full
sync drops the old baseline first. It records into the old one's storage where name, dtype
and shape match (fresh memory's page faults can cost more than the transfer).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from streamsync._copies import copy_tensors
from streamsync._log import log
from streamsync.wire import patch as patches
from streamsync.wire.pack import BucketBuilder, CastRule

#: Below this many bytes a sync is too short to time: it does not count towards the verdict.
DECLINE_MIN_BYTES = 16 << 20
#: Deltas must take at most this share of what a dense sync takes (both per byte, medians
#: of the last :data:`WINDOW`), or the channel declines them.
DECLINE_SHARE = 0.9
#: Syncs each running estimate spans; a verdict needs at least :data:`JUDGE_AFTER` deltas.
WINDOW = 3
JUDGE_AFTER = 2
#: Dense syncs a declined channel sends before it tries deltas again; each probe that does
#: not pay doubles the wait, up to :data:`BACKOFF_MAX`, and a verdict that pays resets it.
BACKOFF = 8
BACKOFF_MAX = 64


#: A plain dense sync, a full one that records a baseline, a delta.
SyncKind = Literal["dense", "full", "delta"]


def sync_cost(report: Any, delta: bool) -> float:
    """Seconds a sync cost, delta or dense: all of it, as the caller waits for it (the
    source and pipeline, any comparison, the transfer, the receivers' applying)."""
    return float(report.seconds)


@dataclass
class Verdict:
    """Whether deltas pay on a channel, judged on its steady state: the median cost per byte
    of its last :data:`WINDOW` deltas against that of its last plain dense syncs. The first
    delta on each new baseline is cold (caches, first-touch page faults) and not counted; a
    full sync that records a baseline is not a dense sync's cost (it also copies the
    baseline, and the first on a sender faults its memory in), so a channel with none yet
    sends one to time. Declined, the channel sends dense syncs, and after a back-off records
    a baseline to try deltas again."""

    #: What a finished sync cost (the seam tests inject costs through).
    cost: Callable[[Any, bool], float] = sync_cost
    min_bytes: int = DECLINE_MIN_BYTES
    #: Dense syncs a first decline sends before the probe.
    probe_after: int = BACKOFF
    #: Why deltas do not pay here now, with the figures that decided (``None``: they do, or
    #: are being tried).
    declined: str | None = None
    #: Why the next sync is plain dense, to time it.
    measure: str | None = None
    #: Why the next sync without a baseline records one (set until the next verdict).
    rebase: str | None = None
    #: Dense syncs the next decline sends before its probe, and those left of this one's.
    backoff: int = field(init=False)
    wait: int = 0
    cold: bool = True
    dense: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    deltas: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __post_init__(self) -> None:
        self.backoff = self.probe_after

    def retry(self) -> None:
        """A full sync was asked for: deltas are tried again from it, the back-off anew."""
        self.declined, self.measure, self.rebase = None, None, None
        self.backoff = self.probe_after
        self.deltas.clear()

    def declines(self) -> str | None:
        """Whether this sync goes plain dense (the reason), counting down the back-off; once
        it has run out, ``None``, and the sync starts a probe."""
        if self.measure is not None:
            why, self.measure = self.measure, None
            self.rebase = "recording a baseline again after a dense sync timed"
            return why
        if self.declined is None:
            return None
        if self.wait > 0:
            self.wait -= 1
            return self.declined
        self.declined = None
        return None

    def record(self, report: Any, tensor_bytes: int, *, kind: SyncKind, sync_id: int) -> str | None:
        """Count a finished sync of ``tensor_bytes`` (plain dense, full recording a baseline,
        or a delta): the reason if deltas now do not pay."""
        if kind != "delta":
            self.cold = True
        if tensor_bytes < self.min_bytes or kind == "full":
            return None
        per_byte = self.cost(report, kind == "delta") / tensor_bytes
        if kind == "dense":
            if per_byte > 0:
                self.dense.append(per_byte)
            return None
        if self.cold:
            self.cold = False
            return None
        self.deltas.append(per_byte)
        if len(self.deltas) < JUDGE_AFTER:
            return None
        if not self.dense:
            self.measure = "timing a dense sync to judge deltas against"
            return None
        took = statistics.median(self.deltas) * tensor_bytes
        dense_s = statistics.median(self.dense) * tensor_bytes
        pays = took <= DECLINE_SHARE * dense_s
        log(
            "sync.delta.verdict",
            sync_id=sync_id,
            pays=pays,
            delta_seconds=round(took, 6),
            dense_seconds=round(dense_s, 6),
            deltas=len(self.deltas),
            dense=len(self.dense),
        )
        self.rebase = None
        if pays:
            self.backoff = self.probe_after
            return None
        self.rebase = f"trying deltas again after {self.backoff} dense syncs"
        self.declined = (
            f"deltas do not pay on this channel: a delta takes {took:.3f} s (median of the "
            f"last {len(self.deltas)}) where a dense sync takes {dense_s:.3f} s "
            f"(median of the last {len(self.dense)} dense syncs); the next {self.backoff} "
            "syncs go dense, then deltas are tried again (or from a full sync asked for)"
        )
        self.wait, self.backoff = self.backoff, min(2 * self.backoff, BACKOFF_MAX)
        self.deltas.clear()
        return self.declined


@dataclass
class Baseline:
    """The wire bytes of the version every member of the last delta-tracked sync holds."""

    version: int | None = None
    #: Whether deltas pay on this channel.
    verdict: Verdict = field(default_factory=Verdict)
    #: name -> (dtype, shape, bytes as a flat uint8 tensor)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor]] = field(
        default_factory=dict
    )
    #: A dropped baseline's storage, kept for the next full sync to record into.
    spare: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor]] = field(
        default_factory=dict
    )

    @property
    def nbytes(self) -> int:
        """Host bytes the baseline holds, its storage kept for reuse included."""
        held = itertools.chain(self.tensors.values(), self.spare.values())
        return sum(raw.numel() for _, _, raw in held)

    def drop(self, *, keep: bool = False) -> None:
        """Forget the version; ``keep``: its storage stays for the next full sync to reuse,
        else it is freed."""
        self.spare = {**self.spare, **self.tensors} if keep else {}
        self.version = None
        self.tensors = {}


def choose(baseline: Baseline, held: dict[int, int | None], *, full: bool) -> str | None:
    """Why this sync must be full, or ``None``: it can be a delta on ``baseline``."""
    if full:
        return "a full sync was asked for"
    if baseline.version is None:
        rebase = baseline.verdict.rebase
        return rebase or "no baseline yet (the first sync on this sender, or the last one failed)"
    if not held:
        return "no receiver is there to say what it holds"
    for index, version in held.items():
        if version != baseline.version:
            holds = f"version {version}" if version is not None else "no known version"
            return f"receiver {index} holds {holds}, not the baseline's {baseline.version}"
    return baseline.verdict.measure


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
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
    #: The old baseline's storage this full sync records into.
    _spare: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.base is None:
            # A full sync: its tensors become the whole new baseline.
            self.baseline.drop(keep=True)
            self._spare, self.baseline.spare = self.baseline.spare, {}

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
        self.dense += 1
        raw = self._record(name, tensor, given, wire_dtype, shape)
        return builder.add(name, raw.view(wire_dtype).view(shape))

    def _record(
        self,
        name: str,
        tensor: torch.Tensor,
        given: int,
        wire_dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """The baseline's copy of ``tensor`` as sent (cast to ``wire_dtype`` on the copy
        pool), in the old baseline's storage where it fits; the bucket is filled from it."""
        spare = self._spare.pop(name, None)
        if spare is not None and spare[0] == wire_dtype and spare[1] == shape:
            raw = spare[2]
        else:
            # No old storage fits (none yet, or the layout changed): what is left of it is
            # freed now, so that the sync never holds more than the larger of two baselines.
            self._spare.clear()
            if tensor.dtype == wire_dtype and tensor.data_ptr() != given:
                # Already a copy of its own (from another device, or made contiguous).
                self._pending[name] = (wire_dtype, shape, _bytes(tensor))
                return _bytes(tensor)
            raw = torch.empty(tensor.numel() * wire_dtype.itemsize, dtype=torch.uint8)
        copy_tensors([(raw.view(wire_dtype), tensor.reshape(-1))])
        self._pending[name] = (wire_dtype, shape, raw)
        return raw

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
