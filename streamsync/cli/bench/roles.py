"""What each child process of the bench runs: the sending and the receiving side of a
transport (or both, in one process, for ``memory://``), and the bounds' workers (a memcpy
copier, raw pyzmq PUSH and PULL).

A role takes the job (a plain dict) and the shared barrier, and returns a plain dict that
:func:`child` puts on the results queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import resource
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import torch

import streamsync as ss
from streamsync._copies import kernel_cast, large_copy
from streamsync.cli.bench.models import SyntheticModel, synthetic_model
from streamsync.cli.bench.scenarios import SCENARIOS, Scenario
from streamsync.cli.bench.stamped import StampedReceiver, StampedSender

Role = Callable[[dict[str, Any], Any], Coroutine[Any, Any, dict[str, Any]]]


def child(role: str, job: dict[str, Any], barrier: Any, results: Any) -> None:
    """Entry point of a child (a :class:`~streamsync.testing.peers.Peers` target): run
    ``role`` and put one plain dict on ``results``."""
    try:
        if job.get("threads"):
            torch.set_num_threads(int(job["threads"]))
        out = asyncio.run(ROLES[role](job, barrier))
        results.put({"role": role, "ok": True, **out})
    except BaseException as exc:
        results.put({"role": role, "ok": False, "error": f"{type(exc).__name__}: {exc}"})


# -- memory ---------------------------------------------------------------------------------
def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _rss_file() -> int:
    """Resident file-backed pages (``RssFile``): shared libraries' code, mapped into this
    process the first time it runs, already in the page cache and shared with every process
    that uses them. 0 where the kernel does not say."""
    with contextlib.suppress(OSError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


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


# -- the transport's two sides ----------------------------------------------------------------
def _syncs(job: dict[str, Any]) -> int:
    return int(job["runs"]) + 1  # the first one warms the channel up


async def _sender_side(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    scenario = SCENARIOS[job["scenario"]]
    model = scenario.model(job["size"])
    weights = model.weights(scenario.source_dtype)
    baseline, baseline_files = _rss(), _rss_file()
    runs: list[dict[str, Any]] = []
    opts = {"slots": job["slots"], "slot_bytes": job["bucket_bytes"]}
    async with ss.open_sender(job["url"], connect_timeout=job["timeout"], **opts) as opened:
        tx = StampedSender(opened)
        for _ in range(_syncs(job)):
            tx.published = []
            exact = _reset_peak()
            files = _rss_file()
            cpu = time.process_time()
            report = await ss.send(
                weights,
                tx,
                pipeline=scenario.adapters(model),
                bucket_bytes=job["bucket_bytes"],
                timeout=job["timeout"],
            )
            runs.append(
                {
                    **_report_dict(report),
                    "cpu_seconds": time.process_time() - cpu,
                    "published": tx.published,
                    "peak_rss": _peak_rss(),
                    "files_rss": files,
                    "peak_exact": exact,
                }
            )
    return {
        "baseline_rss": baseline,
        "baseline_files_rss": baseline_files,
        "ru_maxrss": _ru_maxrss(),
        "runs": runs,
    }


async def _receiver_side(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    scenario = SCENARIOS[job["scenario"]]
    model = scenario.model(job["size"])
    targets = model.zeros(expanded=scenario.expanded)
    sink = scenario.sink(model.module(targets), model)
    baseline, baseline_files = _rss(), _rss_file()
    runs: list[dict[str, Any]] = []
    async with ss.open_receiver(job["url"], connect_timeout=job["timeout"]) as opened:
        rx = StampedReceiver(opened)
        for _ in range(_syncs(job)):
            rx.arrived, rx.released = [], []
            exact = _reset_peak()
            files = _rss_file()
            cpu = time.process_time()
            report = await ss.receive(rx, sink, timeout=job["timeout"])
            cpu = time.process_time() - cpu
            runs.append(
                {
                    **_report_dict(report),
                    **_loaded(report, targets),
                    "cpu_seconds": cpu,
                    "arrived": rx.arrived,
                    "released": rx.released,
                    "peak_rss": _peak_rss(),
                    "files_rss": files,
                    "peak_exact": exact,
                }
            )
    ru_maxrss = _ru_maxrss()  # before the check below allocates
    return {
        "baseline_rss": baseline,
        "baseline_files_rss": baseline_files,
        "ru_maxrss": ru_maxrss,
        "runs": runs,
        **_checked(model, scenario, targets),
    }


async def _both_sides(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """``memory://``: sender and receiver in this one process."""
    scenario = SCENARIOS[job["scenario"]]
    model = scenario.model(job["size"])
    weights = model.weights(scenario.source_dtype)
    targets = model.zeros(expanded=scenario.expanded)
    sink = scenario.sink(model.module(targets), model)
    baseline, baseline_files = _rss(), _rss_file()
    tx_runs: list[dict[str, Any]] = []
    rx_runs: list[dict[str, Any]] = []
    opts = {"slots": job["slots"], "slot_bytes": job["bucket_bytes"]}
    async with (
        ss.open_sender(job["url"], connect_timeout=job["timeout"], **opts) as opened_tx,
        ss.open_receiver(job["url"]) as opened_rx,
    ):
        tx, rx = StampedSender(opened_tx), StampedReceiver(opened_rx)
        got: dict[str, ss.SyncReport] = {}

        async def receive() -> None:
            got["rx"] = await ss.receive(rx, sink, timeout=job["timeout"])

        for _ in range(_syncs(job)):
            tx.published, rx.arrived, rx.released = [], [], []
            exact = _reset_peak()
            files = _rss_file()
            cpu = time.process_time()

            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                sent = await ss.send(
                    weights,
                    tx,
                    pipeline=scenario.adapters(model),
                    bucket_bytes=job["bucket_bytes"],
                    timeout=job["timeout"],
                )
            peak = _peak_rss()
            cpu = time.process_time() - cpu  # one process: both sides together
            tx_runs.append(
                {
                    **_report_dict(sent),
                    "published": tx.published,
                    "peak_rss": peak,
                    "files_rss": files,
                    "cpu_seconds": cpu,
                }
            )
            rx_runs.append(
                {
                    **_report_dict(got["rx"]),
                    **_loaded(got["rx"], targets),
                    "cpu_seconds": cpu,
                    "arrived": rx.arrived,
                    "released": rx.released,
                    "peak_rss": peak,
                    "files_rss": files,
                    "peak_exact": exact,
                }
            )
    ru_maxrss = _ru_maxrss()
    side = {"baseline_rss": baseline, "baseline_files_rss": baseline_files, "ru_maxrss": ru_maxrss}
    return {
        "sender": {**side, "runs": tx_runs},
        "receiver": {**side, "runs": rx_runs, **_checked(model, scenario, targets)},
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


def _checked(
    model: SyntheticModel, scenario: Scenario, targets: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The receiver's model checked against what was sent, and its sizes."""
    return {
        "verified": _verify(model, scenario, targets),
        "model_bytes": sum(t.nbytes for t in targets.values()),
        "largest_tensor_bytes": model.largest_tensor_bytes(expanded=scenario.expanded),
    }


def _verify(model: SyntheticModel, scenario: Scenario, targets: dict[str, torch.Tensor]) -> bool:
    seen = 0
    for name, want in model.expected(scenario.source_dtype, expanded=scenario.expanded):
        got = targets.get(name)
        if got is None or not torch.equal(got, want):
            return False
        seen += 1
    return seen == len(targets)


# -- the bounds' workers ------------------------------------------------------------------------
async def _memcpy_side(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """Copies the model's tensors into preallocated ones; with a barrier, in step with the
    other copier."""
    src = synthetic_model(job["size"]).weights()
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    # The pair of copiers (the two_copy_parallel bound) each run one copy per tensor on one
    # thread, whatever the torch thread setting: the bound is what two copies at once cost,
    # not how OpenMP behaves. ``job["copy"]`` says which copy: glibc's ``memmove``, or the
    # library's own (``large_copy``, which streams past the cache); the bench keeps the
    # faster. The single copier uses torch's copy with this process's threads.
    copy = large_copy() if job.get("copy") == "stream" else ctypes.memmove
    moves = [(dst[n].data_ptr(), t.data_ptr(), t.nbytes) for n, t in src.items()]
    spans: list[tuple[float, float]] = []
    for _ in range(_syncs(job)):
        if barrier is not None:
            barrier.wait()
        t0 = time.monotonic()
        if barrier is not None:
            for to, frm, nbytes in moves:
                copy(to, frm, nbytes)
        else:
            for name, tensor in src.items():
                dst[name].copy_(tensor)
        spans.append((t0, time.monotonic()))
    return {"spans": spans}


async def _cast_split_side(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """Half of a fused-cast sync's work on this machine's CPU, in step with the other half:
    of every fp32 tensor, half its elements cast to bf16 (the library's kernel, into a
    scratch buffer as a sender casts into a slot) and those bf16 bytes copied on (the
    library's copy, as a receiver copies out of a slot), one thread. Two of these at once
    are the cast sync's work split evenly over two processes with nothing else to do: no
    hand-offs, no waits, no Python per bucket (the ``cast_split`` bound)."""
    src = synthetic_model(job["size"]).weights(torch.float32)
    half = {n: t.reshape(-1).tensor_split(2)[job["half"]] for n, t in src.items()}
    dst = {n: torch.empty(t.numel(), dtype=torch.bfloat16) for n, t in half.items()}
    scratch = torch.empty(job["bucket_bytes"] // 2, dtype=torch.bfloat16)
    copy = large_copy()
    pieces = [
        (h[i : i + scratch.numel()], dst[n][i : i + scratch.numel()])
        for n, h in half.items()
        for i in range(0, h.numel(), scratch.numel())
    ]
    spans: list[tuple[float, float]] = []
    for _ in range(_syncs(job)):
        barrier.wait()
        t0 = time.monotonic()
        for piece, out in pieces:
            staged = scratch[: piece.numel()]
            kernel_cast(staged, piece)
            copy(out.data_ptr(), staged.data_ptr(), out.nbytes)
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


ROLES: dict[str, Role] = {
    "sender": _sender_side,
    "receiver": _receiver_side,
    "both": _both_sides,
    "memcpy": _memcpy_side,
    "cast_split": _cast_split_side,
    "zmq_push": _zmq_push,
    "zmq_pull": _zmq_pull,
}
