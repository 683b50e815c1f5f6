"""``send``: one sync from a stream of named tensors to every receiver of a channel (the
receiving side is ``receiving.py``)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import msgspec

from streamsync._channel import DEFAULT_TIMEOUT, finished, sender_state, sorted_once
from streamsync._delta import DeltaRun, choose
from streamsync._log import log
from streamsync._replay import BucketPlans
from streamsync.adapters.bucket import Bucketer
from streamsync.errors import ConfigError, StreamsyncError, describe
from streamsync.pipeline import AdapterLike, Chain, reading
from streamsync.report import DeltaReport, LoadResult, SyncReport
from streamsync.sources import named_tensors
from streamsync.transports import one_shot_options, open_sender
from streamsync.transports.base import Sender
from streamsync.wire.frames import Abort, Done, End
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES, Bucket

# Sync ids increase across the process and across restarts (seeded from the clock), so a
# receiver can refuse a sync older than the one it applied last.
_sync_ids = itertools.count(time.time_ns() // 1000)
# Keywords of send() itself, beside the transport's options.
_SEND_KEYWORDS = ("pipeline", "bucket_bytes", "timeout", "checksum", "sync_id", "delta")


async def send(
    weights: Any,
    endpoint: str | Sender,
    *,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    checksum: bool = False,
    sync_id: int | None = None,
    delta: bool | Literal["full"] = False,
    **transport_options: Any,
) -> SyncReport:
    """Stream ``weights`` to every receiver of ``endpoint`` and wait for their reports.

    ``weights`` is anything :func:`~streamsync.named_tensors` takes, a stream of named
    tensors, or a stream of buckets (ending in :func:`~streamsync.adapters.bucket`).
    ``pipeline`` is applied to it first; given there rather than applied by the caller, a
    trailing ``cast`` is fused into the packing copy. ``endpoint`` is a transport URL (opened
    for this sync, with ``transport_options``) or an open :class:`Sender` (whose slots are
    reused across syncs). Every wait of the sync is bounded by ``timeout`` seconds; the
    wait for the receivers to join by ``connect_timeout`` (a transport option, as a keyword
    or in the URL; given neither, ``timeout``; see :mod:`streamsync.transports.options`).

    ``delta=True`` (an open sender only) sends only what changed since the last sync every
    receiver confirmed: each tensor whole, as a patch of its changed elements, or not at
    all, whichever is smallest. The sync is full instead when a receiver holds another
    version (the report's ``full_reason`` says which); ``delta="full"`` forces a full sync
    that still records the baseline for the next delta. See ``docs/delta.md``.
    """
    if delta and isinstance(endpoint, str):
        raise ConfigError(
            "delta needs an open sender, which keeps the baseline between syncs: "
            "async with open_sender(url) as tx: await send(weights, tx, delta=True)"
        )
    if delta not in (False, True, "full"):
        raise ConfigError(f"delta={delta!r}: use False, True or 'full'")
    if isinstance(endpoint, str):
        options = one_shot_options(
            endpoint, transport_options, timeout=timeout, caller=("send", _SEND_KEYWORDS)
        )
        if bucket_bytes is not None:
            options.setdefault("slot_bytes", bucket_bytes)
        async with open_sender(endpoint, **options) as sender:
            # One sync, then it closes: once its receivers are there, a later arrival (the
            # next step's receiver, in a loop) is told "busy" and waits for the next sender.
            await sender.wait_ready(timeout=options.get("connect_timeout", timeout))
            sender.seal()
            return await send(
                weights,
                sender,
                pipeline=pipeline,
                bucket_bytes=bucket_bytes,
                timeout=timeout,
                checksum=checksum,
                sync_id=sync_id,
            )
    if transport_options:
        raise ConfigError(
            f"transport options {sorted(transport_options)} only apply when endpoint is a URL"
        )
    sender = endpoint
    size = _bucket_size(sender, bucket_bytes)
    sid = next(_sync_ids) if sync_id is None else sync_id
    if delta:
        return await _send_delta(
            _stream(weights),
            sender,
            sid,
            pipeline,
            size,
            full=delta == "full",
            timeout=timeout,
            checksum=checksum,
        )
    state = sender_state(sender)
    state.baseline.drop()  # this sync moves the receivers past it
    bucketer = Bucketer(size, plans=state.plans)
    return await _send(
        _buckets(weights, pipeline, bucketer), sender, sid, timeout=timeout, checksum=checksum
    )


def next_sync_id() -> int:
    """A fresh sync id (increasing across the process and its restarts)."""
    return next(_sync_ids)


def _bucket_size(sender: Sender, bucket_bytes: int | None) -> int:
    size = (
        bucket_bytes if bucket_bytes is not None else min(sender.slot_bytes, DEFAULT_BUCKET_BYTES)
    )
    if size > sender.slot_bytes:
        raise ConfigError(
            f"bucket_bytes={size} exceeds the transport's slot of {sender.slot_bytes} bytes; "
            f"use bucket_bytes <= {sender.slot_bytes} or open the transport with larger slots"
        )
    return size


def _stream(weights: Any) -> AsyncIterable[Any]:
    return weights if isinstance(weights, AsyncIterable) else named_tensors(weights)


def _buckets(
    weights: Any, pipeline: AdapterLike | None, bucketer: Bucketer
) -> AsyncIterable[Bucket]:
    """``weights`` through ``pipeline`` and ``bucketer`` (a trailing ``cast`` fused in)."""
    chain = Chain(pipeline, bucketer) if pipeline is not None else Chain(bucketer)
    return chain(_stream(weights))


async def send_aside(
    weights: Any,
    sender: Sender,
    *,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    checksum: bool = False,
    sync_id: int | None = None,
) -> SyncReport:
    """A sync of tensors that go beside the model's weights (a LoRA adapter) on an open
    sender: like :func:`send`, but the receivers' weights, and so the sender's delta
    baseline, stay as they are (a receiver's sink reports the version it still holds)."""
    size = _bucket_size(sender, bucket_bytes)
    sid = next(_sync_ids) if sync_id is None else sync_id
    bucketer = Bucketer(size, plans=sender_state(sender).plans)
    return await _send(
        _buckets(weights, pipeline, bucketer), sender, sid, timeout=timeout, checksum=checksum
    )


async def _send_delta(
    stream: AsyncIterable[Any],
    sender: Sender,
    sync_id: int,
    pipeline: AdapterLike | None,
    size: int,
    *,
    full: bool,
    timeout: float,
    checksum: bool,
) -> SyncReport:
    """A delta-tracked sync: diffed against the sender's baseline when every member holds
    its version, else full (and recorded as the next baseline)."""
    baseline = sender_state(sender).baseline
    async with _aborting(sender, sync_id):
        await sender.wait_ready(timeout=timeout)
        held = await sender.begin(sync_id, timeout=timeout)

    def sending(bucketer: Bucketer, **delta: Any) -> Awaitable[SyncReport]:
        buckets = _buckets(stream, pipeline, bucketer)
        return _send(
            buckets, sender, sync_id, timeout=timeout, checksum=checksum, begun=True, **delta
        )

    verdict = baseline.verdict
    if full:
        verdict.retry()
    declined = verdict.declines()
    if declined is not None:
        # Deltas do not pay here (the baseline is freed), or a dense sync is timed (its
        # storage is kept for the full sync that follows to record into).
        baseline.drop(keep=verdict.declined is None)
        report = await sending(Bucketer(size))
        verdict.record(report, report.nbytes, kind="dense", sync_id=sync_id)
        return msgspec.structs.replace(
            report, delta=DeltaReport(full_reason=declined, dense=report.tensors)
        )
    why = choose(baseline, held, full=full)
    base = baseline.version if why is None else None
    run = DeltaRun(baseline, base, size)
    report = await sending(Bucketer(size, delta=run), base=base, unchanged=lambda: run.unchanged)
    return _delta_done(run, report, why)


def _delta_done(run: DeltaRun, report: SyncReport, why: str | None) -> SyncReport:
    """Keep what a delta-tracked sync sent as the next baseline (unless deltas do not pay
    here) and complete its report."""
    baseline, base = run.baseline, run.base
    declined = baseline.verdict.record(
        report, run.tensor_bytes, kind="full" if base is None else "delta", sync_id=report.sync_id
    )
    if declined is None:
        run.commit(report.sync_id)
    else:
        baseline.drop()  # the recorded copy would never be used
    scan = run.scanned_bytes / run.scan_seconds / 1e9 if run.scan_seconds > 0 else 0.0
    log(
        "sync.delta",
        sync_id=report.sync_id,
        base=base,
        full_reason=why,
        unchanged=run.unchanged,
        sparse=run.sparse,
        dense=run.dense,
        wire_bytes=report.wire_bytes,
        tensor_bytes=run.tensor_bytes,
        scan_gbps=round(scan, 3),
    )
    return msgspec.structs.replace(
        report,
        nbytes=run.tensor_bytes,
        delta=DeltaReport(
            base=base,
            full_reason=declined or why,
            unchanged=run.unchanged,
            sparse=run.sparse,
            dense=run.dense,
            scan_seconds=run.scan_seconds,
            baseline_bytes=baseline.nbytes,
        ),
    )


@contextlib.asynccontextmanager
async def _aborting(sender: Sender, sync_id: int) -> AsyncIterator[None]:
    """Abort the sync on its receivers if the block fails, cancelled too (an engine channel
    cancels the send when an engine fails). Unheard, a receive still waiting for the sync
    would take the next sync's buckets for its own; one whose receive() was cancelled with
    ours skips the abort (``ReceiverState.abandoned``)."""
    try:
        yield
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await sender.abort(Abort(sync_id, describe(exc)))
        raise


@dataclass
class _Sending:
    """How far one sync got on the sending side."""

    sync_id: int
    start: float = field(default_factory=time.perf_counter)
    buckets: int = 0
    tensors: int = 0
    nbytes: int = 0
    source_s: float = 0.0
    send_s: float = 0.0
    #: Each bucket's names: what a ``Done`` is the difference from.
    sent: list[Sequence[str]] = field(default_factory=list)


async def _send(
    buckets: AsyncIterable[Bucket],
    sender: Sender,
    sync_id: int,
    *,
    timeout: float,
    checksum: bool,
    base: int | None = None,
    unchanged: Callable[[], int] = lambda: 0,
    begun: bool = False,
) -> SyncReport:
    # The clock starts once every receiver is there: joining is not part of the sync.
    if not begun:
        async with _aborting(sender, sync_id):
            await sender.wait_ready(timeout=timeout)
    before = sender.statistics()
    sync = _Sending(sync_id)
    try:
        await _send_buckets(buckets, sender, sync, timeout=timeout, checksum=checksum)
        phases = {"source": sync.source_s, "send": sync.send_s}
        after = sender.statistics()
        if before is not None and after is not None:
            # What ``send`` was made of: waiting for a free slot, packing, handing it over.
            phases["wait"] = after.wait_seconds - before.wait_seconds
            phases["pack"] = after.pack_seconds - before.pack_seconds
            phases["publish"] = after.publish_seconds - before.publish_seconds
        t2 = time.perf_counter()
        end = End(sync_id, sync.buckets, sync.tensors, sync.nbytes, base, unchanged())
        dones = await sender.end(end, timeout=timeout)
    except BaseException as exc:
        # Complete the partial report a receiver's failure carries with what this side sent.
        report = getattr(exc, "report", None)
        if isinstance(exc, StreamsyncError) and report is not None and report.side == "send":
            exc.report = msgspec.structs.replace(
                report,
                tensors=sync.tensors,
                nbytes=sync.nbytes,
                buckets=sync.buckets,
                seconds=time.perf_counter() - sync.start,
            )
        raise
    phases["end"] = time.perf_counter() - t2
    return _send_report(sender, sync, dones, phases)


async def _send_buckets(
    buckets: AsyncIterable[Bucket],
    sender: Sender,
    sync: _Sending,
    *,
    timeout: float,
    checksum: bool,
) -> None:
    """Send every bucket of the sync; abort it on the receivers if that fails."""
    async with reading(buckets) as items, _aborting(sender, sync.sync_id):
        while True:
            t0 = time.perf_counter()
            try:
                bucket = await anext(items)
            except StopAsyncIteration:
                break
            t1 = time.perf_counter()
            await sender.send(
                sync.sync_id, sync.buckets, bucket, timeout=timeout, checksum=checksum
            )
            sync.source_s += t1 - t0
            sync.send_s += time.perf_counter() - t1
            sync.buckets += 1
            sync.tensors += bucket.tensors
            sync.nbytes += bucket.nbytes
            sync.sent.append(bucket.names)
            del bucket  # packed: its source tensors may go before the next one fills
    log(
        "sync.send",
        sync_id=sync.sync_id,
        bytes=sync.nbytes,
        buckets=sync.buckets,
        tensors=sync.tensors,
        seconds=round(sync.send_s, 6),
        source_seconds=round(sync.source_s, 6),
    )


def _send_report(
    sender: Sender, sync: _Sending, dones: list[Done], phases: dict[str, float]
) -> SyncReport:
    """The sender's report of a finished sync, from the receivers' ``Done``s."""
    attendance = sender.attendance()
    log(
        "sync.end",
        sync_id=sync.sync_id,
        receivers=len(dones),
        absent=len(attendance.absent),
        refused=len(attendance.refused),
        seconds=round(phases["end"], 6),
    )
    missing = sorted(set.intersection(*(set(d.missing) for d in dones))) if dones else []
    carried = _carried(sync.sent, sender_state(sender).plans)
    loaded = {d.receiver: _loaded(d, carried) for d in dones}
    return finished(
        SyncReport(
            sync_id=sync.sync_id,
            side="send",
            tensors=sync.tensors,
            nbytes=sync.nbytes,
            wire_bytes=sync.nbytes,
            buckets=sync.buckets,
            seconds=time.perf_counter() - sync.start,
            phases=phases,
            loaded=_union(loaded.values()),
            missing=tuple(missing),
            instances={
                f"receiver{d.receiver}": LoadResult(loaded=loaded[d.receiver], missing=d.missing)
                for d in dones
            },
            receivers=len(dones),
            absent=attendance.absent,
            refused=attendance.refused,
        )
    )


def _carried(sent: list[Sequence[str]], kept: BucketPlans) -> tuple[str, ...]:
    """The names the sync carried (``sent``, per bucket), sorted, each once; kept with the
    sender's plans for the next sync that sends the same lists, as replayed plans do."""
    if kept.sent is not None and kept.sent[0] == sent:  # a pointer per bucket, when kept
        return kept.sent[1]
    carried = sorted_once(itertools.chain.from_iterable(sent))
    kept.sent = (sent, carried)
    return carried


def _loaded(done: Done, carried: tuple[str, ...]) -> tuple[str, ...]:
    """The names ``done``'s sink loaded, sorted: those carried less ``skipped``, plus
    ``added``."""
    if not done.skipped and not done.added:
        return carried
    skipped = set(done.skipped)
    return tuple(sorted({n for n in carried if n not in skipped}.union(done.added)))


def _union(names: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """The sorted union of sorted name lists; usually all the same list, returned as it
    is."""
    lists = list(names)
    first = lists[0] if lists else ()
    if all(other == first for other in lists):
        return first
    return tuple(sorted(set().union(*lists)))
