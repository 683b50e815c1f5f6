"""``streamsync bench``: end-to-end throughput of every transport against the machine's bounds.

A synthetic model of ``--size`` bytes shaped like a Qwen3 layer stack (embeddings, q/k/v/o,
gate/up/down, norms; the MoE variant with packed experts and a router buffer) goes through
each selected transport in each scenario, a few times after a warm-up sync on the same
channel, and the median is reported:

==================  =====================================================================
``dense``           bf16 weights, no adapters
``dense-fp32-cast`` fp32 master weights, ``pipeline=cast(bf16)`` (fused into the packing
                    copy): the same bytes on the wire as ``dense``
``moe``             bf16 MoE weights with packed experts, no adapters
``moe-chain``       the same through ``expand_moe(when="always") | split_buffers(...) |
                    cast(bf16)``, into a receiver holding per-expert tensors
==================  =====================================================================

Process transports run sender and receiver in two processes (forkserver children); the
receiver copies into its own preallocated model through :class:`~streamsync.ModuleSink`
(behind a :class:`~streamsync.adapters.BufferSink` for the chain). ``memory://`` runs both
sides in one process. Measured in the same run: a plain memcpy of the same tensors, two such
memcpys in two processes at once (what the two copies of a two-process shared-memory path
can reach together), and raw pyzmq PUSH/PULL moving the same bytes in bucket-sized messages
(the bound of the zmq transports). Each bound is measured at the start and again right
before its transport runs; the best is kept (a bound measured while other work loads the
machine would flatter the ratios).

Per run: end-to-end seconds (the sender's report: first bucket to the last receiver's
report), the phases of both sides' :class:`~streamsync.SyncReport` (sender ``pack``: copies
into slots; receiver ``load``: unpacking and the sink's copies) and ``transfer``: for each
bucket, the time the receiver sat idle waiting for a bucket the sender had already handed to
the transport (cross-process ``time.monotonic`` stamps). Peak RSS of each side during each
sync (``VmHWM``, reset before the sync) over its baseline with its model allocated, before the
channel opened: the ring counts as extra.

:func:`run_bench` measures and returns plain data; the command prints a table and writes
``--json`` and ``--plot``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import torch

import streamsync as ss
from streamsync.adapter import AdapterLike
from streamsync.adapters.expand_moe import QwenStyleRule, expand_moe
from streamsync.adapters.split_buffers import BufferSink, split_buffers
from streamsync.sink import Sink
from streamsync.transports.base import Incoming, Receiver, Sender, SenderStatistics
from streamsync.wire import Abort, BucketHeader, Done, End, Failed

__all__ = [
    "SCENARIOS",
    "TRANSPORTS",
    "BenchConfig",
    "Scenario",
    "SyntheticModel",
    "TransportSpec",
    "add_parser",
    "parse_size",
    "run_bench",
    "synthetic_model",
]

SCHEMA = "streamsync.bench/1"
GiB = 1 << 30
MiB = 1 << 20
_WIRE = torch.bfloat16
# Length of the random block every tensor repeats: prime, so no power-of-two boundary
# (a bucket, a chunk) lines up with it and a misplaced block fails the check.
_BLOCK = 65521


# -- sizes ------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"16MiB"``, ``"1GiB"``, ``"512M"``, ``"1.5g"`` or plain bytes, as an int."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 16MiB, 1GiB, 4096")
    return int(float(match[1]) * _UNITS[match[2]])


def _human(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


# -- the synthetic model ----------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticModel:
    """Names, shapes and dtypes of a model as trained (bf16, router buffers fp32)."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    buffers: frozenset[str] = frozenset()
    moe: bool = False

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.shapes.values())

    def weights(self, dtype: torch.dtype = _WIRE, seed: int = 0) -> dict[str, torch.Tensor]:
        """Deterministic tensors; floating-point weights made in ``dtype`` (buffers stay
        in theirs)."""
        return {
            name: _filled(shape, d if name in self.buffers else dtype, _seed(name, seed))
            for name, (shape, d) in self.shapes.items()
        }

    def zeros(self, *, expanded: bool = False) -> dict[str, torch.Tensor]:
        """A receiver's model, every page touched (so loading it does not grow RSS)."""
        return {n: torch.zeros(s, dtype=d) for n, (s, d) in self._layout(expanded).items()}

    def largest_tensor_bytes(self, *, expanded: bool = False) -> int:
        return max(math.prod(s) * d.itemsize for s, d in self._layout(expanded).values())

    def expected(
        self, source: torch.dtype = _WIRE, *, expanded: bool = False, seed: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What a receiver should hold after a sync of ``weights(source)``, tensor by
        tensor (generated one at a time, so checking costs one tensor of memory)."""
        rule = QwenStyleRule()
        for name, (shape, d) in self.shapes.items():
            made = d if name in self.buffers else source
            tensor = _filled(shape, made, _seed(name, seed))
            tensor = tensor.to(d)
            parts = rule.expand(name, tensor) if expanded else None
            yield from parts if parts is not None else [(name, tensor)]

    def _layout(self, expanded: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if not expanded:
            return dict(self.shapes)
        rule = QwenStyleRule()
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, (shape, d) in self.shapes.items():
            parts = rule.expand(name, torch.empty(shape, dtype=d, device="meta"))
            for part, view in parts if parts is not None else [(name, None)]:
                out[part] = (shape, d) if view is None else (tuple(view.shape), d)
        return out


def _seed(name: str, seed: int) -> int:
    return zlib.crc32(name.encode()) ^ seed


def _filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values repeating with a prime period: random enough to catch misplaced bytes,
    cheap enough (copies doubling in length) that a GiB takes a fraction of a second."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    n = flat.numel()
    block = torch.randn(min(n, _BLOCK), generator=torch.Generator().manual_seed(seed))
    flat[: block.numel()].copy_(block)
    done = block.numel()
    while done < n:
        step = min(done, n - done)
        flat[done : done + step].copy_(flat[:step])
        done += step
    return out


def synthetic_model(nbytes: int, *, moe: bool = False) -> SyntheticModel:
    """A model of at most ``nbytes`` (bf16) shaped like Qwen3: Qwen3-1.7B's dense layers
    (hidden 2048, GQA 16/8 heads of 128, MLP 6144) or Qwen3-30B-A3B's MoE layers (32/4
    heads, 16 of its 128 experts of 768, a router with an fp32 ``e_score_correction_bias``
    buffer as DeepSeek-V3 has), layers until the size is reached, an embedding of about an
    eighth of it (larger than a bucket: it travels chunked). Smaller sizes scale every width
    down by a power of two so that at least four layers fit."""
    scale = 1
    while scale < 64:
        if _layer_bytes(2048 // scale, moe) * 4 <= nbytes * 7 // 8:
            break
        scale *= 2
    hidden = 2048 // scale
    vocab = max(64, nbytes // 8 // (2 * hidden) // 64 * 64)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((vocab, hidden), _WIRE)
    }
    buffers: set[str] = set()
    total = vocab * hidden * 2
    for layer in itertools.count():
        full = True
        for name, shape, d in _layer(hidden, moe):
            size = math.prod(shape) * d.itemsize
            if total + size > nbytes:
                full = False
                break
            key = f"model.layers.{layer}.{name}"
            shapes[key] = (shape, d)
            if name.endswith("e_score_correction_bias"):
                buffers.add(key)
            total += size
        if not full:
            break
    return SyntheticModel(shapes, frozenset(buffers), moe)


def _layer(hidden: int, moe: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    f = 2048 // hidden  # the scale: widths shrink with hidden
    q, kv, head = (4096 // f, 512 // f, 128) if moe else (2048 // f, 1024 // f, 128)
    attn: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        ("input_layernorm.weight", (hidden,), _WIRE),
        ("self_attn.q_proj.weight", (q, hidden), _WIRE),
        ("self_attn.k_proj.weight", (kv, hidden), _WIRE),
        ("self_attn.v_proj.weight", (kv, hidden), _WIRE),
        ("self_attn.q_norm.weight", (head,), _WIRE),
        ("self_attn.k_norm.weight", (head,), _WIRE),
        ("self_attn.o_proj.weight", (hidden, q), _WIRE),
        ("post_attention_layernorm.weight", (hidden,), _WIRE),
    ]
    if not moe:
        inter = 6144 // f
        return [
            *attn,
            ("mlp.gate_proj.weight", (inter, hidden), _WIRE),
            ("mlp.up_proj.weight", (inter, hidden), _WIRE),
            ("mlp.down_proj.weight", (hidden, inter), _WIRE),
        ]
    experts, inter = 16, 768 // f
    return [
        *attn,
        ("mlp.gate.weight", (experts, hidden), _WIRE),
        ("mlp.gate.e_score_correction_bias", (experts,), torch.float32),
        ("mlp.experts.gate_up_proj", (experts, 2 * inter, hidden), _WIRE),
        ("mlp.experts.down_proj", (experts, hidden, inter), _WIRE),
    ]


def _layer_bytes(hidden: int, moe: bool) -> int:
    return sum(math.prod(s) * d.itemsize for _, s, d in _layer(hidden, moe))


def _module(tensors: dict[str, torch.Tensor], buffers: frozenset[str]) -> torch.nn.Module:
    """An ``nn.Module`` whose state dict is ``tensors`` (``buffers`` registered as buffers)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        if name in buffers:
            mod.register_buffer(leaf, tensor)
        else:
            mod.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


