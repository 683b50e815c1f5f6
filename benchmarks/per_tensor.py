"""Where a sync's fixed cost per tensor goes, step by step.

Run from the repository root::

    .venv/bin/python benchmarks/per_tensor.py [--count 4000] [--tensor-bytes 8192] [--runs 7]
        [--json PATH]

Many small tensors (``--count`` of ``--tensor-bytes``, bf16) go through each step of a sync
on its own, in this process: the source and the bucketer (``named_tensors`` into
``Bucketer``), packing into a slot (``Bucket.pack_into``), the header's encoding and
decoding, unpacking (``Unpacker.feed``, its checks cached as on a channel's later syncs) and
a strict ``ModuleSink``. Each figure is the smallest of ``runs`` timings in thread CPU time,
so other processes disturb it less than wall time; the transports' per-bucket costs (the
ring's hand-off, acknowledgements) are not per tensor and are not here.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import torch

__all__ = ["format_per_tensor", "run_per_tensor"]


def run_per_tensor(*, count: int, tensor_bytes: int, runs: int) -> dict[str, Any]:
    """Time each step; returns microseconds per tensor by step (the ``--json``)."""
    import streamsync as ss
    from streamsync.adapters.bucket import Bucketer
    from streamsync.wire.frames import BucketHeader
    from streamsync.wire.pack import Bucket
    from streamsync.wire.slot import allocate_slot
    from streamsync.wire.unpack import Unpacker

    numel = max(1, tensor_bytes // 2)
    source = torch.nn.Module()
    target = torch.nn.Module()
    for i in range(count):
        source.register_buffer(f"t{i}", torch.randn(numel).bfloat16())
        target.register_buffer(f"t{i}", torch.empty(numel, dtype=torch.bfloat16))

    def best(*steps: Callable[[], Any]) -> list[float]:
        # Several steps are timed in turns, so that a busy moment hits each alike.
        times: list[list[float]] = [[] for _ in steps]
        for _ in range(runs):
            for step, taken in zip(steps, times, strict=True):
                start = time.thread_time()
                step()
                taken.append(time.thread_time() - start)
        return [min(taken) * 1e6 / count for taken in times]

    buckets: list[Bucket] = []

    async def produce() -> None:
        # What ``send`` does with a model and no pipeline: a plain loop per bucket.
        buckets.clear()
        async for bucket in Bucketer(1 << 30)(ss.named_tensors(source)):
            buckets.append(bucket)

    async def produce_streamed() -> None:
        # An async stream of named tensors (any pipeline): an async step per tensor.
        async def one_at_a_time() -> Any:
            async for pair in ss.named_tensors(source):
                yield pair

        async for _ in Bucketer(1 << 30)(one_at_a_time()):
            pass

    steps: dict[str, float] = {}
    steps["source + bucketer"], streamed = best(
        lambda: anyio.run(produce), lambda: anyio.run(produce_streamed)
    )
    (bucket,) = buckets
    slot = allocate_slot(bucket.nbytes)
    steps["pack into the slot"] = best(lambda: bucket.pack_into(slot))[0]
    header = BucketHeader(1, 0, 0, bucket.nbytes, bucket.pack_into(slot))
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(BucketHeader)
    steps["header encode"] = best(lambda: encoder.encode(header))[0]
    raw = encoder.encode(header)
    steps["header decode"] = best(lambda: decoder.decode(raw))[0]
    unpacker = Unpacker()

    def feed() -> Any:
        unpacker.begin(1)
        return unpacker.feed(header, slot)

    feed()  # the checks are cached from the first sync on, as on a channel
    steps["unpack"] = best(feed)[0]
    views = feed()
    sink = ss.ModuleSink(target)

    def load() -> None:
        sink.prepare()
        sink.load(views)
        sink.finalize()

    steps["ModuleSink"] = best(load)[0]
    send = steps["source + bucketer"] + steps["pack into the slot"] + steps["header encode"]
    receive = steps["header decode"] + steps["unpack"] + steps["ModuleSink"]
    return {
        "count": count,
        "tensor_bytes": numel * 2,
        "runs": runs,
        "steps_us": steps,
        "send_us": send,
        "receive_us": receive,
        "streamed_source_us": streamed,
    }


def format_per_tensor(data: dict[str, Any]) -> str:
    """The steps as a Markdown table."""
    lines = [
        f"Per tensor: {data['count']} bf16 tensors of {data['tensor_bytes']} bytes, each step "
        f"alone in this process, the smallest of {data['runs']} timings (thread CPU time)",
        "",
        "| step | µs per tensor |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {us:.2f} |" for name, us in data["steps_us"].items()]
    lines += [
        f"| **sending side** | **{data['send_us']:.2f}** |",
        f"| **receiving side** | **{data['receive_us']:.2f}** |",
        "",
        f"A source given as an async stream (any pipeline but a cast) instead: "
        f"{data['streamed_source_us']:.2f} µs per tensor for the source and bucketer.",
    ]
    return "\n".join(lines)


def main() -> None:
    """The command line: the table on stdout, every figure to ``--json``."""
    parser = argparse.ArgumentParser(description="where a sync's fixed cost per tensor goes")
    parser.add_argument("--count", type=int, default=4000, help="tensors (default 4000)")
    parser.add_argument("--tensor-bytes", type=int, default=8 << 10, help="each (8192)")
    parser.add_argument("--runs", type=int, default=7, help="timings, smallest kept (7)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    args = parser.parse_args()
    data = run_per_tensor(count=args.count, tensor_bytes=args.tensor_bytes, runs=args.runs)
    print(format_per_tensor(data))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=2)


if __name__ == "__main__":
    main()
