"""End-to-end throughput of each transport on 1 GiB of mixed-size bf16 tensors.

Sender and receiver are separate processes; the receiver copies every tensor into its own
preallocated tensors (what ``ModuleSink`` does). End to end is measured from the sender's
first byte to the receiver's last copy (``time.monotonic`` is system-wide on Linux), after
one warm-up sync on the same persistent channel. Measured in the same run: a plain memcpy of
the same bytes, the two-copy bound (copy into a slot-sized buffer, copy out, back to back),
and raw pyzmq PUSH/PULL moving the same bytes over the same kind of socket.

    .venv/bin/python benchmarks/transports.py                 # every transport, 1 GiB
    .venv/bin/python benchmarks/transports.py --transports shm --gib 0.25 --repeat 2

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch

GiB = 1 << 30


def qwen3_like(total_bytes: int) -> dict[str, torch.Tensor]:
    """bf16 tensors with Qwen3-1.7B-like shapes (hidden 2048, MLP 6144, GQA 16/8 heads of
    128), layers until ``total_bytes``: sizes from 256 bytes to 24 MiB, plus one 64 MiB
    embedding that travels chunked when buckets are smaller."""
    hidden, inter, q, kv = 2048, 6144, 2048, 1024
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (16384, hidden)}
    size = 16384 * hidden * 2
    layer = 0
    while size < total_bytes:
        p = f"model.layers.{layer}."
        for name, shape in [
            ("input_layernorm.weight", (hidden,)),
            ("self_attn.q_proj.weight", (q, hidden)),
            ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.weight", (kv, hidden)),
            ("self_attn.q_norm.weight", (128,)),
            ("self_attn.k_norm.weight", (128,)),
            ("self_attn.o_proj.weight", (hidden, q)),
            ("post_attention_layernorm.weight", (hidden,)),
            ("mlp.gate_proj.weight", (inter, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("mlp.down_proj.weight", (hidden, inter)),
        ]:
            n = 2
            for d in shape:
                n *= d
            if size + n > total_bytes:
                break
            shapes[p + name] = shape
            size += n
        else:
            layer += 1
            continue
        break
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        for name, shape in shapes.items()
    }


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


# -- baselines ---------------------------------------------------------------------------
def memcpy_gbps(weights: dict[str, torch.Tensor], repeat: int) -> float:
    dst = {n: torch.empty_like(t) for n, t in weights.items()}
    best = float("inf")
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        for n, t in weights.items():
            dst[n].copy_(t)
        best = min(best, time.perf_counter() - t0)
    return nbytes(weights) / best / 1e9


def two_copy_gbps(weights: dict[str, torch.Tensor], slot_bytes: int, repeat: int) -> float:
    """Copy into a slot-sized buffer and out again, back to back, a slot at a time."""
    dst = {n: torch.empty_like(t) for n, t in weights.items()}
    buf = torch.zeros(slot_bytes, dtype=torch.uint8)
    flat = [(n, t.reshape(-1).view(torch.uint8)) for n, t in weights.items()]
    best = float("inf")
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        for n, src in flat:
            out = dst[n].reshape(-1).view(torch.uint8)
            for lo in range(0, src.numel(), slot_bytes):
                hi = min(src.numel(), lo + slot_bytes)
                buf[: hi - lo].copy_(src[lo:hi])
                out[lo:hi].copy_(buf[: hi - lo])
        best = min(best, time.perf_counter() - t0)
    return nbytes(weights) / best / 1e9


def _zmq_pull(address: str, total: int, msg_bytes: int, repeat: int, results: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(address)
    for _ in range(repeat + 1):
        got = 0
        while got < total:
            got += len(sock.recv(copy=False).buffer)
        results.put(time.monotonic())
    sock.close()
    ctx.term()


def raw_zmq_gbps(address: str, total: int, msg_bytes: int, repeat: int) -> float:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    bound = sock.bind(address) and sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    results = multiprocessing.get_context("spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(
        target=_zmq_pull, args=(bound, total, msg_bytes, repeat, results)
    )
    proc.start()
    bufs = [torch.zeros(msg_bytes, dtype=torch.uint8) for _ in range(2)]
    times = []
    time.sleep(1.0)  # connected
    for _ in range(repeat + 1):
        t0 = time.monotonic()
        sent = i = 0
        while sent < total:
            n = min(msg_bytes, total - sent)
            sock.send(memoryview(bufs[i % 2][:n].numpy()), copy=False)
            sent += n
            i += 1
        times.append(results.get(timeout=120) - t0)
    proc.join()
    sock.close(linger=0)
    ctx.term()
    return total / min(times[1:]) / 1e9


# -- streamsync sides --------------------------------------------------------------------
class _CopySink:
    """Copies into preallocated tensors, as ModuleSink does, and notes when it finished."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.finished = 0.0

    def prepare(self) -> None:
        pass

    def load(self, tensors: Any) -> None:
        for name, src in tensors:
            self.targets[name].copy_(src)

    def finalize(self) -> None:
        self.finished = time.monotonic()


