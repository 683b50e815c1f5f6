"""The peer processes of the fault matrix (``test_fault_matrix.py``) and the soak
(``test_soak.py``).

A peer is a sender or a receiver in its own process (a forkserver child, as in
:mod:`streamsync.testing.conformance`) that runs a script: sessions (one channel each), each
a list of syncs. It misbehaves on cue (tampers with its frames, stalls its source, speaks
another protocol version) and reports every sync's outcome through a queue as plain data:
the exception's name and message, the partial report, the names its sink applied and
whether its model holds exactly what the report says. The test process kills, stops and
resumes peers, and tells them when to go on.

The model: eight float32 tensors ``w0``..``w7`` of 1 KiB, sent in 1 KiB buckets, so bucket
``k`` holds exactly ``w{k}`` and a fault in bucket 3 leaves ``w0``..``w2`` applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from importlib.metadata import entry_points
from typing import Any

import anyio
import torch

import streamsync as ss
from streamsync._channel import receiver_state
from streamsync.testing import FakeConfig, FakeVllmModel, LoadWeightsSink
from streamsync.transports import (
    ENTRY_POINT_GROUP,
    Receiver,
    Sender,
    open_receiver,
    open_sender,
    parse_endpoint,
    register,
)
from streamsync.transports.linked import FrameFilter
from streamsync.wire.frames import BucketHeader, Entry, Layout, WireCodec
from streamsync.wire.slot import allocate_slot
from streamsync.wire.unpack import Unpacker

#: Every wait of a sync, in seconds: the faults must surface within twice this.
TIMEOUT = 2.0
CONNECT_S = 60.0
BUCKET_BYTES = 1024
SLOT_BYTES = 4096
NAMES = [f"w{i}" for i in range(8)]
# The largest buffer the receiver's unpacker allocated in this process.
_LARGEST = [0]


def _recording(nbytes: int) -> torch.Tensor:
    """The unpacker's allocator, recording the largest buffer asked for."""
    _LARGEST[0] = max(_LARGEST[0], nbytes)
    return allocate_slot(nbytes)


def weights(seed: int) -> dict[str, torch.Tensor]:
    """The model's tensors as the trainer has them after step ``seed``."""
    return {name: torch.full((256,), float(seed * 10 + i + 1)) for i, name in enumerate(NAMES)}


def bad_weights(seed: int, kind: str, at: int) -> list[tuple[str, torch.Tensor]]:
    """``weights(seed)`` with tensor ``at`` made wrong for the receiving model."""
    items = list(weights(seed).items())
    name, tensor = items[at]
    if kind == "unknown":
        items[at] = (f"bogus{at}", tensor)
    elif kind == "shape":
        items[at] = (name, tensor[:255].clone())
    elif kind == "dtype":
        items[at] = (name, tensor.half())
    elif kind == "duplicate":
        items[at] = (NAMES[0], tensor)
    else:
        raise ValueError(f"unknown bad tensor kind {kind!r}")
    return items


class Model(torch.nn.Module):
    """The receiving model: a buffer per name, zeros until a sync writes them."""

    def __init__(self) -> None:
        super().__init__()
        for name in NAMES:
            self.register_buffer(name, torch.zeros(256))


class PeerSink:
    """A strict :class:`~streamsync.ModuleSink` that records what it applied, tells the
    test when it loads bucket ``event_at`` (and when it has applied bucket ``loaded_at``)
    and can dawdle there (``linger`` seconds, or ``hold``: until the test says go);
    ``started`` is set once it has been given its first bucket."""

    def __init__(self, model: Model, spec: dict[str, Any], results: Any, tag: str) -> None:
        self.inner = ss.ModuleSink(model)
        self.spec = spec
        self.results = results
        self.tag = tag
        self.applied: list[str] = []
        self.started = anyio.Event()
        self._bucket = 0

    def prepare(self) -> None:
        self.inner.prepare()
        self.applied = []
        self._bucket = 0

    async def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        bucket, self._bucket = self._bucket, self._bucket + 1
        self.started.set()
        if bucket == self.spec.get("event_at"):
            self.results.put({"event": "loading", "tag": self.tag, "bucket": bucket})
        self.inner.load(tensors)
        self.applied += [name for name, _ in tensors]
        if bucket == self.spec.get("loaded_at"):
            self.results.put({"event": "loaded", "tag": self.tag, "bucket": bucket})
        if self.spec.get("slow"):
            await anyio.sleep(self.spec["slow"])
        if bucket == self.spec.get("event_at") and self.spec.get("linger"):
            await anyio.sleep(self.spec["linger"])
        if bucket == self.spec.get("event_at") and self.spec.get("hold"):
            # Hold this bucket (and its slot) until the test has done what it does here.
            await _go(self.spec["_control"])

    def finalize(self) -> ss.LoadResult:
        return self.inner.finalize()


