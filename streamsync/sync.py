"""``send`` and ``receive``: one sync from a stream of named tensors into a sink."""

from __future__ import annotations

import contextlib
import itertools
import operator
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import msgspec

from streamsync._delta import DeltaRun, choose
from streamsync._log import log
from streamsync._replay import BucketPlans
from streamsync.adapters.bucket import Bucketer
from streamsync.errors import (
    ConfigError,
    DeltaBaseError,
    SenderAbortedError,
    StaleSyncError,
    StreamsyncError,
    SyncInProgressError,
    WireFormatError,
    describe,
)
from streamsync.pipeline import AdapterLike, Chain, reading
from streamsync.report import DeltaReport, LoadResult, SyncReport
from streamsync.sink import (
    BUFFER_MANIFEST,
    ModuleSink,
    Sink,
    WrappingSink,
    as_target,
    as_versioned,
    call_phase,
)
from streamsync.sources import named_tensors
from streamsync.transports import one_shot_options, open_receiver, open_sender
from streamsync.transports.base import Incoming, Receiver, ReceiverState, Sender
from streamsync.wire.bucket import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MAX_TENSOR_BYTES,
    Bucket,
    BucketTensors,
)
from streamsync.wire.frames import Abort, BucketHeader, Done, End, Failed

#: Seconds any single wait may take unless told otherwise.
DEFAULT_TIMEOUT = 60.0

