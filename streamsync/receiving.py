"""``receive``: one sync from a channel into a sink (the sending side is ``sending.py``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from streamsync._channel import (
    DEFAULT_TIMEOUT,
    ReceiverState,
    finished,
    receiver_state,
    sorted_once,
)
from streamsync._log import log
from streamsync.errors import (
    ConfigError,
    DeltaBaseError,
    SenderAbortedError,
    StaleSyncError,
    StreamsyncError,
    SyncInProgressError,
    WireFormatError,
)
from streamsync.report import LoadResult, SyncReport
from streamsync.sink import (
    BUFFER_MANIFEST,
    BufferDeclaringSink,
    ModuleSink,
    Sink,
    WrappingSink,
    as_target,
    as_versioned,
    call_phase,
)
from streamsync.transports import one_shot_options, open_receiver
from streamsync.transports.base import Incoming, Receiver
from streamsync.wire.frames import Abort, BucketHeader, Done, End, Failed
from streamsync.wire.unpack import DEFAULT_MAX_TENSOR_BYTES, BucketTensors

# Keywords of receive() itself, beside the transport's options.
_RECEIVE_KEYWORDS = ("timeout", "max_tensor_bytes", "sync_id")


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
    state = receiver_state(endpoint)
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
    state = receiver_state(receiver)
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
    return finished(report)


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
    state = receiver_state(receiver)
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
    carried = sorted_once(applied)
    if carried == loaded:
        skipped, added = (), ()
    else:
        have, sent = set(loaded), set(carried)
        skipped = tuple(n for n in carried if n not in have)
        added = tuple(sorted(have - sent))
    state.carried = (applied, loaded, skipped, added)
    return skipped, added


async def _phase(sync: _Progress, name: str, fn: Callable[[], Any]) -> Any:
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
    unpacker = receiver_state(receiver).unpacker
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

    if isinstance(sink, BufferDeclaringSink):
        sink.declare_buffers(manifest_names(dict(batch)[BUFFER_MANIFEST]))
    return BucketTensors([(name, tensor) for name, tensor in batch if name != BUFFER_MANIFEST])


async def _fail(receiver: Receiver, sync: _Progress, exc: BaseException, timeout: float) -> None:
    """Record the failure here, attach the partial report and tell the sender."""
    state = receiver_state(receiver)
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
