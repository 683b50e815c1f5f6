"""shm against verl's shared-memory weight transfer, re-implemented here as a baseline.

Run from the repository root (figures go in ``BENCHMARKS.md`` with the command)::

    .venv/bin/python benchmarks/baseline_verl.py [--size 1GiB] [--runs 3] [--json PATH]

It runs ``streamsync bench``'s ``shm`` / ``dense`` cell, then verl's path on the same model
at each bucket size that fits (its best kept), and prints the bench's table with verl's
path among the bounds and the project's targets below it (:mod:`targets`).

verl's ``BucketedWeightSender`` / ``BucketedWeightReceiver`` (``use_shm=True``; verl's
``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``) move weights through one
``multiprocessing.shared_memory`` buffer of a bucket's size and a ZMQ REQ/REP pair over ipc:
the sender copies tensors into the buffer with ``Tensor.copy_`` until the next one does not
fit, sends the bucket's metadata (a pickled dict) and waits for the receiver's empty reply;
the receiver views the buffer, hands the views on (here: copies them into preallocated
tensors, as :class:`~streamsync.ModuleSink` does) and replies. One buffer, so packing and
loading never overlap; tensors larger than the buffer are refused with shared memory.

Both roles run with the process's torch settings, as streamsync's do. verl pickles the
metadata (``send_pyobj``); streamsync never unpickles, so it goes as msgpack here, which is no
slower: if anything the baseline is flattered.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import msgspec
import torch
from targets import evaluate_targets, format_targets

from streamsync.cli.bench.harness import BenchConfig, run_bench
from streamsync.cli.bench.models import GiB, MiB, parse_size, synthetic_model
from streamsync.cli.bench.report import format_table
from streamsync.testing.peers import Peers

__all__ = ["VERL_BUCKETS", "add_verl", "verl_baseline", "verl_receiver", "verl_sender"]

#: What the bench's bounds table says of verl's path.
WHAT = "verl's shared-memory path (one buffer, ZMQ REQ/REP), dense bf16, best bucket"

#: Bucket sizes the verl baseline is tried at (those below the largest tensor are left out:
#: verl's shared-memory path refuses a tensor larger than its buffer); its best is kept.
VERL_BUCKETS = (64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB)


def _syncs(job: dict[str, Any]) -> int:
    return int(job["runs"]) + 1


def verl_sender(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """The trainer side: one sync per run, timed from the barrier to the last reply."""
    import zmq

    weights = synthetic_model(job["size"]).weights()
    size = int(job["bucket_bytes"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.bind(job["address"])
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        assert shm.buf is not None
        buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
        sock.send(msgspec.msgpack.encode({"name": shm.name, "size": size}))
        sock.recv()
        spans: list[tuple[float, float]] = []
        for _ in range(_syncs(job)):
            barrier.wait()
            t0 = time.monotonic()
            offset = 0
            meta: dict[str, Any] = {}
            for name, weight in weights.items():
                if offset + weight.nbytes > size and meta:
                    sock.send(msgspec.msgpack.encode({"bucket_meta": meta, "is_last": False}))
                    sock.recv()
                    meta, offset = {}, 0
                if weight.nbytes > size:
                    raise ValueError(f"{name} ({weight.nbytes} bytes) exceeds the buffer")
                meta[name] = {
                    "shape": list(weight.shape),
                    "dtype": str(weight.dtype).removeprefix("torch."),
                    "offset": offset,
                }
                region = buffer[offset : offset + weight.nbytes]
                region.view(weight.dtype).view(weight.shape).copy_(weight)
                offset += weight.nbytes
            sock.send(msgspec.msgpack.encode({"bucket_meta": meta, "is_last": True}))
            sock.recv()
            spans.append((t0, time.monotonic()))
        del buffer, region  # views of the shared memory: it cannot close while they live
    finally:
        sock.close(linger=0)
        ctx.term()
        shm.close()
        shm.unlink()
    return {"spans": spans}


def verl_receiver(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """The engine side: copies every tensor of every bucket into the model's tensors."""
    import zmq

    model = synthetic_model(job["size"])
    targets = model.zeros()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.connect(job["address"])
    shm: shared_memory.SharedMemory | None = None
    try:
        info = msgspec.msgpack.decode(sock.recv())
        shm = shared_memory.SharedMemory(name=info["name"])
        assert shm.buf is not None
        buffer = torch.frombuffer(shm.buf[: info["size"]], dtype=torch.uint8)
        sock.send(b"")
        for _ in range(_syncs(job)):
            barrier.wait()
            while True:
                msg = msgspec.msgpack.decode(sock.recv())
                for name, meta in msg["bucket_meta"].items():
                    dtype, shape = getattr(torch, meta["dtype"]), torch.Size(meta["shape"])
                    offset = meta["offset"]
                    nbytes = dtype.itemsize * shape.numel()
                    view = buffer[offset : offset + nbytes].view(dtype).view(shape)
                    targets[name].copy_(view)
                sock.send(b"")
                if msg["is_last"]:
                    break
        expected = model.weights()
        verified = all(torch.equal(targets[n], t) for n, t in expected.items())
        del buffer, view  # views of the shared memory: it cannot close while they live
    finally:
        sock.close(linger=0)
        ctx.term()
        if shm is not None:
            shm.close()
    return {"verified": verified}