# Sync ids increase across the process and across restarts (seeded from the clock), so a
# receiver can refuse a sync older than the one it applied last.
_sync_ids = itertools.count(time.time_ns() // 1000)
# Keywords of send() and receive() themselves, beside the transport's options.
_SEND_KEYWORDS = ("pipeline", "bucket_bytes", "timeout", "checksum", "sync_id", "delta")
_RECEIVE_KEYWORDS = ("timeout", "max_tensor_bytes", "sync_id")


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
    sender.state.baseline.drop()  # this sync moves the receivers past it
    bucketer = Bucketer(size, plans=sender.state.plans)
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
    bucketer = Bucketer(size, plans=sender.state.plans)
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
    baseline = sender.state.baseline
    async with _aborting(sender, sync_id):
        await sender.wait_ready(timeout=timeout)
        held = await sender.begin(sync_id, timeout=timeout)
    verdict = baseline.verdict
    if full:
        verdict.retry()
    declined = verdict.declines()
    if declined is not None:
        # Deltas do not pay here (the baseline is freed), or a dense sync is timed (its
        # storage is kept for the full sync that follows to record into).
        baseline.drop(keep=verdict.declined is None)
        report = await _send(
            _buckets(stream, pipeline, Bucketer(size)),
            sender,
            sync_id,
            timeout=timeout,
            checksum=checksum,
            begun=True,
        )
        verdict.record(report, report.nbytes, kind="dense", sync_id=sync_id)
        return msgspec.structs.replace(
            report, delta=DeltaReport(full_reason=declined, dense=report.tensors)
        )
    why = choose(baseline, held, full=full)
    base = baseline.version if why is None else None
    run = DeltaRun(baseline, base, size)
    report = await _send(
        _buckets(stream, pipeline, Bucketer(size, delta=run)),
        sender,
        sync_id,
        timeout=timeout,
        checksum=checksum,
        base=base,
        unchanged=lambda: run.unchanged,
        begun=True,
    )
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
    carried = _carried(sync.sent, sender.state.plans)
    loaded = {d.receiver: _loaded(d, carried) for d in dones}
    return _done(
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
    carried = _sorted_once(itertools.chain.from_iterable(sent))
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


def _done(report: SyncReport) -> SyncReport:
    """Log a finished sync's report (either side) and return it."""
    log(
        "sync.done",
        side=report.side,
        sync_id=report.sync_id,
        bytes=report.nbytes,
        seconds=round(report.seconds, 6),
        gbps=round(report.gbps, 3),
    )
    return report


async def receive(
    endpoint: str | Receiver,
    sink: Sink,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    sync_id: int | None = None,
    **transport_options: Any,
) -> SyncReport:
    """Receive one sync from ``endpoint`` into ``sink``: ``prepare`` at the first message,
    ``load`` per bucket, ``finalize`` at the end, then report back to the sender.

    ``endpoint`` is a transport URL (opened for this sync, with ``transport_options``) or
    an open :class:`Receiver`. Every wait of the sync is bounded by ``timeout`` seconds;
    reaching the sender by ``connect_timeout`` (a transport option, as a keyword or in the
    URL; given neither, ``timeout``; see :mod:`streamsync.transports.options`).

    ``sync_id``, when the caller knows which sync this is (the sender's ``sync_id``): what
    is still queued of earlier syncs (an abort, buckets of a sync given up before this
    receiver began it) is skipped rather than taken for this one.

    ``max_tensor_bytes`` bounds what a sender may make this side allocate for one tensor
    (this call's value applies, whatever earlier calls on the channel passed).
    On failure the exception carries the partial report (``exc.report``, ``complete=False``,
    ``loaded`` = what the sink was given) and the sender is told, so it fails too.
    """
    if isinstance(endpoint, str):
        options = one_shot_options(
            endpoint,
            transport_options,
            timeout=timeout,
            side="receiver",
            caller=("receive", _RECEIVE_KEYWORDS),
        )
        async with open_receiver(endpoint, **options) as receiver:
            return await receive(
                receiver,
                sink,
                timeout=timeout,
                max_tensor_bytes=max_tensor_bytes,
                sync_id=sync_id,
            )
    if transport_options:
        raise ConfigError(
            f"transport options {sorted(transport_options)} only apply when endpoint is a URL"
        )
    state = endpoint.state
    if state.busy:
        raise SyncInProgressError(
            f"receive() was called on {type(endpoint).__name__} while another receive() on it "
            "is still running; one sync at a time per channel"
        )
    state.busy = True
    state.unpacker.max_tensor_bytes = max_tensor_bytes
    try:
        return await _receive(endpoint, sink, timeout=timeout, sync_id=sync_id)
    except anyio.get_cancelled_exc_class():
        if state.waiting:
            state.abandoned = True  # see ReceiverState.abandoned
        raise
    finally:
        state.busy = False
        state.waiting = False


@dataclass
class _Progress:
    """How far one sync got on the receiving side."""

    sync_id: int
    #: The bucket whose slot this side holds: released even if the sync fails on it.
    held: BucketHeader | None
    # A sync's clock starts at its first message: idle time before it is the trainer's.
    start: float = field(default_factory=time.perf_counter)
    applied: list[str] = field(default_factory=list)
    nbytes: int = 0
    buckets: int = 0
    load_s: float = 0.0
    wait_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


async def _receive(
    receiver: Receiver, sink: Sink, *, timeout: float, sync_id: int | None = None
) -> SyncReport:
    state = receiver.state
    incoming = await _first_message(receiver, timeout=timeout, sync_id=sync_id)
    first = incoming.message
    sync = _Progress(first.sync_id, first if isinstance(first, BucketHeader) else None)
    try:
        if state.last_sync_id is not None and sync.sync_id <= state.last_sync_id:
            raise StaleSyncError(
                f"sync {sync.sync_id} is not newer than sync {state.last_sync_id}, "
                "which this receiver already applied"
            )
        state.unpacker.begin(sync.sync_id)
        if isinstance(first, Abort):
            # The sync failed before its first bucket: the sink is not touched.
            raise SenderAbortedError(f"sender aborted sync {sync.sync_id}: {first.reason}")
        module_sink = _module_sink(sink)
        if module_sink is not None:  # a sink per sync: the receiver keeps its version
            module_sink.version = state.version_of(module_sink.module)
        versioned = as_versioned(sink)
        if first.base is not None:
            held = versioned.version if versioned is not None else None
            if held != first.base:
                holds = f"version {held}" if held is not None else "no known version"
                raise DeltaBaseError(
                    f"sync {sync.sync_id} is a delta on version {first.base}; this receiver's "
                    f"sink holds {holds} (nothing applied; the next sync is full)"
                )
        state.held = None  # in flux until finalize succeeds
        if versioned is not None:
            versioned.version = None
        await _phase(sync, "prepare", sink.prepare)
        # Handed over, not shared: _load_all holds the first bucket only while it loads it.
        handed = [incoming]
        del incoming
        await _load_all(receiver, sink, handed, sync, timeout)
        result = await _phase(sync, "finalize", sink.finalize)
        if versioned is not None:
            versioned.version = sync.sync_id
        if module_sink is not None:
            state.hold(module_sink.module, versioned.version if versioned else None)
    except BaseException as exc:
        await _fail(receiver, sync, exc, timeout)
        raise
    loaded = result if isinstance(result, LoadResult) else LoadResult(loaded=tuple(sync.applied))
    report = _receive_report(sync, loaded, True)
    skipped, added = _against_carried(state, sync.applied, loaded.loaded)
    await receiver.reply(
        Done(
            sync.sync_id,
            receiver.index,
            report.tensors,
            sync.nbytes,
            skipped,
            added,
            loaded.missing,
            versioned.version if versioned is not None else None,
        )
    )
    state.last_sync_id = sync.sync_id
    return _done(report)


def _module_sink(sink: Sink) -> ModuleSink | None:
    """``sink`` if a :class:`ModuleSink`, or the one a staging sink wraps; else ``None``."""
    if isinstance(sink, ModuleSink):
        return sink
    inner = sink.inner if isinstance(sink, WrappingSink) else None
    return inner if isinstance(inner, ModuleSink) else None


async def _first_message(receiver: Receiver, *, timeout: float, sync_id: int | None) -> Incoming:
    """The first message of the next sync, skipping leftovers of a sync that already failed
    here (the sender's abort, buckets still in flight), of any sync before ``sync_id``, and
    the abort of the sync a cancelled receive() was waiting for."""
    state = receiver.state
    state.waiting = True
    while True:
        incoming = await receiver.receive(timeout=timeout)
        first = incoming.message
        if isinstance(first, Abort) and state.abandoned:
            state.abandoned = False
            continue
        state.abandoned = False
        earlier = sync_id is not None and first.sync_id < sync_id
        if first.sync_id != state.failed_sync_id and not earlier:
            state.waiting = False
            return incoming
        if isinstance(first, BucketHeader):
            await receiver.release(first)


def _against_carried(
    state: ReceiverState, applied: list[str], loaded: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(skipped, added)``: ``loaded`` against the names this sync carried (``applied``).
    Worked out again only when the names carried or the sink's answer changed; a trainer's
    every step repeats both, as the same strings, which compare by pointer."""
    memo = state.carried
    if memo is not None:
        known_applied, known_loaded, skipped, added = memo
        if (known_loaded is loaded or known_loaded == loaded) and known_applied == applied:
            return skipped, added
    carried = _sorted_once(applied)
    if carried == loaded:
        skipped, added = (), ()
    else:
        have, sent = set(loaded), set(carried)
        skipped = tuple(n for n in carried if n not in have)
        added = tuple(sorted(have - sent))
    state.carried = (applied, loaded, skipped, added)
    return skipped, added


def _sorted_once(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` sorted, each once (a chunked tensor's name comes with each chunk)."""
    ordered = sorted(names)
    if all(map(operator.ne, ordered, itertools.islice(ordered, 1, None))):
        return tuple(ordered)
    return tuple(name for name, _ in itertools.groupby(ordered))


async def _phase(sync: _Progress, name: str, fn: Callable[[], Any]) -> Any:
    """Run the sink's ``prepare`` or ``finalize``, timed and logged."""
    t0 = time.perf_counter()
    result = await call_phase(fn)
    sync.phases[name] = time.perf_counter() - t0
    log(f"sync.{name}", sync_id=sync.sync_id, seconds=round(sync.phases[name], 6))
    return result


async def _load_all(
    receiver: Receiver, sink: Sink, handed: list[Incoming], sync: _Progress, timeout: float
) -> None:
    """Hand every bucket of the sync to the sink, releasing each slot, up to its end
    (``handed``: the sync's first message, taken out of it)."""
    incoming = handed.pop()
    unpacker = receiver.state.unpacker
    targeted = as_target(sink)
    target = targeted.target if targeted is not None else None
    while True:
        msg = incoming.message
        if msg.sync_id != sync.sync_id:
            raise WireFormatError(
                f"message of sync {msg.sync_id} arrived during sync {sync.sync_id}"
            )
        if isinstance(msg, End):
            unpacker.finish(msg)
            break
        if isinstance(msg, Abort):
            raise SenderAbortedError(f"sender aborted sync {sync.sync_id}: {msg.reason}")
        assert incoming.data is not None
        t0 = time.perf_counter()
        batch = unpacker.feed(msg, incoming.data, target=target)
        names = batch.names
        if BUFFER_MANIFEST in names:
            batch = _declare_buffers(sink, batch)
        await call_phase(sink.load, batch)
        sync.applied.extend(names)
        sync.load_s += time.perf_counter() - t0
        sync.nbytes += msg.nbytes
        sync.buckets += 1
        sync.held = None
        # Nothing of the bucket is held once its slot is given back: where its bytes are a
        # message of their own (zmq), the sender's next bucket is allocated in its place.
        del batch, incoming
        await receiver.release(msg)
        t0 = time.perf_counter()
        incoming = await receiver.receive(timeout=timeout)
        sync.wait_s += time.perf_counter() - t0
        if isinstance(incoming.message, BucketHeader):
            sync.held = incoming.message
    sync.phases["load"] = sync.load_s
    log(
        "sync.load",
        sync_id=sync.sync_id,
        bytes=sync.nbytes,
        buckets=sync.buckets,
        seconds=round(sync.load_s, 6),
    )


def _declare_buffers(sink: Sink, batch: BucketTensors) -> BucketTensors:
    """``batch`` less the trainer's buffer manifest (see
    :func:`~streamsync.adapters.split_buffers`), whose names go to the sink's
    ``declare_buffers`` where it has one: a fact of the stream, not a tensor to load."""
    from streamsync.adapters.split_buffers import manifest_names

    declare = getattr(sink, "declare_buffers", None)
    if declare is not None:
        declare(manifest_names(dict(batch)[BUFFER_MANIFEST]))
    return BucketTensors([(name, tensor) for name, tensor in batch if name != BUFFER_MANIFEST])


async def _fail(receiver: Receiver, sync: _Progress, exc: BaseException, timeout: float) -> None:
    """Record the failure here, attach the partial report and tell the sender."""
    state = receiver.state
    state.failed_sync_id = sync.sync_id
    # Chunks written straight into the sink's tensors changed them too.
    seen = set(sync.applied)
    sync.applied.extend(n for n in state.unpacker.touched if n not in seen)
    if isinstance(exc, StreamsyncError):
        exc.report = _receive_report(sync, LoadResult(loaded=tuple(sync.applied)), False)
    with (
        anyio.CancelScope(shield=True),
        anyio.move_on_after(min(timeout, 5.0)),
        contextlib.suppress(Exception),  # the sender may be the thing that broke
    ):
        if sync.held is not None:
            await receiver.release(sync.held)
        if not isinstance(exc, SenderAbortedError):
            failed = Failed(
                sync.sync_id, receiver.index, type(exc).__name__, str(exc), tuple(sync.applied)
            )
            await receiver.reply(failed)


def _receive_report(sync: _Progress, result: LoadResult, complete: bool) -> SyncReport:
    return SyncReport(
        sync_id=sync.sync_id,
        side="receive",
        tensors=len(sync.applied),
        nbytes=sync.nbytes,
        wire_bytes=sync.nbytes,
        buckets=sync.buckets,
        seconds=time.perf_counter() - sync.start,
        phases={**sync.phases, "load": sync.load_s, "wait": sync.wait_s},
        complete=complete,
        loaded=result.loaded,
        missing=result.missing,
        unexpected=result.unexpected,
        instances=result.instances,
    )
