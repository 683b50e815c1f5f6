"""``streamsync bench --receivers N``: one sender to N receiver processes.

For each N, each fan-out transport moves the synthetic dense model from a sender process to
N receiver processes (each copies every bucket into its own tensors and checks the last sync
bit-exact); the sender's seconds per sync are the figure. Next to them, in the same run, a
raw gloo broadcast of the same bytes in the same bucket sizes from one process to N others
(a private ``ProcessGroupGloo``, no streamsync): what ``torch+gloo`` is measured against.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

import streamsync as ss
from streamsync._copies import copy_tensors
from streamsync.cli.bench.models import GiB, human, synthetic_model
from streamsync.testing.peers import Peers, free_port

SCHEMA = "streamsync.cli.bench.fanout/1"
#: The transports a fan-out runs over (each names a fresh channel on a free port).
FANOUT_TRANSPORTS: dict[str, Callable[[], str]] = {
    "zmq+tcp": lambda: f"zmq+tcp://127.0.0.1:{free_port()}",
    "torch+gloo": lambda: f"torch+gloo://127.0.0.1:{free_port()}",
}


@dataclass(frozen=True)
class FanoutConfig:
    """What to measure: ``receivers`` counts, the model size, the ring."""

    receivers: tuple[int, ...] = (1, 2, 4)
    transports: tuple[str, ...] = tuple(FANOUT_TRANSPORTS)
    size: int = GiB
    runs: int = 3
    bucket_bytes: int = 64 << 20
    slots: int = 2
    timeout: float = 120.0


# -- children ---------------------------------------------------------------------------------
def child(role: str, job: dict[str, Any], results: Any) -> None:
    """Entry point of one process: run ``role`` and put a plain dict on ``results`` (at
    torch's default thread count, as a user's process runs)."""
    try:
        results.put({"role": role, "ok": True, **_ROLES[role](job)})
    except BaseException as exc:
        results.put({"role": role, "ok": False, "error": f"{type(exc).__name__}: {exc}"})


class _CopySink:
    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets

    def prepare(self) -> None:
        pass

    def load(self, tensors: Any) -> None:
        copy_tensors((self.targets[name], tensor) for name, tensor in tensors)

    def finalize(self) -> None:
        pass


def _receiver(job: dict[str, Any]) -> dict[str, Any]:
    model = synthetic_model(job["size"])
    targets = {n: torch.empty(s, dtype=d) for n, (s, d) in model.shapes.items()}

    async def run() -> None:
        async with ss.open_receiver(job["url"], connect_timeout=job["timeout"]) as rx:
            for _ in range(job["runs"] + 1):
                await ss.receive(rx, _CopySink(targets), timeout=job["timeout"])

    asyncio.run(run())
    expected = model.weights()
    return {"verified": all(torch.equal(targets[n], t) for n, t in expected.items())}


def _sender(job: dict[str, Any]) -> dict[str, Any]:
    weights = synthetic_model(job["size"]).weights()
    seconds: list[float] = []

    async def run() -> None:
        options = {"receivers": job["n"], "slots": job["slots"], "slot_bytes": job["bucket"]}
        async with ss.open_sender(job["url"], connect_timeout=job["timeout"], **options) as tx:
            await tx.wait_ready(timeout=job["timeout"])
            for _ in range(job["runs"] + 1):
                t0 = time.perf_counter()
                await ss.send(weights, tx, bucket_bytes=job["bucket"], timeout=job["timeout"])
                seconds.append(time.perf_counter() - t0)

    asyncio.run(run())
    return {"seconds": seconds[1:]}


def _gloo(job: dict[str, Any]) -> dict[str, Any]:
    """One rank of a raw gloo broadcast of ``nbytes`` in bucket-sized pieces."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    rank, world = job["rank"], job["n"] + 1
    timeout = timedelta(seconds=job["timeout"])
    store = TCPStore("127.0.0.1", job["port"], is_master=rank == 0, timeout=timeout)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group: Any = ProcessGroupGloo(PrefixStore("raw/", store), rank, world, options)
    buf = torch.ones(job["bucket"], dtype=torch.uint8)
    buf.zero_()
    broadcast = dist.BroadcastOptions()
    broadcast.rootRank, broadcast.rootTensor = 0, 0
    pieces = [
        min(job["bucket"], job["nbytes"] - at) for at in range(0, job["nbytes"], job["bucket"])
    ]
    seconds = []
    for _ in range(job["runs"] + 1):
        group.broadcast([buf[:1]], broadcast).wait()  # everyone is here
        t0 = time.perf_counter()
        for size in pieces:
            group.broadcast([buf[:size]], broadcast).wait()
        seconds.append(time.perf_counter() - t0)
    group.shutdown()
    return {"rank": rank, "seconds": seconds[1:]}


