"""The bench's run: measure the bounds, then each transport in each scenario in child
processes (:mod:`streamsync.cli.bench.roles`, started through the shared peer harness), and
summarise it all as plain data."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import streamsync as ss
from streamsync._copies import POOL_THREADS, openmp_runtime
from streamsync.cli.bench import roles
from streamsync.cli.bench.models import GiB, MiB, synthetic_model
from streamsync.cli.bench.scenarios import BOUNDS, SCENARIOS, TRANSPORTS, TransportSpec
from streamsync.cli.bench.stamped import transfer_seconds
from streamsync.testing.peers import Peers, free_port

#: The version of the data :func:`run_bench` returns (and ``--json`` writes).
SCHEMA = "streamsync.cli.bench/1"


@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    size: int = GiB
    transports: tuple[str, ...] = ()
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    runs: int = 3
    bucket_bytes: int = 64 * MiB
    #: Ring slots; ``None``: each transport's default, what users get.
    slots: int | None = None
    timeout: float = 120.0
    #: torch threads (``torch.set_num_threads``) in each process of a two-process path
    #: (sender and receiver); ``None``: torch's default, what users get.
    threads: int | None = None

    def selected(self) -> tuple[str, ...]:
        """The transports to run: those asked for, else every one that runs here."""
        return self.transports or tuple(
            name for name, spec in TRANSPORTS.items() if spec.unavailable() is None
        )

    def bounds(self) -> list[str]:
        """The bounds this run measures, each once, in order."""
        keys = ["memcpy", "two_copy_parallel"]
        for name in self.selected():
            spec = TRANSPORTS[name]
            keys += [spec.bound] + [SCENARIOS[s].bound(spec) for s in self.scenarios]
        return [k for k in dict.fromkeys(keys) if k != "two_copy_serial"]

    def steps(self) -> int:
        """How many units of work :func:`run_bench` reports progress in."""
        return len(self.bounds()) + len(self.selected()) * (1 + len(self.scenarios))


# -- child processes ------------------------------------------------------------------------
def _run_children(
    jobs: list[tuple[str, dict[str, Any]]], *, timeout: float, barrier: bool = False
) -> list[dict[str, Any]]:
    """Run one child per ``(role, job)`` at once; their results in the order of ``jobs``
    (the first failure in place of every result if one failed)."""
    peers = Peers(roles.__name__)
    shared = peers.ctx.Barrier(len(jobs)) if barrier else None
    got: list[dict[str, Any]] = []
    try:
        for role, job in jobs:
            peers.spawn(roles.child, role, job, shared)
        deadline = time.monotonic() + timeout
        while len(got) < len(jobs):
            next_one = peers.collect(1, max(0.1, deadline - time.monotonic()))
            if not next_one:
                error = f"no result within {timeout:g} s"
                return [{"role": r, "ok": False, "error": error} for r, _ in jobs]
            got += next_one
            if not next_one[0]["ok"]:
                break  # the other side would wait for it until its timeout
    finally:
        peers.close(grace=10 if len(got) == len(jobs) else 0.5)
    failed = [g for g in got if not g["ok"]]
    if failed:
        return [failed[0] for _ in jobs]
    by_role: dict[str, list[dict[str, Any]]] = {}
    for item in got:
        by_role.setdefault(item["role"], []).append(item)
    return [by_role[role].pop(0) for role, _ in jobs]


# -- bounds ---------------------------------------------------------------------------------
def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9 if seconds else 0.0


def _pair_seconds(jobs: list[tuple[str, dict[str, Any]]], limit: float) -> list[float]:
    """Two children in step (a barrier before each run): each timed run's wall time, from
    the first to start to the last to finish, without the warm-up; empty if one failed."""
    pair = _run_children(jobs, timeout=limit, barrier=True)
    if not all(p["ok"] for p in pair):
        return []
    spans = zip(pair[0]["spans"][1:], pair[1]["spans"][1:], strict=True)
    return [max(a[1], b[1]) - min(a[0], b[0]) for a, b in spans]


def _bound_seconds(config: BenchConfig, key: str) -> list[float]:
    """Timed runs of one bound (``memcpy``, ``two_copy_parallel``, ``raw_pyzmq_*``)."""
    job = {"size": config.size, "runs": config.runs}
    limit = config.timeout * (config.runs + 2)
    if key == "memcpy":
        (one,) = _run_children([("memcpy", job)], timeout=limit)
        return [t1 - t0 for t0, t1 in one["spans"][1:]] if one["ok"] else []
    if key == "cast_split":
        cjob = {**job, "bucket_bytes": config.bucket_bytes}
        return _pair_seconds([("cast_split", {**cjob, "half": h}) for h in (0, 1)], limit)
    if key.startswith("two_copy_parallel"):
        copy = "stream" if key.endswith(":stream") else "memmove"
        pjob = {**job, "threads": config.threads, "copy": copy}
        return _pair_seconds([("memcpy", pjob), ("memcpy", pjob)], limit)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    address = (
        f"ipc://@streamsync-bench-raw-{tag}"
        if key.endswith("ipc")
        else f"tcp://127.0.0.1:{free_port()}"
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
    if measured == "two_copy_parallel":
        # Two memcpys at once, with glibc's memmove and with the library's own copy, which
        # streams past the cache: the faster is the bound, so a faster copy in the library
        # raises the bound with the transport.
        for copy in ("memmove", "stream"):
            seconds = _bound_seconds(config, f"{measured}:{copy}")
            if seconds:
                gbps = _median_gbps(synthetic_model(config.size).nbytes, seconds)
                entry = bounds.setdefault(measured, {"what": BOUNDS[measured], "samples_gbps": []})
                entry["samples_gbps"].append(gbps)
                entry.setdefault("by_copy", {}).setdefault(copy, []).append(gbps)
                entry["gbps"] = max(entry["samples_gbps"])
        return
    seconds = _bound_seconds(config, measured)
    if not seconds:
        return
    gbps = _median_gbps(synthetic_model(config.size).nbytes, seconds)
    entry = bounds.setdefault(measured, {"what": BOUNDS[measured], "samples_gbps": []})
    entry["samples_gbps"].append(gbps)
    entry["gbps"] = max(entry["samples_gbps"])
    if measured == "memcpy":
        bounds["two_copy_serial"] = {
            "what": BOUNDS["two_copy_serial"],
            "gbps": entry["gbps"] / 2,
            "derived": "memcpy / 2",
        }


def _bounds(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in config.bounds():
        progress(f"bound: {key}")
        _add_bound(out, config, key)
    return out


# -- transports -----------------------------------------------------------------------------
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
        "slots": spec.slots(config.slots),
        "timeout": config.timeout,
    }
    limit = config.timeout * (config.runs + 2)
    if spec.in_process:
        (both,) = _run_children([("both", job)], timeout=limit)
        tx, rx = both, both
        if both["ok"]:
            tx, rx = {"ok": True, **both["sender"]}, {"ok": True, **both["receiver"]}
    else:
        job["threads"] = config.threads
        rx, tx = _run_children([("receiver", job), ("sender", job)], timeout=limit)
    row: dict[str, Any] = {
        "transport": transport,
        "scenario": scenario,
        "slots": job["slots"],
        "ok": tx["ok"],
    }
    if not tx["ok"]:
        return {**row, "error": tx["error"]}
    return {**row, **_summarise(config, spec, scenario, tx, rx, bounds)}


def _summarise(
    config: BenchConfig,
    spec: TransportSpec,
    scenario: str,
    tx: dict[str, Any],
    rx: dict[str, Any],
    bounds: dict[str, Any],
) -> dict[str, Any]:
    tx_runs, rx_runs = tx["runs"][1:], rx["runs"][1:]  # without the warm-up sync
    nbytes = tx_runs[0]["nbytes"]
    e2e = [r["seconds"] for r in tx_runs]
    transfer = [
        transfer_seconds(t["published"], r["arrived"], r["released"])
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
    bound_key = SCENARIOS[scenario].bound(spec)
    bound = bounds.get(bound_key, {}).get("gbps")
    ring = spec.slots(config.slots) * config.bucket_bytes
    budget = ring + rx["largest_tensor_bytes"]

    def memory(side: dict[str, Any]) -> dict[str, Any]:
        runs = side["runs"][1:]
        peak = max(r["peak_rss"] for r in runs)
        # What the side pays: its private pages and the ring's, at their peak. Shared
        # libraries' code pages mapped in since the baseline (the children are forked from
        # a server that imported torch, so these come on first use: 8-9 MiB here) are not
        # memory a sync allocates; each run's are taken off its peak as they were at its
        # start, so any mapped during a run still count.
        private = max(r["peak_rss"] - r["files_rss"] for r in runs)
        extra = private - (side["baseline_rss"] - side["baseline_files_rss"])
        return {
            "baseline_rss": side["baseline_rss"],
            "peak_rss": peak,
            "extra_bytes": extra,
            "extra_with_files_bytes": peak - side["baseline_rss"],
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
        "bound": bound_key,
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
        # CPU seconds each process spent per sync (all its threads): spinning OpenMP
        # workers show up here even when a quiet machine hides them in the GB/s.
        "cpu_s": {
            side: statistics.median(r.get("cpu_seconds", 0.0) for r in runs)
            for side, runs in (("sender", tx_runs), ("receiver", rx_runs))
        },
    }


# -- the run --------------------------------------------------------------------------------
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
        model = kind.model(config.size)
        models[name] = {
            "description": kind.description,
            "tensors": len(model.layout(expanded=kind.expanded)),
            "bytes": model.nbytes,
            "source_bytes": model.source_bytes(kind.source_dtype),
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
            "copy_pool": {"threads": POOL_THREADS, "openmp_pinned": openmp_runtime()},
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
    }
