"""What each way of handing ``send`` a model costs: the model itself, ``named_tensors`` of
it (the README's form), a mapping of its tensors, and ``named_tensors`` of that mapping,
each sent to a receiver in another process over ``shm://``, alternating, in milliseconds
per sync. Many small tensors show the per-tensor cost of each form.

Each form's first sync of a round builds the sender's bucket plans for it; the second is
timed. With ``--count 1`` and many rounds it measures a sync's fixed cost: more than five
rounds are shown as the fastest, the median and the slowest.

Run: .venv/bin/python benchmarks/source_forms.py [--count 65536]
[--tensor-bytes 16384] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import streamsync as ss

#: Most rounds shown one column each; more are summed up as a range.
_COLUMNS = 5
FORMS = ("model", "named_tensors(model)", "mapping", "named_tensors(mapping)")


def _model(count: int, tensor_bytes: int) -> torch.nn.Module:
    model = torch.nn.Module()
    for i in range(count):
        filled = torch.full((tensor_bytes // 2,), i % 128, dtype=torch.bfloat16)
        model.register_buffer(f"t{i}", filled)
    return model


async def _send(url: str, count: int, tensor_bytes: int, rounds: int) -> dict[str, list[float]]:
    model = _model(count, tensor_bytes)
    mapping = dict(model.state_dict())
    sources: dict[str, Callable[[], Any]] = {
        "model": lambda: model,
        "named_tensors(model)": lambda: ss.named_tensors(model),
        "mapping": lambda: mapping,
        "named_tensors(mapping)": lambda: ss.named_tensors(mapping),
    }
    seconds: dict[str, list[float]] = {form: [] for form in FORMS}
    async with ss.open_sender(url) as sender:
        for _ in range(rounds):
            for form in FORMS:
                for timed in (False, True):
                    start = time.perf_counter()
                    await ss.send(sources[form](), sender, timeout=120)
                    if timed:
                        seconds[form].append(time.perf_counter() - start)
    return seconds


async def _receive(url: str, count: int, tensor_bytes: int, syncs: int) -> bool:
    model = torch.nn.Module()
    for i in range(count):
        model.register_buffer(f"t{i}", torch.zeros(tensor_bytes // 2, dtype=torch.bfloat16))
    sink = ss.ModuleSink(model)
    async with ss.open_receiver(url, connect_timeout=120) as receiver:
        for _ in range(syncs):
            await ss.receive(receiver, sink, timeout=120)
    return all(bool((t == i % 128).all()) for i, t in enumerate(model.state_dict().values()))


def _receiver(url: str, count: int, tensor_bytes: int, syncs: int) -> None:
    # The verdict is the exit status: nothing crosses back but that.
    raise SystemExit(0 if asyncio.run(_receive(url, count, tensor_bytes, syncs)) else 3)


def measure(count: int, tensor_bytes: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of each form's timed syncs, one per round; raises if the receiver's model
    is not the sender's at the end."""
    url = f"shm://source-forms-{os.getpid()}"
    ctx = multiprocessing.get_context("spawn")
    syncs = rounds * len(FORMS) * 2
    proc = ctx.Process(target=_receiver, args=(url, count, tensor_bytes, syncs))
    proc.start()
    try:
        seconds = asyncio.run(_send(url, count, tensor_bytes, rounds))
        proc.join(timeout=120)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if proc.exitcode != 0:
        why = "differ from the sender's" if proc.exitcode == 3 else f"exit {proc.exitcode}"
        raise AssertionError(f"the receiver's tensors: {why}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=65536, help="tensors in the model")
    parser.add_argument("--tensor-bytes", type=int, default=16384, help="bytes per tensor")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds = measure(args.count, args.tensor_bytes, args.rounds)
    print(f"{args.count} bf16 tensors of {args.tensor_bytes} bytes over shm, ms per sync")
    print()
    if args.rounds > _COLUMNS:  # many rounds (a tiny model's fixed cost per sync): a range
        print("| form | fastest | median | slowest |")
        print("|---|---:|---:|---:|")
        for form, taken in seconds.items():
            low, mid, high = min(taken), statistics.median(taken), max(taken)
            print(f"| `{form}` | {low * 1e3:.3f} | {mid * 1e3:.3f} | {high * 1e3:.3f} |")
        return
    print("| form | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " | median |")
    print("|---|" + "---:|" * (args.rounds + 1))
    for form, taken in seconds.items():
        cells = " | ".join(f"{s * 1e3:.1f}" for s in taken)
        print(f"| `{form}` | {cells} | {statistics.median(taken) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
