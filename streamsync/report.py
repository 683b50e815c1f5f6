"""Reports returned by every sync: msgspec Structs, so they serialise for RPC and JSON."""

from __future__ import annotations

import msgspec


class LoadResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one sink (or one model instance of a sink) did with a sync."""

    #: Names copied into the model.
    loaded: tuple[str, ...] = ()
    #: The model's names that the sync did not update.
    missing: tuple[str, ...] = ()
    #: Names received that this model does not have (non-strict sinks skip them).
    unexpected: tuple[str, ...] = ()
    #: Per model instance, for sinks that serve several (a main model and a drafter).
    instances: dict[str, LoadResult] = {}


class DeltaReport(msgspec.Struct, frozen=True, kw_only=True):
    """How a delta-tracked sync (``send(..., delta=True)``) travelled."""

    #: The version (sync id) the sync was a delta on; ``None``: it was full.
    base: int | None = None
    #: Why the sync was full (``None`` for a delta).
    full_reason: str | None = None
    #: Tensors not sent (unchanged), sent as patches, sent whole.
    unchanged: int = 0
    sparse: int = 0
    dense: int = 0
    #: Seconds spent comparing against the baseline.
    scan_seconds: float = 0.0
    #: Host bytes the sender's baseline holds after the sync.
    baseline_bytes: int = 0


class LoraReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a LoRA adapter sync (``WeightSync.update_lora``) installed."""

    #: The adapter's name (what generation asks for).
    name: str
    #: The version's path: the engine's key for this version (its prefix-cache blocks).
    path: str
    #: The adapter's rank (``r`` of its config).
    rank: int
    #: Requests generating with this adapter when the new version was installed: they go
    #: on with the new version from the engine's next step (``None``: the engine cannot
    #: say, as over the server).
    in_flight: int | None = None


def _kernel() -> str:
    from streamsync._copies import kernel  # on first use: importing streamsync stays light

    return kernel()


class SyncReport(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one sync on one side.

    ``complete`` is false on the partial report attached to an exception: then ``loaded``
    lists exactly what the receiving model was given before the sync failed.
    """

    sync_id: int
    side: str
    tensors: int
    nbytes: int
    buckets: int
    seconds: float
    #: Seconds per phase. Sender: ``source`` (the pipeline making buckets), ``send`` (the
    #: transport taking them), split into ``wait`` (for a free slot), ``pack`` (the copy into
    #: the slot, casts fused) and ``publish`` (announcing it) where the transport counts
    #: them, and ``end`` (waiting for the receivers' reports). Receiver: ``wait`` (for the
    #: next bucket), ``prepare``, ``load`` (unpacking and the sink's copies), ``finalize``.
    #: A staged sync's commit adds ``apply``: the slowest worker's copy of the staged version
    #: into its models.
    phases: dict[str, float] = {}
    #: The copy and patch kernel this side ran: ``"c"``, compiled when the package was
    #: installed, or ``"torch"``, the torch and numpy fallback where it was not built.
    kernel: str = msgspec.field(default_factory=_kernel)
    complete: bool = True
    loaded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    instances: dict[str, LoadResult] = {}
    receivers: int = 1
    #: Sender: receivers the channel expects that took no part in this sync (gone, or not
    #: back yet), each with why; only a channel opened with ``require_all=False`` completes
    #: a sync without them.
    absent: tuple[str, ...] = ()
    #: Sender: peers turned away since the sync before, each with its address and why (a
    #: wrong secret, another protocol version): receivers that should have joined.
    refused: tuple[str, ...] = ()
    #: Bytes that crossed the transport (``nbytes`` of a delta sync counts the tensors it
    #: represents, unchanged ones included).
    wire_bytes: int = 0
    #: Sender of an engine channel: the bytes each worker received (named as in
    #: ``instances``, less the model instance: ``worker<w>``, ``engine<e>.worker<w>``).
    worker_bytes: dict[str, int] = {}
    #: Sender: the bytes each trainer rank sent (a plain trainer is rank 0).
    rank_bytes: dict[int, int] = {}
    #: Sender of a sharded channel: tensors sent whole to some worker for want of a learned
    #: slice (the engine's checkpoint does not name them, or their loader could not be
    #: followed).
    unsliced: tuple[str, ...] = ()
    #: Sender of a delta-tracked sync: how it travelled (see :class:`DeltaReport`).
    delta: DeltaReport | None = None
    #: Sender of a LoRA adapter sync: what was installed (see :class:`LoraReport`).
    lora: LoraReport | None = None

    @property
    def gbps(self) -> float:
        """Payload gigabytes (1e9 bytes) per second, end to end."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One human line: tensors, bytes, seconds, GB/s, and what the sync did not reach:
        the model's tensors it left untouched (on the receiver that missed the most) and
        the receivers absent."""
        state = "ok" if self.complete else "PARTIAL"
        missing = max([len(self.missing), *(len(r.missing) for r in self.instances.values())])
        if missing:
            state += f", {missing} missing"
        if self.absent:
            state += f", {len(self.absent)} absent"
        return (
            f"sync {self.sync_id} {self.side}: {self.tensors} tensors, "
            f"{self.nbytes / 2**20:.1f} MiB in {self.buckets} buckets, "
            f"{self.seconds:.3f} s, {self.gbps:.2f} GB/s [{state}]"
        )
