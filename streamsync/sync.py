"""``send`` and ``receive``: one sync from a stream of named tensors into a sink."""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from streamsync._log import log
from streamsync.adapter import AdapterLike, Chain, reading
from streamsync.adapters.bucket import DEFAULT_BUCKET_BYTES, Bucketer
from streamsync.bucket import DEFAULT_MAX_TENSOR_BYTES, Bucket, Unpacker
from streamsync.errors import (
    ConfigError,
    SenderAbortedError,
    StaleSyncError,
    StreamsyncError,
    SyncInProgressError,
    WireFormatError,
)
from streamsync.report import LoadResult, SyncReport
from streamsync.sink import Sink, call_phase
from streamsync.sources import named_tensors
from streamsync.transports import Receiver, Sender, open_receiver, open_sender
from streamsync.wire import Abort, BucketHeader, Done, End, Failed

__all__ = ["DEFAULT_TIMEOUT", "receive", "send"]

#: Seconds any single wait may take unless told otherwise.
DEFAULT_TIMEOUT = 60.0

# Sync ids increase across the process and across restarts (seeded from the clock), so a
# receiver can refuse a sync older than the one it applied last.
_sync_ids = itertools.count(time.time_ns() // 1000)


def next_sync_id() -> int:
    """A fresh sync id, larger than any this process (or an earlier one) handed out."""
    return next(_sync_ids)


async def send(
    weights: Any,
    endpoint: str | Sender,
    *,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    checksum: bool = False,
    sync_id: int | None = None,
    **transport_options: Any,
) -> SyncReport:
    """Stream ``weights`` to every receiver of ``endpoint`` and wait for their reports.

    ``weights`` is anything :func:`~streamsync.named_tensors` takes, a stream of named
    tensors, or a stream of buckets (ending in :func:`~streamsync.adapters.bucket`).
    ``pipeline`` is applied to it first; given there rather than applied by the caller, a
    trailing ``cast`` is fused into the packing copy. ``endpoint`` is a transport URL (opened
    for this sync, with ``transport_options``) or an open :class:`Sender` (whose slots are
    reused across syncs). Every wait is bounded by ``timeout`` seconds.
    """
    if isinstance(endpoint, str):
        if bucket_bytes is not None:
            transport_options.setdefault("slot_bytes", bucket_bytes)
        async with open_sender(endpoint, connect_timeout=timeout, **transport_options) as sender:
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
    size = (
        bucket_bytes if bucket_bytes is not None else min(sender.slot_bytes, DEFAULT_BUCKET_BYTES)
    )
    if size > sender.slot_bytes:
        raise ConfigError(
            f"bucket_bytes={size} exceeds the transport's slot of {sender.slot_bytes} bytes; "
            f"use bucket_bytes <= {sender.slot_bytes} or open the transport with larger slots"
        )
    stream: AsyncIterable[Any] = (
        weights if isinstance(weights, AsyncIterable) else named_tensors(weights)
    )
    chain = Chain(pipeline, Bucketer(size)) if pipeline is not None else Chain(Bucketer(size))
    sid = next_sync_id() if sync_id is None else sync_id
    return await _send(chain(stream), sender, sid, timeout=timeout, checksum=checksum)


async def _send(
    buckets: AsyncIterable[Bucket], sender: Sender, sync_id: int, *, timeout: float, checksum: bool
) -> SyncReport:
    # The clock starts once every receiver is there: joining is not part of the sync.
    await sender.wait_ready(timeout=timeout)
    before = sender.statistics()
    start = time.perf_counter()
    seq = tensors = nbytes = 0
    source_s = send_s = 0.0
    async with reading(buckets) as items:
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    bucket = await anext(items)
                except StopAsyncIteration:
                    break
                t1 = time.perf_counter()
                await sender.send(sync_id, seq, bucket, timeout=timeout, checksum=checksum)
                source_s += t1 - t0
                send_s += time.perf_counter() - t1
                seq += 1
                tensors += bucket.tensors
                nbytes += bucket.nbytes
                del bucket  # packed: its source tensors may go before the next one fills
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await sender.abort(Abort(sync_id, f"{type(exc).__name__}: {exc}"))
            _add_send_counts(exc, seq, tensors, nbytes, start)
            raise
    log(
        "sync.send",
        sync_id=sync_id,
        bytes=nbytes,
        buckets=seq,
        tensors=tensors,
        seconds=round(send_s, 6),
        source_seconds=round(source_s, 6),
    )
    phases = {"source": source_s, "send": send_s}
    after = sender.statistics()
    if before is not None and after is not None:
        # What ``send`` was made of: waiting for a free slot, packing, handing it over.
        phases["wait"] = after.wait_seconds - before.wait_seconds
        phases["pack"] = after.pack_seconds - before.pack_seconds
        phases["publish"] = after.publish_seconds - before.publish_seconds
    t2 = time.perf_counter()
    try:
        dones = await sender.end(End(sync_id, seq, tensors, nbytes), timeout=timeout)
    except BaseException as exc:
        _add_send_counts(exc, seq, tensors, nbytes, start)
        raise
    end_s = time.perf_counter() - t2
    total = time.perf_counter() - start
    log("sync.end", sync_id=sync_id, receivers=len(dones), seconds=round(end_s, 6))
    instances = {
        f"receiver{d.receiver}": LoadResult(loaded=d.loaded, missing=d.missing) for d in dones
    }
    loaded = sorted({n for d in dones for n in d.loaded})
    missing = sorted(set.intersection(*(set(d.missing) for d in dones))) if dones else []
    report = SyncReport(
        sync_id=sync_id,
        side="send",
        tensors=tensors,
        nbytes=nbytes,
        buckets=seq,
        seconds=total,
        phases={**phases, "end": end_s},
        loaded=tuple(loaded),
        missing=tuple(missing),
        instances=instances,
        receivers=len(dones),
    )
    log(
        "sync.done",
        side="send",
        sync_id=sync_id,
        bytes=nbytes,
        seconds=round(total, 6),
        gbps=round(report.gbps, 3),
    )
    return report


def _add_send_counts(
    exc: BaseException, buckets: int, tensors: int, nbytes: int, start: float
) -> None:
    """Complete the partial report a receiver's failure carries with what this side sent."""
    report = getattr(exc, "report", None)
    if isinstance(exc, StreamsyncError) and report is not None and report.side == "send":
        exc.report = msgspec.structs.replace(
            report,
            tensors=tensors,
            nbytes=nbytes,
            buckets=buckets,
            seconds=time.perf_counter() - start,
        )


@dataclass
class _ReceiverState:
    unpacker: Unpacker
    last_sync_id: int | None = None
    failed_sync_id: int | None = None
    applied: list[str] = field(default_factory=list)
    busy: bool = False


_states: weakref.WeakKeyDictionary[Receiver, _ReceiverState] = weakref.WeakKeyDictionary()


async def receive(
    endpoint: str | Receiver,
    sink: Sink,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    **transport_options: Any,
) -> SyncReport:
    """Receive one sync from ``endpoint`` into ``sink``: ``prepare`` at the first message,
    ``load`` per bucket, ``finalize`` at the end, then report back to the sender.

    On failure the exception carries the partial report (``exc.report``, ``complete=False``,
    ``loaded`` = what the sink was given) and the sender is told, so it fails too.
    """
    if isinstance(endpoint, str):
        async with open_receiver(endpoint, **transport_options) as receiver:
            return await receive(receiver, sink, timeout=timeout, max_tensor_bytes=max_tensor_bytes)
    if transport_options:
        raise ConfigError(
            f"transport options {sorted(transport_options)} only apply when endpoint is a URL"
        )
    receiver = endpoint
    state = _states.get(receiver)
    if state is None:
        state = _states[receiver] = _ReceiverState(Unpacker(max_tensor_bytes=max_tensor_bytes))
    if state.busy:
        raise SyncInProgressError(
            f"receive() was called on {type(receiver).__name__} while another receive() on it "
            "is still running; one sync at a time per channel"
        )
    state.busy = True
    try:
        return await _receive(receiver, sink, state, timeout=timeout)
    finally:
        state.busy = False


async def _first_message(receiver: Receiver, state: _ReceiverState, timeout: float) -> Any:
    """The first message of the next sync, skipping leftovers of a sync that already failed
    here (the sender's abort, buckets still in flight)."""
    while True:
        incoming = await receiver.receive(timeout=timeout)
        msg = incoming.message
        if state.failed_sync_id is not None and msg.sync_id == state.failed_sync_id:
            if isinstance(msg, BucketHeader):
                await receiver.release(msg)
            continue
        return incoming


async def _receive(
    receiver: Receiver, sink: Sink, state: _ReceiverState, *, timeout: float
) -> SyncReport:
    incoming = await _first_message(receiver, state, timeout)
    # A sync's clock starts at its first message: idle time before it is the trainer's.
    start = time.perf_counter()
    wait_s = load_s = 0.0
    sync_id = incoming.message.sync_id
    applied: list[str] = []
    nbytes = buckets = 0
    phases: dict[str, float] = {}
    # The bucket whose slot this side holds; released even if the sync fails on it, since
    # the sender reuses a slot only once every receiver has acked it.
    held = incoming.message if isinstance(incoming.message, BucketHeader) else None
    try:
        if state.last_sync_id is not None and sync_id <= state.last_sync_id:
            raise StaleSyncError(
                f"sync {sync_id} is not newer than sync {state.last_sync_id}, "
                "which this receiver already applied"
            )
        state.unpacker.begin(sync_id)
        t0 = time.perf_counter()
        await call_phase(sink.prepare)
        phases["prepare"] = time.perf_counter() - t0
        log("sync.prepare", sync_id=sync_id, seconds=round(phases["prepare"], 6))
        while True:
            msg = incoming.message
            if msg.sync_id != sync_id:
                raise WireFormatError(
                    f"message of sync {msg.sync_id} arrived during sync {sync_id}"
                )
            if isinstance(msg, BucketHeader):
                assert incoming.data is not None
                t0 = time.perf_counter()
                batch = state.unpacker.feed(
                    msg, incoming.data, target=getattr(sink, "target", None)
                )
                await call_phase(sink.load, batch)
                applied.extend(name for name, _ in batch)
                load_s += time.perf_counter() - t0
                nbytes += msg.nbytes
                buckets += 1
                held = None
                await receiver.release(msg)
            elif isinstance(msg, End):
                state.unpacker.finish(msg)
                break
            else:
                assert isinstance(msg, Abort)
                raise SenderAbortedError(f"sender aborted sync {sync_id}: {msg.reason}")
            t0 = time.perf_counter()
            incoming = await receiver.receive(timeout=timeout)
            wait_s += time.perf_counter() - t0
            if isinstance(incoming.message, BucketHeader):
                held = incoming.message
        phases["load"] = load_s
        log("sync.load", sync_id=sync_id, bytes=nbytes, buckets=buckets, seconds=round(load_s, 6))
        t0 = time.perf_counter()
        result = await call_phase(sink.finalize)
        phases["finalize"] = time.perf_counter() - t0
        log("sync.finalize", sync_id=sync_id, seconds=round(phases["finalize"], 6))
    except BaseException as exc:
        state.failed_sync_id = sync_id
        phases["load"] = load_s
        phases["wait"] = wait_s
        # Chunks written straight into the sink's tensors changed them too.
        seen = set(applied)
        applied.extend(n for n in state.unpacker.touched if n not in seen)
        report = _receive_report(sync_id, applied, nbytes, buckets, start, phases, None, False)
        if isinstance(exc, StreamsyncError):
            exc.report = report
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(min(timeout, 5.0)),
            contextlib.suppress(Exception),  # the sender may be the thing that broke
        ):
            if held is not None:
                await receiver.release(held)
            if not isinstance(exc, SenderAbortedError):
                await receiver.reply(
                    Failed(
                        sync_id,
                        getattr(receiver, "index", 0),
                        type(exc).__name__,
                        str(exc),
                        tuple(applied),
                    )
                )
        raise
    phases["wait"] = wait_s
    load_result = result if isinstance(result, LoadResult) else LoadResult(loaded=tuple(applied))
    report = _receive_report(sync_id, applied, nbytes, buckets, start, phases, load_result, True)
    await receiver.reply(
        Done(
            sync_id,
            getattr(receiver, "index", 0),
            report.tensors,
            nbytes,
            load_result.loaded,
            load_result.missing,
        )
    )
    state.last_sync_id = sync_id
    log(
        "sync.done",
        side="receive",
        sync_id=sync_id,
        bytes=nbytes,
        seconds=round(report.seconds, 6),
        gbps=round(report.gbps, 3),
    )
    return report


def _receive_report(
    sync_id: int,
    applied: list[str],
    nbytes: int,
    buckets: int,
    start: float,
    phases: dict[str, float],
    result: LoadResult | None,
    complete: bool,
) -> SyncReport:
    return SyncReport(
        sync_id=sync_id,
        side="receive",
        tensors=len(applied),
        nbytes=nbytes,
        buckets=buckets,
        seconds=time.perf_counter() - start,
        phases=phases,
        complete=complete,
        loaded=result.loaded if result is not None else tuple(applied),
        missing=result.missing if result is not None else (),
        unexpected=result.unexpected if result is not None else (),
        instances=result.instances if result is not None else {},
    )