ROLES: dict[str, Callable[[dict[str, Any], Any], dict[str, Any]]] = {
    "sender": verl_sender,
    "receiver": verl_receiver,
}


def child(role: str, job: dict[str, Any], barrier: Any, results: Any) -> None:
    """A child process: run ``role`` and put one plain dict on ``results``."""
    try:
        if job.get("threads"):
            torch.set_num_threads(int(job["threads"]))
        results.put({"role": role, "ok": True, **ROLES[role](job, barrier)})
    except BaseException as exc:
        results.put({"role": role, "ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _run_pair(job: dict[str, Any], timeout: float) -> dict[str, dict[str, Any]]:
    """verl's receiver and sender in two processes (spawned: this file need not be
    importable by the bench's forkserver), in step; each one's result by role."""
    peers = Peers(start_method="spawn")
    barrier = peers.ctx.Barrier(2)
    got: list[dict[str, Any]] = []
    try:
        for role in ("receiver", "sender"):
            peers.spawn(child, role, job, barrier)
        deadline = time.monotonic() + timeout
        while len(got) < 2:
            next_one = peers.collect(1, max(0.1, deadline - time.monotonic()))
            if not next_one or not next_one[0]["ok"]:
                break  # the other side would wait for it until its timeout
            got += next_one
    finally:
        peers.close(grace=10 if len(got) == 2 else 0.5)
    return {g["role"]: g for g in got}


def verl_baseline(config: BenchConfig) -> dict[str, Any] | None:
    """verl's shared-memory path at each bucket size that fits, dense bf16: its best
    median GB/s as a bound of the bench's data, or None if no run succeeded."""
    model = synthetic_model(config.size)
    largest = model.largest_tensor_bytes()
    fits = [s for s in VERL_BUCKETS if s >= largest] or [largest]
    # A buffer larger than the whole model changes nothing: try one such size at most.
    sizes = [s for s in fits if s < model.nbytes] + [s for s in fits if s >= model.nbytes][:1]
    per_size: dict[int, float] = {}
    for size in sizes:
        job = {
            "size": config.size,
            "runs": config.runs,
            "bucket_bytes": size,
            "address": f"ipc://@streamsync-bench-verl-{os.getpid()}-{time.monotonic_ns()}",
            "threads": config.threads,
        }
        got = _run_pair(job, config.timeout * (config.runs + 2))
        if len(got) == 2 and got["receiver"]["verified"]:
            seconds = [t1 - t0 for t0, t1 in got["sender"]["spans"][1:]]
            per_size[size] = model.nbytes / statistics.median(seconds) / 1e9
    if not per_size:
        return None
    best = max(per_size, key=lambda s: per_size[s])
    return {
        "what": WHAT,
        "gbps": per_size[best],
        "bucket_bytes": best,
        "per_bucket_gbps": {str(k): v for k, v in per_size.items()},
    }


def add_verl(data: dict[str, Any], verl: dict[str, Any]) -> None:
    """Put verl's path among ``data``'s bounds, and each shm row's ratio to it."""
    data["bounds"]["verl_shm"] = verl
    for row in data["results"]:
        if row["transport"] == "shm" and row["ok"]:
            row["vs_verl"] = row["gbps"] / verl["gbps"]


def main() -> None:
    """The command line: shm's dense cell and verl's path, one table, the targets."""
    parser = argparse.ArgumentParser(description="shm against verl's shared-memory path")
    parser.add_argument("--size", type=parse_size, default=GiB, help="model size (1GiB)")
    parser.add_argument("--runs", type=int, default=3, help="timed syncs (default 3)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per peer")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    args = parser.parse_args()
    config = BenchConfig(
        size=args.size,
        transports=("shm",),
        scenarios=("dense",),
        runs=args.runs,
        timeout=args.timeout,
    )
    data = run_bench(config, lambda label: print(label, file=sys.stderr))
    print("baseline: verl_shm", file=sys.stderr)
    verl = verl_baseline(config)
    if verl is None:
        sys.exit("verl's path failed or moved the model wrong at every bucket size")
    add_verl(data, verl)
    data["targets"] = evaluate_targets(data["results"])
    print(format_table(data))
    print()
    print(format_targets(data["targets"], data["bounds"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=2)


if __name__ == "__main__":
    main()