_ROLES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "sender": _sender,
    "receiver": _receiver,
    "gloo": _gloo,
}


def _run(jobs: list[tuple[str, dict[str, Any]]], timeout: float) -> list[dict[str, Any]]:
    peers = Peers(__name__)
    got: list[dict[str, Any]] = []
    try:
        for role, job in jobs:
            peers.spawn(child, role, job)
        deadline = time.monotonic() + timeout
        while len(got) < len(jobs):
            item = peers.collect(1, max(0.1, deadline - time.monotonic()))
            if not item:
                return [{"role": "?", "ok": False, "error": f"no result within {timeout:g} s"}]
            got += item
            if not item[0]["ok"]:
                return item
    finally:
        peers.close(grace=10 if len(got) == len(jobs) else 0.5)
    return got


# -- the run ----------------------------------------------------------------------------------
def run_fanout(
    config: FanoutConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every transport and the raw gloo broadcast at every receiver count; plain data."""
    note = progress or (lambda label: None)
    nbytes = synthetic_model(config.size).nbytes
    base = {
        "size": config.size,
        "runs": config.runs,
        "bucket": config.bucket_bytes,
        "slots": config.slots,
        "timeout": config.timeout,
        "nbytes": nbytes,
    }
    limit = config.timeout * (config.runs + 2)
    rows: list[dict[str, Any]] = []
    for n in config.receivers:
        note(f"raw gloo broadcast to {n}")
        port = free_port()
        ranks = _run(
            [("gloo", {**base, "n": n, "rank": r, "port": port}) for r in range(n + 1)], limit
        )
        root = next((g for g in ranks if g["ok"] and g.get("rank") == 0), None)
        raw_s = statistics.median(root["seconds"]) if root is not None else None
        for name in config.transports:
            note(f"{name} to {n}")
            job = {**base, "n": n, "url": FANOUT_TRANSPORTS[name]()}
            out = _run([("receiver", job)] * n + [("sender", job)], limit)
            sender = next((o for o in out if o.get("role") == "sender" and o["ok"]), None)
            failed = next((o for o in out if not o["ok"]), None)
            row: dict[str, Any] = {"receivers": n, "transport": name, "bytes": nbytes}
            if sender is None or failed is not None:
                rows.append({**row, "ok": False, "error": (failed or {}).get("error", "?")})
                continue
            seconds = statistics.median(sender["seconds"])
            rows.append(
                {
                    **row,
                    "ok": True,
                    "verified": all(o.get("verified", True) for o in out),
                    "sender_s_per_sync": seconds,
                    "sender_s_all": sender["seconds"],
                    "raw_gloo_s": raw_s,
                    "raw_gloo_over_this": raw_s / seconds if raw_s else None,
                }
            )
    return {
        "schema": SCHEMA,
        "config": {
            **base,
            "receivers": list(config.receivers),
            "transports": list(config.transports),
        },
        "rows": rows,
    }


def format_fanout(data: dict[str, Any]) -> str:
    """The fan-out table: sender seconds per sync, and raw gloo's over them (1.0: as fast)."""
    config = data["config"]
    lines = [
        f"fan-out: {human(config['nbytes'])} per sync, buckets of {human(config['bucket'])}, "
        f"{config['slots']} slots, median of {config['runs']} runs",
        f"{'N':>3}  {'transport':<11}{'sender s/sync':>14}{'raw gloo s':>12}{'raw/this':>10}  ok",
    ]
    for r in data["rows"]:
        if not r["ok"]:
            lines.append(f"{r['receivers']:>3}  {r['transport']:<11}  FAILED: {r['error']}")
            continue
        raw = f"{r['raw_gloo_s']:.3f}" if r["raw_gloo_s"] else "-"
        ratio = f"{r['raw_gloo_over_this']:.2f}" if r["raw_gloo_over_this"] else "-"
        lines.append(
            f"{r['receivers']:>3}  {r['transport']:<11}{r['sender_s_per_sync']:>14.3f}{raw:>12}"
            f"{ratio:>10}  {'yes' if r['verified'] else 'NOT VERIFIED'}"
        )
    return "\n".join(lines)