# -- outcomes ------------------------------------------------------------------------
def _outcome(tag: str, session: int, sync: int, start: float) -> dict[str, Any]:
    now = time.monotonic()
    return {"tag": tag, "session": session, "sync": sync, "t": now, "elapsed": now - start}


def _failure(out: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    report = getattr(exc, "report", None)
    out.update(
        ok=False,
        error=type(exc).__name__,
        message=str(exc),
        report=None
        if report is None
        else {"complete": report.complete, "loaded": list(report.loaded), "side": report.side},
    )
    return out


def _success(out: dict[str, Any], report: ss.SyncReport) -> dict[str, Any]:
    out.update(
        ok=True,
        error=None,
        report={
            "complete": report.complete,
            "loaded": list(report.loaded),
            "side": report.side,
            "receivers": report.receivers,
            "refused": list(report.refused),
            "absent": list(report.absent),
        },
    )
    return out


def _consistent(
    model: Model, before: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], loaded: Any
) -> bool:
    """The model holds the new value of every name reported loaded and the old value of
    every other name: no silent mismatch."""
    state = model.state_dict()
    return all(
        torch.equal(state[name], sent[name] if name in loaded else before[name]) for name in NAMES
    )


async def _go(control: Any) -> None:
    def wait() -> None:
        if not control.poll(CONNECT_S):
            raise TimeoutError("the test never said go")
        control.recv()

    await anyio.to_thread.run_sync(wait)


class Reporter:
    """Reports to the test over this peer's own pipe: a peer killed mid-write spoils only
    its own pipe (a queue shared by all peers would stay locked forever)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def put(self, item: dict[str, Any]) -> None:
        self._conn.send(item)


# -- receiver ----------------------------------------------------------------------------
async def _receive_one(
    rx: Receiver, model: Model, spec: dict[str, Any], results: Any, tag: str, where: tuple[int, int]
) -> dict[str, Any]:
    if spec.get("wait_go"):
        await _go(spec["_control"])
    sink = PeerSink(model, spec, results, tag)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    sent = weights(spec.get("seed", 0))
    start = time.monotonic()
    second: dict[str, Any] = {}

    async def again() -> None:
        # A second receive on the channel while the first one runs (it has a bucket).
        await sink.started.wait()
        t0 = time.monotonic()
        try:
            report = await ss.receive(rx, PeerSink(model, {}, results, tag), timeout=TIMEOUT)
        except ss.StreamsyncError as exc:
            second.update(_failure(_outcome(tag, *where, t0), exc))
        else:
            second.update(_success(_outcome(tag, *where, t0), report))

    async def first() -> dict[str, Any]:
        try:
            report = await ss.receive(rx, sink, timeout=TIMEOUT)
        except ss.StreamsyncError as exc:
            return _failure(_outcome(tag, *where, start), exc)
        return _success(_outcome(tag, *where, start), report)

    if spec.get("concurrent"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(again)
            out = await first()
    else:
        out = await first()
    loaded = (out["report"] or {}).get("loaded", [])
    out.update(
        applied=sink.applied,
        consistent=_consistent(model, before, sent, loaded),
        largest_allocation=_LARGEST[0],
    )
    if second:
        out["second"] = second
    return out


async def _receiver(tag: str, args: dict[str, Any], results: Any, control: Any) -> None:
    model = Model()
    for s, session in enumerate(args["sessions"]):
        start = time.monotonic()
        try:
            with built_with(session["url"], receiver=_speaking(args)):
                rx = open_receiver(session["url"], connect_timeout=CONNECT_S, **args["options"])
            await rx.__aenter__()
            receiver_state(rx).unpacker = Unpacker(allocate=_recording)
        except ss.StreamsyncError as exc:
            results.put({**_failure(_outcome(tag, s, 0, start), exc), "stage": "open"})
            continue
        try:
            results.put({"event": "joined", "tag": tag, "session": s})
            for j, spec in enumerate(session["syncs"]):
                spec = {**spec, "_control": control}
                results.put(await _receive_one(rx, model, spec, results, tag, (s, j)))
        finally:
            await rx.aclose()


# -- sender ------------------------------------------------------------------------------
async def _source(
    items: list[tuple[str, torch.Tensor]], spec: dict[str, Any], results: Any, tag: str
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    for index, item in enumerate(items):
        if index == spec.get("stall_at"):
            # Mid-bucket: the tensors before this one wait in an unfinished bucket.
            results.put({"event": "stalled", "tag": tag, "tensor": index})
            await anyio.sleep(3600)
        yield item


def _absurd(header: BucketHeader, kind: str) -> BucketHeader:
    """``header`` rewritten to claim something no receiver should allocate or accept."""
    first = header.entries[0]
    if kind == "length":
        return BucketHeader(header.sync_id, header.seq, header.slot, 1 << 62, header.layout)
    if kind == "shape":
        entry = Entry(first.name, first.dtype, (1 << 40, 1 << 40), first.offset, first.nbytes)
    elif kind == "dtype":
        entry = Entry(first.name, "complex256", first.shape, first.offset, first.nbytes)
    elif kind == "chunked":
        # Chunk 0 of a 1 GiB tensor in a million chunks: plausible, until the next bucket.
        entry = Entry("huge", "float32", (1 << 28,), 0, first.nbytes, 0, 1 << 20, 0)
    else:
        raise ValueError(f"unknown absurd kind {kind!r}")
    return BucketHeader(header.sync_id, header.seq, header.slot, header.nbytes, Layout.of([entry]))


@contextlib.contextmanager
def built_with(
    url: str, *, sender: dict[str, Any] | None = None, receiver: dict[str, Any] | None = None
) -> Iterator[None]:
    """Within it, ``url``'s transport builds its senders and receivers in this process with
    these keywords too (a ``codec``, a ``frames`` filter): the installed transport wrapped
    and registered under its own scheme, then put back."""
    scheme = parse_endpoint(url).scheme
    (ep,) = entry_points(group=ENTRY_POINT_GROUP, name=scheme)
    real = ep.load()
    register(
        scheme,
        dataclasses.replace(
            real,
            sender=lambda e, opts: real.sender(e, {**opts, **(sender or {})}),
            receiver=lambda e, opts: real.receiver(e, {**opts, **(receiver or {})}),
        ),
    )
    try:
        yield
    finally:
        register(scheme, real)


def _speaking(args: dict[str, Any]) -> dict[str, Any]:
    """The keywords of a peer that speaks the script's ``version`` of the wire protocol."""
    version = args.get("version")
    return {} if version is None else {"codec": WireCodec(None, version=version)}