# -- scenarios ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One way the weights go: which model, in which dtype, through which adapters, into
    which receiving layout."""

    name: str
    description: str
    moe: bool
    source_dtype: torch.dtype = _WIRE
    #: The adapter chain for ``send(..., pipeline=)``; None: no adapters.
    pipeline: Callable[[SyntheticModel], AdapterLike] | None = None
    #: The receiver holds per-expert tensors (what ``expand_moe`` makes).
    expanded: bool = False

    def sink(self, module: torch.nn.Module, model: SyntheticModel) -> Sink:
        """The receiver's sink: a strict ModuleSink, behind a BufferSink for a chain that
        declares buffers."""
        inner = ss.ModuleSink(module)
        return BufferSink(inner, [module]) if self.pipeline is not None and model.buffers else inner


def _cast_all() -> AdapterLike:
    from streamsync.adapters import cast

    return cast(_WIRE)


def _moe_chain(model: SyntheticModel) -> AdapterLike:
    from streamsync.adapters import cast

    keep = model.buffers  # router biases stay float32, as engines keep them
    return (
        expand_moe(when="always")
        | split_buffers(sorted(keep))
        | cast(_WIRE, only=lambda n: n not in keep)
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("dense", "bf16 weights, no adapters", moe=False),
        Scenario(
            "dense-fp32-cast",
            "fp32 weights, cast(bf16) fused into packing",
            moe=False,
            source_dtype=torch.float32,
            pipeline=lambda model: _cast_all(),
        ),
        Scenario("moe", "bf16 MoE, packed experts, no adapters", moe=True),
        Scenario(
            "moe-chain",
            "bf16 MoE through expand_moe | split_buffers | cast",
            moe=True,
            pipeline=_moe_chain,
            expanded=True,
        ),
    )
}


# -- transports ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TransportSpec:
    """A transport the bench runs: how to name a fresh channel, and its bound."""

    name: str
    url: Callable[[str], str]
    #: The key in ``bounds`` this transport is compared with.
    bound: str
    #: Both sides in one process (otherwise one process each).
    in_process: bool = False
    needs: str | None = None

    def unavailable(self) -> str | None:
        """Why this transport cannot run here, or ``None``."""
        import importlib.util

        if self.needs is not None and importlib.util.find_spec(self.needs) is None:
            return f"{self.name} needs {self.needs} (pip install 'streamsync[{self.needs}]')"
        if self.name == "shm" and not hasattr(os, "memfd_create"):
            return "shm needs Linux (memfd)"
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TRANSPORTS: dict[str, TransportSpec] = {
    t.name: t
    for t in (
        TransportSpec("memory", lambda tag: f"memory://bench-{tag}", "two_copy_serial", True),
        TransportSpec("shm", lambda tag: f"shm://bench-{tag}", "two_copy_parallel"),
        TransportSpec(
            "zmq+ipc",
            lambda tag: f"zmq+ipc://@streamsync-bench-{tag}",
            "raw_pyzmq_ipc",
            needs="zmq",
        ),
        TransportSpec(
            "zmq+tcp",
            lambda tag: f"zmq+tcp://127.0.0.1:{_free_port()}",
            "raw_pyzmq_tcp",
            needs="zmq",
        ),
    )
}

_BOUNDS = {
    "memcpy": "one memcpy of the model's tensors",
    "two_copy_serial": "two memcpys back to back in one process (memcpy / 2)",
    "two_copy_parallel": "two memcpys at once, in two processes",
    "raw_pyzmq_ipc": "raw pyzmq PUSH/PULL over ipc, bucket-sized messages",
    "raw_pyzmq_tcp": "raw pyzmq PUSH/PULL over tcp loopback, bucket-sized messages",
}


# -- timestamps and memory ------------------------------------------------------------------
class _StampedSender(Sender):
    """Passes everything to ``inner`` and notes when each bucket was handed over."""

    def __init__(self, inner: Sender) -> None:
        self.inner = inner
        self.receivers = inner.receivers
        self.slot_bytes = inner.slot_bytes
        self.published: list[float] = []

    async def wait_ready(self, *, timeout: float) -> None:
        await self.inner.wait_ready(timeout=timeout)

    def statistics(self) -> SenderStatistics | None:
        return self.inner.statistics()

    async def send(
        self, sync_id: int, seq: int, bucket: Any, *, timeout: float, checksum: bool = False
    ) -> None:
        await self.inner.send(sync_id, seq, bucket, timeout=timeout, checksum=checksum)
        self.published.append(time.monotonic())

    async def end(self, end: End, *, timeout: float) -> list[Done]:
        return await self.inner.end(end, timeout=timeout)

    async def abort(self, abort: Abort) -> None:
        await self.inner.abort(abort)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _StampedReceiver(Receiver):
    """Passes everything to ``inner`` and notes when each bucket arrived and was released."""

    def __init__(self, inner: Receiver) -> None:
        self.inner = inner
        self.arrived: list[float] = []
        self.released: list[float] = []

    @property
    def index(self) -> int:
        return int(getattr(self.inner, "index", 0))

    async def receive(self, *, timeout: float) -> Incoming:
        incoming = await self.inner.receive(timeout=timeout)
        if isinstance(incoming.message, BucketHeader):
            self.arrived.append(time.monotonic())
        return incoming

    async def release(self, header: BucketHeader) -> None:
        await self.inner.release(header)
        self.released.append(time.monotonic())

    async def reply(self, report: Done | Failed) -> None:
        await self.inner.reply(report)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _transfer_seconds(published: list[float], arrived: list[float], released: list[float]) -> float:
    """Seconds the receiver sat idle waiting for buckets the sender had already handed to
    the transport: per bucket, from when it was handed over or the receiver was done with
    the previous one (whichever is later) to when it arrived."""
    total = 0.0
    free = -math.inf
    for k, (sent, got) in enumerate(zip(published, arrived, strict=False)):
        total += max(0.0, got - max(sent, free))
        if k < len(released):
            free = released[k]
    return total


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _reset_peak() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs``); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def _peak_rss() -> int:
    """Peak RSS since the last reset (``VmHWM``), else since the process started."""
    with contextlib.suppress(OSError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return _ru_maxrss()


def _ru_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- child processes ------------------------------------------------------------------------
def _child(role: str, job: dict[str, Any], results: Any, barrier: Any = None) -> None:
    """Entry point of a child: run ``role`` and put one plain dict on ``results``."""
    try:
        if job.get("threads"):
            torch.set_num_threads(int(job["threads"]))
        out = asyncio.run(_ROLES[role](job, barrier))
        results.put({"role": role, "ok": True, **out})
    except BaseException as exc:
        results.put({"role": role, "ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _syncs(job: dict[str, Any]) -> int:
    return int(job["runs"]) + 1  # the first one warms the channel up


async def _sender_side(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    scenario = SCENARIOS[job["scenario"]]
    model = synthetic_model(job["size"], moe=scenario.moe)
    weights = model.weights(scenario.source_dtype)
    baseline = _rss()
    runs: list[dict[str, Any]] = []
    opts = {"slots": job["slots"], "slot_bytes": job["bucket_bytes"]}
    async with ss.open_sender(job["url"], connect_timeout=job["timeout"], **opts) as opened:
        tx = _StampedSender(opened)
        for _ in range(_syncs(job)):
            tx.published = []
            exact = _reset_peak()
            pipeline = scenario.pipeline(model) if scenario.pipeline is not None else None
            report = await ss.send(
                weights,
                tx,
                pipeline=pipeline,
                bucket_bytes=job["bucket_bytes"],
                timeout=job["timeout"],
            )
            runs.append(
                {
                    **_report_dict(report),
                    "published": tx.published,
                    "peak_rss": _peak_rss(),
                    "peak_exact": exact,
                }
            )
    return {"baseline_rss": baseline, "ru_maxrss": _ru_maxrss(), "runs": runs}


async def _receiver_side(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    scenario = SCENARIOS[job["scenario"]]
    model = synthetic_model(job["size"], moe=scenario.moe)
    targets = model.zeros(expanded=scenario.expanded)
    sink = scenario.sink(_module(targets, model.buffers), model)
    baseline = _rss()
    runs: list[dict[str, Any]] = []
    async with ss.open_receiver(job["url"], connect_timeout=job["timeout"]) as opened:
        rx = _StampedReceiver(opened)
        for _ in range(_syncs(job)):
            rx.arrived, rx.released = [], []
            exact = _reset_peak()
            report = await ss.receive(rx, sink, timeout=job["timeout"])
            runs.append(
                {
                    **_report_dict(report),
                    **_loaded(report, targets),
                    "arrived": rx.arrived,
                    "released": rx.released,
                    "peak_rss": _peak_rss(),
                    "peak_exact": exact,
                }
            )
    ru_maxrss = _ru_maxrss()  # before the check below allocates
    return {
        "baseline_rss": baseline,
        "ru_maxrss": ru_maxrss,
        "runs": runs,
        "verified": _verify(model, scenario, targets),
        "model_bytes": sum(t.nbytes for t in targets.values()),
        "largest_tensor_bytes": model.largest_tensor_bytes(expanded=scenario.expanded),
    }


async def _both_sides(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """``memory://``: sender and receiver in this one process."""
    scenario = SCENARIOS[job["scenario"]]
    model = synthetic_model(job["size"], moe=scenario.moe)
    weights = model.weights(scenario.source_dtype)
    targets = model.zeros(expanded=scenario.expanded)
    sink = scenario.sink(_module(targets, model.buffers), model)
    baseline = _rss()
    tx_runs: list[dict[str, Any]] = []
    rx_runs: list[dict[str, Any]] = []
    opts = {"slots": job["slots"], "slot_bytes": job["bucket_bytes"]}
    async with (
        ss.open_sender(job["url"], connect_timeout=job["timeout"], **opts) as opened_tx,
        ss.open_receiver(job["url"]) as opened_rx,
    ):
        tx, rx = _StampedSender(opened_tx), _StampedReceiver(opened_rx)
        got: dict[str, ss.SyncReport] = {}

        async def receive() -> None:
            got["rx"] = await ss.receive(rx, sink, timeout=job["timeout"])

        for _ in range(_syncs(job)):
            tx.published, rx.arrived, rx.released = [], [], []
            exact = _reset_peak()

            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                pipeline = scenario.pipeline(model) if scenario.pipeline is not None else None
                sent = await ss.send(
                    weights,
                    tx,
                    pipeline=pipeline,
                    bucket_bytes=job["bucket_bytes"],
                    timeout=job["timeout"],
                )
            peak = _peak_rss()
            tx_runs.append({**_report_dict(sent), "published": tx.published, "peak_rss": peak})
            rx_runs.append(
                {
                    **_report_dict(got["rx"]),
                    **_loaded(got["rx"], targets),
                    "arrived": rx.arrived,
                    "released": rx.released,
                    "peak_rss": peak,
                    "peak_exact": exact,
                }
            )
    ru_maxrss = _ru_maxrss()
    side = {"baseline_rss": baseline, "ru_maxrss": ru_maxrss}
    return {
        "sender": {**side, "runs": tx_runs},
        "receiver": {
            **side,
            "runs": rx_runs,
            "verified": _verify(model, scenario, targets),
            "model_bytes": sum(t.nbytes for t in targets.values()),
            "largest_tensor_bytes": model.largest_tensor_bytes(expanded=scenario.expanded),
        },
    }


