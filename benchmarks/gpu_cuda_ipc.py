"""GPU check of ``cuda-ipc://``: builds a channel between two processes, checks a 1 GiB
sync of bf16 tensors bit-exact, times it, and prints one JSON line. For a machine with a GPU:

    .venv/bin/python benchmarks/gpu_cuda_ipc.py [--gib 1] [--repeat 3] [--bucket-mib 256]

Also runs the conformance suite's cross-process round trip on ``cuda-ipc://`` unless
``--no-conformance``. Exits non-zero if anything is not bit-exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from typing import Any

import torch

from streamsync.cli.bench.models import synthetic_model


def _fingerprint(weights: dict[str, torch.Tensor]) -> list[int]:
    return [int(t.view(torch.int16).to(torch.int64).sum().item()) for t in weights.values()]


class _CopySink:
    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.finished = 0.0

    def prepare(self) -> None:
        pass

    def load(self, tensors: Any) -> None:
        for name, src in tensors:
            self.targets[name].copy_(src)

    def finalize(self) -> None:
        torch.cuda.current_stream().synchronize()
        self.finished = time.monotonic()


def _receiver(url: str, total: int, repeat: int, results: Any) -> None:
    import streamsync as ss

    shapes = synthetic_model(total).shapes
    targets = {n: torch.empty(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}

    async def run() -> None:
        async with ss.open_receiver(url, connect_timeout=120) as rx:
            for _ in range(repeat + 1):
                sink = _CopySink(targets)
                await ss.receive(rx, sink, timeout=120)
                results.put(("rx", sink.finished))

    asyncio.run(run())
    results.put(("fingerprint", _fingerprint(targets)))


def _sender(url: str, total: int, repeat: int, bucket: int, results: Any) -> None:
    import streamsync as ss

    weights = {n: t.cuda() for n, t in synthetic_model(total).weights().items()}
    results.put(("expected", _fingerprint(weights)))

    async def run() -> None:
        async with ss.open_sender(url, connect_timeout=120, slots=3, slot_bytes=bucket) as tx:
            for _ in range(repeat + 1):
                torch.cuda.synchronize()
                t0 = time.monotonic()
                await ss.send(weights, tx, bucket_bytes=bucket, timeout=120)
                results.put(("tx", t0))

    asyncio.run(run())


def device_memcpy_gbps(total: int, repeat: int) -> float:
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--no-conformance", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "skipped": "no CUDA device"}))
        return
    total = int(args.gib * (1 << 30))
    total = synthetic_model(total).nbytes
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    url = f"cuda-ipc://gpucheck{os.getpid()}"
    procs = [
        ctx.Process(target=_receiver, args=(url, total, args.repeat, results)),
        ctx.Process(target=_sender, args=(url, total, args.repeat, args.bucket_mib << 20, results)),
    ]
    for p in procs:
        p.start()
    got: dict[str, list[Any]] = {"tx": [], "rx": []}
    expected = fingerprint = None
    while fingerprint is None:
        kind, value = results.get(timeout=600)
        if kind == "expected":
            expected = value
        elif kind == "fingerprint":
            fingerprint = value
        else:
            got[kind].append(value)
    for p in procs:
        p.join(60)
    seconds = [e - s for s, e in zip(got["tx"][1:], got["rx"][1:], strict=True)]
    out: dict[str, Any] = {
        "cuda": True,
        "device": torch.cuda.get_device_name(0),
        "bytes": total,
        "bit_exact": fingerprint == expected,
        "gbps": round(total / min(seconds) / 1e9, 3),
        "device_memcpy_gbps": round(device_memcpy_gbps(total, args.repeat), 3),
    }
    out["vs_memcpy"] = round(out["gbps"] / out["device_memcpy_gbps"], 3)
    if not args.no_conformance:
        from streamsync.testing.conformance import TransportConformance

        class CudaConformance(TransportConformance):
            def make_url(self, tag: str) -> str:
                return f"cuda-ipc://{tag}-{os.getpid()}-{time.monotonic_ns()}"

        suite = CudaConformance()
        passed, failed = [], []
        for name in sorted(n for n in dir(suite) if n.startswith("test_")):
            try:
                getattr(suite, name)()
                passed.append(name)
            except Exception as exc:
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
        out["conformance_passed"] = passed
        out["conformance_failed"] = failed
    print(json.dumps(out))
    if not out["bit_exact"] or out.get("conformance_failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