class Tamper(FrameFilter):
    """Spoils bucket ``seq`` on the wire while ``spec = (kind, seq)``."""

    spec: tuple[str, int] | None = None

    def _kind(self, msg: Any) -> str | None:
        spec = self.spec
        if spec and isinstance(msg, BucketHeader) and msg.seq == spec[1]:
            return str(spec[0])
        return None

    def message(self, msg: Any, slot: torch.Tensor | None) -> Any:
        kind = self._kind(msg)
        if kind == "flip" and slot is not None:
            slot[10] ^= 0xFF  # after its checksum was computed
        elif kind is not None and kind.startswith("absurd-"):
            msg = _absurd(msg, kind.removeprefix("absurd-"))
        return msg

    def frame(
        self, msg: Any, frame: bytes, payload: torch.Tensor | None
    ) -> tuple[bytes, torch.Tensor | None]:
        kind = self._kind(msg)
        if kind == "truncate-frame":
            frame = frame[: len(frame) // 2]
        elif kind == "truncate-payload" and payload is not None:
            payload = payload[: payload.numel() // 2]
        return frame, payload


async def _send_one(
    tx: Sender, spec: dict[str, Any], results: Any, tag: str, where: tuple[int, int]
) -> dict[str, Any]:
    if spec.get("wait_go"):
        await _go(spec["_control"])
    seed = spec.get("seed", 0)
    items = (
        bad_weights(seed, spec["bad"], spec.get("at", 3))
        if spec.get("bad")
        else list(weights(seed).items())
    )
    start = time.monotonic()
    try:
        await tx.wait_ready(timeout=CONNECT_S)
    except ss.StreamsyncError as exc:
        return {**_failure(_outcome(tag, *where, start), exc), "stage": "ready"}

    async def sync() -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            report = await ss.send(
                _source(items, spec, results, tag),
                tx,
                bucket_bytes=BUCKET_BYTES,
                timeout=TIMEOUT,
                checksum=spec.get("checksum", False),
                sync_id=spec.get("sync_id"),
            )
        except ss.StreamsyncError as exc:
            return _failure(_outcome(tag, *where, t0), exc)
        return _success(_outcome(tag, *where, t0), report)

    if not spec.get("concurrent"):
        return await sync()
    # A second sync on the channel while the first one runs: once the first has sent a
    # bucket (the receiver is slow, so it is still running).
    second: dict[str, Any] = {}
    sent = tx.statistics()
    assert sent is not None, "the fault matrix needs a transport that counts its buckets"

    async def again() -> None:
        with anyio.fail_after(CONNECT_S):
            while tx.statistics().buckets == sent.buckets:  # type: ignore[union-attr]
                await anyio.sleep(0.005)
        second.update(await sync())

    async with anyio.create_task_group() as tg:
        tg.start_soon(again)
        out = await sync()
    return {**out, "second": second}


async def _sender(tag: str, args: dict[str, Any], results: Any, control: Any) -> None:
    for s, session in enumerate(args["sessions"]):
        tamper = Tamper()
        with built_with(session["url"], sender={"frames": tamper, **_speaking(args)}):
            tx = open_sender(
                session["url"], connect_timeout=CONNECT_S, slot_bytes=SLOT_BYTES, **args["options"]
            )
        await tx.__aenter__()
        try:
            results.put({"event": "bound", "tag": tag, "session": s})
            for j, spec in enumerate(session["syncs"]):
                tamper.spec = spec.get("tamper")
                spec = {**spec, "_control": control}
                results.put(await _send_one(tx, spec, results, tag, (s, j)))
        finally:
            await tx.aclose()


# -- entry point ---------------------------------------------------------------------------
def peer_main(tag: str, role: str, args: dict[str, Any], conn: Any, control: Any) -> None:
    """Run one peer's script, reporting on ``conn`` and told to go on by ``control`` (the
    ends of two pipes); an unexpected crash is reported, not swallowed."""
    results = Reporter(conn)
    run = _receiver if role == "receiver" else _sender
    try:
        asyncio.run(run(tag, args, results, control))
    except BaseException as exc:
        results.put({"crash": f"{type(exc).__name__}: {exc}", "tag": tag})
        raise
    results.put({"event": "exit", "tag": tag})


# -- soak ----------------------------------------------------------------------------------
def soak_receiver(url: str, syncs: int, options: dict[str, Any], conn: Any) -> None:
    """The receiving side of ``test_soak.py``: ``syncs`` syncs of the soak model into a
    vLLM-style model, one channel; reports how many completed."""

    async def run() -> int:
        model = FakeVllmModel(SOAK_CONFIG, dtype=torch.bfloat16)
        done = 0
        async with open_receiver(url, connect_timeout=CONNECT_S, **options) as rx:
            for _ in range(syncs):
                report = await ss.receive(rx, LoadWeightsSink(model), timeout=30)
                done += report.complete and not report.missing
        return done

    try:
        conn.send({"done": asyncio.run(run())})
        # Stay alive until the test has sampled this process for the last time: a process
        # that has exited has no memory figures in /proc to read.
        conn.poll(120)
    except BaseException as exc:
        conn.send({"crash": f"{type(exc).__name__}: {exc}"})
        raise


#: A Qwen3-shaped model of about 0.85 MiB in bfloat16 (embeddings larger than the soak's
#: 64 KiB buckets, so chunking is soaked too).
SOAK_CONFIG = FakeConfig(
    vocab_size=512,
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
)


# -- fan-out -------------------------------------------------------------------------------
class _Counting:
    """A sink that keeps nothing: counts buckets, says when it loads its first."""

    def __init__(self, conn: Any, tag: str) -> None:
        self.conn, self.tag, self.buckets = conn, tag, 0

    def prepare(self) -> None:
        self.buckets = 0

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.buckets == 0:
            self.conn.send({"event": "loading", "tag": self.tag})
        self.buckets += 1

    def finalize(self) -> None:
        pass


def fan_out_receiver(tag: str, url: str, syncs: int, conn: Any) -> None:
    """One of several receivers on ``url``: ``syncs`` syncs into a counting sink; reports
    each outcome (the exception's name and when it surfaced) on ``conn``."""

    async def run() -> None:
        async with open_receiver(url, connect_timeout=CONNECT_S) as rx:
            conn.send({"event": "joined", "tag": tag})
            for _ in range(syncs):
                sink = _Counting(conn, tag)
                try:
                    await ss.receive(rx, sink, timeout=TIMEOUT)
                    conn.send({"tag": tag, "ok": True, "t": time.monotonic()})
                except ss.StreamsyncError as exc:
                    out = _failure({"tag": tag, "t": time.monotonic()}, exc)
                    conn.send(out)
                    return

    try:
        asyncio.run(run())
    except BaseException as exc:
        conn.send({"crash": f"{type(exc).__name__}: {exc}", "tag": tag})
        raise