def _report_dict(report: ss.SyncReport) -> dict[str, Any]:
    return {
        "seconds": report.seconds,
        "nbytes": report.nbytes,
        "buckets": report.buckets,
        "tensors": report.tensors,
        "phases": dict(report.phases),
    }


def _loaded(report: ss.SyncReport, targets: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "received_bytes": sum(targets[n].nbytes for n in report.loaded if n in targets),
        "missing": len(report.missing),
    }


def _verify(model: SyntheticModel, scenario: Scenario, targets: dict[str, torch.Tensor]) -> bool:
    seen = 0
    for name, want in model.expected(scenario.source_dtype, expanded=scenario.expanded):
        got = targets.get(name)
        if got is None or not torch.equal(got, want):
            return False
        seen += 1
    return seen == len(targets)


async def _memcpy_side(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """Copies the model's tensors into preallocated ones; with a barrier, in step with the
    other copier."""
    src = synthetic_model(job["size"]).weights()
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    spans: list[tuple[float, float]] = []
    for _ in range(_syncs(job)):
        if barrier is not None:
            barrier.wait()
        t0 = time.monotonic()
        for name, tensor in src.items():
            dst[name].copy_(tensor)
        spans.append((t0, time.monotonic()))
    return {"spans": spans}


async def _zmq_push(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.bind(job["address"])
    msg = job["bucket_bytes"]
    bufs = [torch.ones(msg, dtype=torch.uint8) for _ in range(2)]
    starts: list[float] = []
    try:
        for _ in range(_syncs(job)):
            barrier.wait()
            starts.append(time.monotonic())
            sent = i = 0
            while sent < job["nbytes"]:
                n = min(msg, job["nbytes"] - sent)
                sock.send(memoryview(bufs[i % 2][:n].numpy()), copy=False)  # type: ignore[call-overload, arg-type]
                sent += n
                i += 1
    finally:
        sock.close(linger=5000)
        ctx.term()
    return {"starts": starts}


async def _zmq_pull(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(job["address"])
    ends: list[float] = []
    try:
        for _ in range(_syncs(job)):
            barrier.wait()
            got = 0
            while got < job["nbytes"]:
                got += len(sock.recv(copy=False).buffer)
            ends.append(time.monotonic())
    finally:
        sock.close(linger=0)
        ctx.term()
    return {"ends": ends}


_ROLES: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "sender": _sender_side,
    "receiver": _receiver_side,
    "both": _both_sides,
    "memcpy": _memcpy_side,
    "zmq_push": _zmq_push,
    "zmq_pull": _zmq_pull,
}


def _context() -> Any:
    # A fresh interpreter per child either way; the forkserver imports torch and this
    # module once, so each child starts in a fraction of a second.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "streamsync", __name__])
    return ctx


def _run_children(
    roles: list[tuple[str, dict[str, Any]]], *, timeout: float, barrier: bool = False
) -> list[dict[str, Any]]:
    """Run one child per role at once; their results in the order of ``roles``."""
    ctx = _context()
    results = ctx.Queue()
    shared = ctx.Barrier(len(roles)) if barrier else None
    procs = [
        ctx.Process(target=_child, args=(role, job, results, shared), daemon=True)
        for role, job in roles
    ]
    for proc in procs:
        proc.start()
    got: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + timeout
        while len(got) < len(procs):
            try:
                got.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except Exception:  # queue.Empty
                return [
                    {"role": r, "ok": False, "error": f"no result within {timeout:g} s"}
                    for r, _ in roles
                ]
            if not got[-1]["ok"]:
                break  # the other side would wait for it until its timeout
    finally:
        for proc in procs:
            proc.join(10 if len(got) == len(procs) else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    failed = [g for g in got if not g["ok"]]
    if failed:
        return [failed[0] for _ in roles]
    by_role: dict[str, list[dict[str, Any]]] = {}
    for item in got:
        by_role.setdefault(item["role"], []).append(item)
    return [by_role[role].pop(0) for role, _ in roles]


# -- the run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    size: int = GiB
    transports: tuple[str, ...] = ()
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    runs: int = 3
    bucket_bytes: int = 64 * MiB
    slots: int = 2
    timeout: float = 120.0
    #: torch threads in each process of a two-process path (sender, receiver, the two
    #: parallel copiers): two processes share this machine's two cores.
    threads: int = 1

    def selected(self) -> tuple[str, ...]:
        """The transports to run: those asked for, else every one that runs here."""
        return self.transports or tuple(
            name for name, spec in TRANSPORTS.items() if spec.unavailable() is None
        )

    def steps(self) -> int:
        """How many units of work :func:`run_bench` reports progress in."""
        bounds = {"memcpy", "two_copy_parallel"} | {TRANSPORTS[t].bound for t in self.selected()}
        bounds.discard("two_copy_serial")
        return len(bounds) + len(self.selected()) * (1 + len(self.scenarios))


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9 if seconds else 0.0


def _bound_seconds(config: BenchConfig, key: str) -> list[float]:
    """Timed runs of one bound (``memcpy``, ``two_copy_parallel``, ``raw_pyzmq_*``)."""
    job = {"size": config.size, "runs": config.runs}
    limit = config.timeout * (config.runs + 2)
    if key == "memcpy":
        (one,) = _run_children([("memcpy", job)], timeout=limit)
        return [t1 - t0 for t0, t1 in one["spans"][1:]] if one["ok"] else []
    if key == "two_copy_parallel":
        pjob = {**job, "threads": config.threads}
        pair = _run_children([("memcpy", pjob), ("memcpy", pjob)], timeout=limit, barrier=True)
        if not all(p["ok"] for p in pair):
            return []
        spans = zip(pair[0]["spans"][1:], pair[1]["spans"][1:], strict=True)
        return [max(a[1], b[1]) - min(a[0], b[0]) for a, b in spans]
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    address = (
        f"ipc://@streamsync-bench-raw-{tag}"
        if key.endswith("ipc")
        else f"tcp://127.0.0.1:{_free_port()}"
    )
    nbytes = synthetic_model(config.size).nbytes
    zjob = {**job, "address": address, "nbytes": nbytes, "bucket_bytes": config.bucket_bytes}
    push, pull = _run_children(
        [("zmq_push", zjob), ("zmq_pull", zjob)], timeout=limit, barrier=True
    )
    if not push["ok"]:
        return []
    return [e - s for s, e in zip(push["starts"][1:], pull["ends"][1:], strict=True)]


def _add_bound(bounds: dict[str, Any], config: BenchConfig, key: str) -> None:
    """Measure ``key`` (again) and keep the best median: on a shared machine a bound taken
    while others load it would flatter every ratio."""
    measured = "memcpy" if key == "two_copy_serial" else key
    seconds = _bound_seconds(config, measured)
    if not seconds:
        return
    gbps = _median_gbps(synthetic_model(config.size).nbytes, seconds)
    entry = bounds.setdefault(measured, {"what": _BOUNDS[measured], "samples_gbps": []})
    entry["samples_gbps"].append(gbps)
    entry["gbps"] = max(entry["samples_gbps"])
    if measured == "memcpy":
        bounds["two_copy_serial"] = {
            "what": _BOUNDS["two_copy_serial"],
            "gbps": entry["gbps"] / 2,
            "derived": "memcpy / 2",
        }


def _bounds(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = ["memcpy", "two_copy_parallel"]
    keys += [TRANSPORTS[t].bound for t in config.selected()]
    for key in dict.fromkeys(k for k in keys if k != "two_copy_serial"):
        progress(f"bound: {key}")
        _add_bound(out, config, key)
    return out


def _measure(
    config: BenchConfig, transport: str, scenario: str, bounds: dict[str, Any]
) -> dict[str, Any]:
    spec = TRANSPORTS[transport]
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    job = {
        "url": spec.url(tag),
        "scenario": scenario,
        "size": config.size,
        "runs": config.runs,
        "bucket_bytes": config.bucket_bytes,
        "slots": config.slots,
        "timeout": config.timeout,
    }
    limit = config.timeout * (config.runs + 2)
    if not spec.in_process:
        job["threads"] = config.threads
    if spec.in_process:
        (both,) = _run_children([("both", job)], timeout=limit)
        tx, rx = both, both
        if both["ok"]:
            tx, rx = {"ok": True, **both["sender"]}, {"ok": True, **both["receiver"]}
    else:
        rx, tx = _run_children([("receiver", job), ("sender", job)], timeout=limit)
    row: dict[str, Any] = {"transport": transport, "scenario": scenario, "ok": tx["ok"]}
    if not tx["ok"]:
        return {**row, "error": tx["error"]}
    return {**row, **_summarise(config, spec, tx, rx, bounds)}


def _summarise(
    config: BenchConfig,
    spec: TransportSpec,
    tx: dict[str, Any],
    rx: dict[str, Any],
    bounds: dict[str, Any],
) -> dict[str, Any]:
    tx_runs, rx_runs = tx["runs"][1:], rx["runs"][1:]  # without the warm-up sync
    nbytes = tx_runs[0]["nbytes"]
    e2e = [r["seconds"] for r in tx_runs]
    transfer = [
        _transfer_seconds(t["published"], r["arrived"], r["released"])
        for t, r in zip(tx_runs, rx_runs, strict=True)
    ]

    def median_phase(runs: list[dict[str, Any]], phase: str) -> float:
        return float(statistics.median(r["phases"].get(phase, 0.0) for r in runs))

    phases_s = {
        **{f"sender.{p}": median_phase(tx_runs, p) for p in tx_runs[0]["phases"]},
        **{f"receiver.{p}": median_phase(rx_runs, p) for p in rx_runs[0]["phases"]},
        "transfer": statistics.median(transfer),
    }
    main = {
        "pack": phases_s.get("sender.pack", 0.0),
        "transfer": phases_s["transfer"],
        "load": phases_s["receiver.load"],
    }
    gbps = _median_gbps(nbytes, e2e)
    bound = bounds.get(spec.bound, {}).get("gbps")
    ring = config.slots * config.bucket_bytes
    budget = ring + rx["largest_tensor_bytes"]

    def memory(side: dict[str, Any]) -> dict[str, Any]:
        peak = max(r["peak_rss"] for r in side["runs"][1:])
        extra = peak - side["baseline_rss"]
        return {
            "baseline_rss": side["baseline_rss"],
            "peak_rss": peak,
            "extra_bytes": extra,
            "ru_maxrss": side["ru_maxrss"],
            "within_budget": extra <= budget,
        }

    return {
        "bytes": nbytes,
        "model_bytes": rx["model_bytes"],
        "received_bytes": min(r["received_bytes"] for r in rx_runs),
        "missing": max(r["missing"] for r in rx_runs),
        "tensors": rx_runs[0]["tensors"],
        "buckets": tx_runs[0]["buckets"],
        "runs": len(e2e),
        "seconds": statistics.median(e2e),
        "seconds_all": e2e,
        "gbps": gbps,
        "phases_s": phases_s,
        "phases_gbps": {k: (nbytes / v / 1e9 if v > 0 else None) for k, v in main.items()},
        "bound": spec.bound,
        "bound_gbps": bound,
        "vs_bound": gbps / bound if bound else None,
        "memory": {
            "ring_bytes": ring,
            "largest_tensor_bytes": rx["largest_tensor_bytes"],
            "budget_bytes": budget,
            "peak_exact": all(r.get("peak_exact", False) for r in rx_runs),
            "sender": memory(tx),
            "receiver": memory(rx),
        },
        "verified": bool(rx["verified"]),
    }


def _targets(results: list[dict[str, Any]], bounds: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, as ratios within this run."""
    ok = {(r["transport"], r["scenario"]): r for r in results if r["ok"]}
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, target: float, detail: str) -> None:
        if value is not None:
            met = value >= target
            out.append({"target": name, "value": value, "want": f">= {target}", "met": met})
            out[-1]["detail"] = detail

    shm = ok.get(("shm", "dense"))
    if shm is not None:
        add("shm vs two memcpys at once", shm["vs_bound"], 0.8, "dense bf16")
    tcp = ok.get(("zmq+tcp", "dense"))
    if tcp is not None:
        add("zmq+tcp vs raw pyzmq tcp", tcp["vs_bound"], 0.85, "dense bf16")
    for transport in dict.fromkeys(t for t, _ in ok):
        pairs = (
            ("fp32 cast vs bf16", "dense-fp32-cast", "dense"),
            ("adapter chain vs none", "moe-chain", "moe"),
        )
        for name, with_, without in pairs:
            a, b = ok.get((transport, with_)), ok.get((transport, without))
            if a is not None and b is not None:
                add(f"{transport}: {name}", a["gbps"] / b["gbps"], 0.9, f"{with_} / {without}")
    within = [
        r["memory"][side]["extra_bytes"] / r["memory"]["budget_bytes"]
        for r in ok.values()
        for side in ("sender", "receiver")
    ]
    if within:
        out.append(
            {
                "target": "peak extra memory vs ring + largest tensor",
                "value": max(within),
                "want": "<= 1.0",
                "met": max(within) <= 1.0,
                "detail": "worst side, every transport and scenario",
            }
        )
    return out


def run_bench(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the bounds, then every selected transport in every selected scenario;
    returns everything as plain data (what ``--json`` writes). ``progress`` is called with
    a label at the start of each step (:meth:`BenchConfig.steps` of them)."""
    note = progress or (lambda label: None)
    started = time.time()
    bounds = _bounds(config, note)
    results: list[dict[str, Any]] = []
    for transport in config.selected():
        # Each transport's bound once more, next to it in time.
        note(f"bound: {TRANSPORTS[transport].bound}, again")
        _add_bound(bounds, config, TRANSPORTS[transport].bound)
        for scenario in config.scenarios:
            note(f"{transport} {scenario}")
            results.append(_measure(config, transport, scenario, bounds))
    models = {}
    for name in config.scenarios:
        kind = SCENARIOS[name]
        model = synthetic_model(config.size, moe=kind.moe)
        models[name] = {
            "description": kind.description,
            "tensors": len(model._layout(kind.expanded)),
            "bytes": model.nbytes,
            "source_bytes": sum(
                math.prod(s) * (d if n in model.buffers else kind.source_dtype).itemsize
                for n, (s, d) in model.shapes.items()
            ),
            "largest_tensor_bytes": model.largest_tensor_bytes(expanded=kind.expanded),
        }
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(
            timespec="seconds"
        ),
        "seconds": time.time() - started,
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "streamsync": ss.__version__,
            "platform": platform.platform(),
        },
        "config": {
            "size": config.size,
            "transports": list(config.selected()),
            "scenarios": list(config.scenarios),
            "runs": config.runs,
            "bucket_bytes": config.bucket_bytes,
            "slots": config.slots,
            "threads": config.threads,
            "timeout": config.timeout,
        },
        "models": models,
        "bounds": bounds,
        "results": results,
        "targets": _targets(results, bounds),
    }


# -- output ---------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(data: dict[str, Any]) -> str:
    """The results as a Markdown table, bounds and targets below it."""
    cfg = data["config"]
    lines = [
        f"{_human(cfg['size'])} requested, buckets of {_human(cfg['bucket_bytes'])} x "
        f"{cfg['slots']} slots, {cfg.get('threads', 1)} torch thread(s) per process on "
        f"two-process paths, median of {cfg['runs']} runs after a warm-up; "
        f"{data['machine']['cpus']} CPUs, torch {data['machine']['torch']}",
        "",
        "| transport | scenario | GB/s | pack | transfer | load | bound | x bound "
        "| extra RSS tx / rx (budget) | ok |",
        "|---|---|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r in data["results"]:
        if not r["ok"]:
            lines.append(f"| {r['transport']} | {r['scenario']} | FAILED: {r['error']} |")
            continue
        ph, mem = r["phases_gbps"], r["memory"]
        lines.append(
            f"| {r['transport']} | {r['scenario']} | {r['gbps']:.2f} | {_fmt(ph['pack'])} "
            f"| {_fmt(ph['transfer'])} | {_fmt(ph['load'])} | {r['bound']} "
            f"{_fmt(r['bound_gbps'])} | {_fmt(r['vs_bound'])} "
            f"| {mem['sender']['extra_bytes'] / MiB:.0f} / "
            f"{mem['receiver']['extra_bytes'] / MiB:.0f} MiB "
            f"({mem['budget_bytes'] / MiB:.0f}) "
            f"| {'yes' if r['verified'] and r['received_bytes'] == r['model_bytes'] else 'NO'} |"
        )
    lines += ["", "| bound | GB/s | what |", "|---|---:|---|"]
    for name, b in data["bounds"].items():
        lines.append(f"| {name} | {b['gbps']:.2f} | {b['what']} |")
    lines += ["", "| target | value | want | met |", "|---|---:|---:|---|"]
    for t in data["targets"]:
        lines.append(
            f"| {t['target']} ({t['detail']}) | {t['value']:.2f} | {t['want']} "
            f"| {'yes' if t['met'] else 'NO'} |"
        )
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str) -> None:
    """End-to-end GB/s per transport and scenario, against each transport's bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if r["ok"]]
    transports = list(dict.fromkeys(r["transport"] for r in rows))
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    width = 0.8 / max(1, len(scenarios))
    for j, scenario in enumerate(scenarios):
        xs, ys = [], []
        for i, transport in enumerate(transports):
            for r in rows:
                if (r["transport"], r["scenario"]) == (transport, scenario):
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r["gbps"])
        ax.bar(xs, ys, width * 0.95, label=scenario)
    for i, transport in enumerate(transports):
        spec = TRANSPORTS[transport]
        bound = data["bounds"].get(spec.bound)
        if bound is not None:
            ax.hlines(bound["gbps"], i - 0.45, i + 0.45, colors="black", linestyles="dashed")
            ax.annotate(
                f"{spec.bound} {bound['gbps']:.2f}",
                (i, bound["gbps"]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=8,
            )
    memcpy = data["bounds"].get("memcpy")
    if memcpy is not None:
        ax.axhline(memcpy["gbps"], color="grey", linestyle="dotted", label="memcpy")
    ax.set_xticks(range(len(transports)), transports)
    ax.set_ylabel("GB/s end to end (median)")
    cfg, machine = data["config"], data["machine"]
    ax.set_title(
        f"streamsync bench: {_human(cfg['size'])}, {machine['cpus']} CPUs, "
        f"{data['date'][:10]} (dashed: each transport's bound)"
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------------
def add_parser(subparsers: Any) -> None:
    """Register ``streamsync bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="measure every transport against memcpy and raw pyzmq",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--size", type=parse_size, default=GiB, help="model size (1GiB)")
    parser.add_argument(
        "--transport",
        action="append",
        choices=list(TRANSPORTS),
        help="repeatable; default: every one that runs here",
    )
    parser.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), help="repeatable; default: all"
    )
    parser.add_argument("--runs", type=int, default=3, help="timed syncs after a warm-up (3)")
    parser.add_argument("--bucket-bytes", type=parse_size, default=64 * MiB, help="(64MiB)")
    parser.add_argument("--slots", type=int, default=2, help="ring slots (2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process on two-process paths and their bound (1)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per wait")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    parser.add_argument("--plot", metavar="PATH.png", help="draw GB/s against the bounds")
    parser.set_defaults(run=_command)


def _command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    for name in args.transport or ():
        reason = TRANSPORTS[name].unavailable()
        if reason is not None:
            sys.stderr.write(f"streamsync bench: {reason}\n")
            return 2
    if args.runs < 1:
        sys.stderr.write("streamsync bench: --runs must be at least 1\n")
        return 2
    config = BenchConfig(
        size=args.size,
        transports=tuple(dict.fromkeys(args.transport or ())),
        scenarios=tuple(dict.fromkeys(args.scenario or SCENARIOS)),
        runs=args.runs,
        bucket_bytes=args.bucket_bytes,
        slots=args.slots,
        threads=args.threads,
        timeout=args.timeout,
    )
    with tqdm(total=config.steps(), file=sys.stderr, disable=None, unit="step") as bar:
        last: list[str] = []

        def progress(label: str) -> None:
            if last:
                bar.update()
            last[:] = [label]
            bar.set_description(label)

        data = run_bench(config, progress)
        bar.update()
    data["command"] = _command_line(args)
    sys.stdout.write(format_table(data) + "\n")  # the command's output
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=2)
    if args.plot:
        plot(data, args.plot)
    ok = all(
        r["ok"] and r["verified"] and r["received_bytes"] == r["model_bytes"]
        for r in data["results"]
    )
    return 0 if ok else 1


def _command_line(args: argparse.Namespace) -> str:
    parts = ["streamsync bench", f"--size {_human(args.size).replace(' ', '')}"]
    parts += [f"--transport {t}" for t in args.transport or ()]
    parts += [f"--scenario {s}" for s in args.scenario or ()]
    parts += [f"--runs {args.runs}", f"--bucket-bytes {args.bucket_bytes}", f"--slots {args.slots}"]
    parts += [f"--json {args.json}"] if args.json else []
    parts += [f"--plot {args.plot}"] if args.plot else []
    return " ".join(parts)