def _receiver(url: str, total: int, repeat: int, options: dict[str, Any], results: Any) -> None:
    import streamsync as ss

    weights = qwen3_like(total)
    targets = {n: torch.empty_like(t) for n, t in weights.items()}
    del weights

    async def run() -> None:
        async with ss.open_receiver(url, connect_timeout=120, **options) as rx:
            for _ in range(repeat + 1):
                sink = _CopySink(targets)
                await ss.receive(rx, sink, timeout=120)
                results.put(("rx", sink.finished))

    asyncio.run(run())
    check = qwen3_like(total)
    results.put(("ok", all(torch.equal(targets[n], t) for n, t in check.items())))


def _sender(
    url: str, total: int, repeat: int, bucket: int, options: dict[str, Any], results: Any
) -> None:
    import streamsync as ss

    weights = qwen3_like(total)

    async def run() -> None:
        async with ss.open_sender(url, connect_timeout=120, **options) as tx:
            for _ in range(repeat + 1):
                t0 = time.monotonic()
                await ss.send(weights, tx, bucket_bytes=bucket, timeout=120)
                results.put(("tx", t0))

    asyncio.run(run())


def run_transport(url: str, total: int, repeat: int, bucket: int, slots: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    opts = {"slots": slots, "slot_bytes": bucket}
    rx = ctx.Process(target=_receiver, args=(url, total, repeat, {}, results))
    tx = ctx.Process(target=_sender, args=(url, total, repeat, bucket, opts, results))
    rx.start()
    tx.start()
    starts: list[float] = []
    ends: list[float] = []
    ok = None
    while ok is None:
        kind, value = results.get(timeout=600)
        if kind == "tx":
            starts.append(value)
        elif kind == "rx":
            ends.append(value)
        else:
            ok = value
    rx.join()
    tx.join()
    seconds = [e - s for s, e in zip(starts[1:], ends[1:], strict=True)]  # skip the warm-up
    return {
        "gbps": total / min(seconds) / 1e9,
        "gbps_median": total / statistics.median(seconds) / 1e9,
        "bit_exact": ok,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default="memcpy,shm,zmq+ipc,zmq+tcp")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=32)
    parser.add_argument("--slots", type=int, default=3)
    args = parser.parse_args()
    weights = qwen3_like(int(args.gib * GiB))
    total = nbytes(weights)
    bucket = args.bucket_mib << 20
    memcpy = memcpy_gbps(weights, args.repeat)
    bound = two_copy_gbps(weights, bucket, args.repeat)
    del weights
    out: dict[str, Any] = {
        "bytes": total,
        "bucket_bytes": bucket,
        "slots": args.slots,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memcpy_gbps": round(memcpy, 3),
        "two_copy_gbps": round(bound, 3),
        "transports": {},
    }
    rows = [("memcpy (1 copy)", memcpy, 1.0, ""), ("two-copy bound", bound, bound / memcpy, "")]
    for name in args.transports.split(","):
        if name == "memcpy":
            continue
        tag = f"bench{os.getpid()}"
        if name == "shm":
            url, raw = f"shm://{tag}", None
        elif name == "zmq+ipc":
            url, raw = f"zmq+ipc://{tag}", f"ipc://@{tag}-raw"
        elif name == "zmq+tcp":
            url, raw = f"zmq+tcp://127.0.0.1:{_free_port()}", "tcp://127.0.0.1:0"
        else:
            sys.exit(f"unknown transport {name!r}; valid: memcpy, shm, zmq+ipc, zmq+tcp")
        res = run_transport(url, total, args.repeat, bucket, args.slots)
        res["vs_memcpy"] = res["gbps"] / memcpy
        note = f"bit-exact={res['bit_exact']}"
        if name == "shm":
            res["vs_two_copy"] = res["gbps"] / bound
            note += f", {res['vs_two_copy']:.2f} of the two-copy bound"
        if raw is not None:
            res["raw_pyzmq_gbps"] = raw_zmq_gbps(raw, total, bucket, args.repeat)
            res["vs_raw_pyzmq"] = res["gbps"] / res["raw_pyzmq_gbps"]
            note += (
                f", raw PUSH/PULL {res['raw_pyzmq_gbps']:.2f} GB/s "
                f"({res['vs_raw_pyzmq']:.2f} of it)"
            )
        out["transports"][name] = {
            k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()
        }
        rows.append((name, res["gbps"], res["vs_memcpy"], note))
    print(f"{total / GiB:.2f} GiB, buckets of {args.bucket_mib} MiB, {args.slots} slots")
    print(f"{'':18} {'GB/s':>7} {'x memcpy':>9}")
    for label, gbps, ratio, note in rows:
        print(f"{label:18} {gbps:7.2f} {ratio:9.2f}  {note}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
