"""GPU check of ``torch+nccl://``: one sender on GPU 0 and a receiver process on each other
GPU (one GPU per rank: NCCL refuses two ranks on one device). Checks a sync of bf16 tensors
bit-exact on every receiver, times the sender per sync, and times a raw NCCL broadcast of
the same bytes in the same bucket sizes, in the same processes; prints one JSON line. For a
machine with at least two GPUs:

    .venv/bin/python benchmarks/gpu_torch_nccl.py [--gib 1] [--repeat 3]
        [--bucket-mib 256]
        [--receivers N]   # default: every GPU but the sender's

Exits non-zero if anything is not bit-exact; prints ``skipped`` with fewer than two GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from streamsync.cli.bench.models import synthetic_model
from streamsync.testing.peers import free_port


def _fingerprint(weights: dict[str, torch.Tensor]) -> list[int]:
    return [int(t.view(torch.int16).to(torch.int64).sum().item()) for t in weights.values()]


class _CopySink:
    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets

    def prepare(self) -> None:
        pass

    def load(self, tensors: Any) -> None:
        for name, src in tensors:
            self.targets[name].copy_(src)

    def finalize(self) -> None:
        torch.cuda.current_stream().synchronize()


def _raw_broadcast(port: int, rank: int, world: int, total: int, bucket: int, repeat: int) -> float:
    """Best seconds of a raw NCCL broadcast of ``total`` bytes in ``bucket`` pieces."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore
    from torch.distributed import BroadcastOptions
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    store = TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=120))
    group: Any = ProcessGroupNCCL(
        PrefixStore("raw/", store), rank, world, ProcessGroupNCCL.Options()
    )
    buf = torch.ones(bucket, dtype=torch.uint8, device="cuda")
    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    best = float("inf")
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(max(1, total // bucket)):
            group.broadcast([buf], options).wait()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    group.shutdown()
    return best


def _receiver(rank: int, url: str, raw_port: int, world: int, args: Any, results: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import streamsync as ss

    total, bucket = args["total"], args["bucket"]
    shapes = synthetic_model(total).shapes
    targets = {n: torch.empty(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}

    async def run() -> None:
        async with ss.open_receiver(url, connect_timeout=120) as rx:
            for _ in range(args["repeat"] + 1):
                await ss.receive(rx, _CopySink(targets), timeout=120)

    asyncio.run(run())
    results.put(("fingerprint", rank, _fingerprint(targets)))
    _raw_broadcast(raw_port, rank, world, total, bucket, args["repeat"])


def _sender(url: str, raw_port: int, world: int, args: Any, results: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    import streamsync as ss

    total, bucket = args["total"], args["bucket"]
    weights = {n: t.cuda() for n, t in synthetic_model(total).weights().items()}
    results.put(("expected", 0, _fingerprint(weights)))
    seconds: list[float] = []

    async def run() -> None:
        options = {"receivers": world - 1, "slots": 3, "slot_bytes": bucket}
        async with ss.open_sender(url, connect_timeout=120, **options) as tx:
            for _ in range(args["repeat"] + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await ss.send(weights, tx, bucket_bytes=bucket, timeout=120)
                seconds.append(time.perf_counter() - t0)

    asyncio.run(run())
    results.put(("tx", 0, min(seconds[1:])))
    results.put(("raw", 0, _raw_broadcast(raw_port, 0, world, total, bucket, args["repeat"])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--receivers", type=int, default=0)
    opts = parser.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(json.dumps({"gpus": gpus, "skipped": "torch+nccl needs one GPU per rank (2+)"}))
        return
    receivers = opts.receivers or gpus - 1
    if receivers > gpus - 1:
        sys.exit(f"--receivers {receivers}: only {gpus - 1} GPUs besides the sender's")
    total = synthetic_model(int(opts.gib * (1 << 30))).nbytes
    args = {"total": total, "bucket": opts.bucket_mib << 20, "repeat": opts.repeat}
    world = receivers + 1
    url, raw_port = f"torch+nccl://127.0.0.1:{free_port()}", free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(url, raw_port, world, args, results))]
    procs += [
        ctx.Process(target=_receiver, args=(r, url, raw_port, world, args, results))
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    got: dict[str, Any] = {"fingerprint": {}}
    while "raw" not in got or len(got["fingerprint"]) < receivers:
        kind, rank, value = results.get(timeout=900)
        if kind == "fingerprint":
            got["fingerprint"][rank] = value
        else:
            got[kind] = value
    for p in procs:
        p.join(60)
    out = {
        "gpus": gpus,
        "device": torch.cuda.get_device_name(0),
        "receivers": receivers,
        "bytes": total,
        "bit_exact": all(f == got["expected"] for f in got["fingerprint"].values()),
        "sender_s_per_sync": round(got["tx"], 4),
        "raw_nccl_broadcast_s": round(got["raw"], 4),
    }
    out["vs_raw"] = round(out["raw_nccl_broadcast_s"] / out["sender_s_per_sync"], 3)
    print(json.dumps(out))
    if not out["bit_exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
