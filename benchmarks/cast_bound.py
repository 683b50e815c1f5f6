"""What a fused fp32 -> bf16 cast can cost at best: the cast against a plain memmove of the
bf16 bytes it writes, on one thread, alternating, in GB/s of bytes written. Each both ways:
glibc's ``memmove`` and torch's ``copy_``, and the library's own (``streamsync._copies``: the
compiled kernel's copy and cast, which store past the cache).

A memmove of ``n`` bf16 bytes reads ``n`` and writes ``n``; the cast that produces them reads
``2n`` (the fp32 source) and writes ``n``. Where both run at the machine's memory bandwidth,
the cast takes 1.5x the memmove's time whatever its kernel, and this shows whether it does.

Run: .venv/bin/python benchmarks/cast_bound.py [--mib 64] [--rounds 3] [--repeat 7]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from streamsync._copies import kernel_cast, large_copy


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up: pages touched, code paths taken
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(nbytes: int, repeat: int) -> dict[str, float]:
    """One round: the memmove, then the cast, of ``nbytes`` written each."""
    numel = nbytes // 2
    source32 = torch.randn(numel)
    source16 = source32.to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    move = _median_seconds(
        lambda: ctypes.memmove(out.data_ptr(), source16.data_ptr(), nbytes), repeat
    )
    cast = _median_seconds(lambda: out.copy_(source32), repeat)
    copy = large_copy()
    lib_move = _median_seconds(lambda: copy(out.data_ptr(), source16.data_ptr(), nbytes), repeat)
    # On this thread, as one pool thread casts each piece.
    lib_cast = _median_seconds(lambda: kernel_cast(out, source32), repeat)
    return {
        "memmove_gbps": nbytes / move / 1e9,
        "cast_gbps": nbytes / cast / 1e9,
        "lib_memmove_gbps": nbytes / lib_move / 1e9,
        "lib_cast_gbps": nbytes / lib_cast / 1e9,
        # Bytes read and written per second: equal when both are bandwidth-bound.
        "memmove_traffic_gbps": 2 * nbytes / lib_move / 1e9,
        "cast_traffic_gbps": 3 * nbytes / lib_cast / 1e9,
        "cast_vs_memmove": lib_move / lib_cast,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="bf16 MiB written per copy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=7, help="copies per median")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread, as the library's copy pool runs each piece
    print(
        "| round | memmove GB/s: glibc / library | cast GB/s: torch / library "
        "| traffic, library memmove / cast GB/s | library cast / memmove |"
    )
    print("|---:|---:|---:|---:|---:|")
    for i in range(args.rounds):
        r = measure(args.mib << 20, args.repeat)
        print(
            f"| {i + 1} | {r['memmove_gbps']:.2f} / {r['lib_memmove_gbps']:.2f} "
            f"| {r['cast_gbps']:.2f} / {r['lib_cast_gbps']:.2f} "
            f"| {r['memmove_traffic_gbps']:.1f} / {r['cast_traffic_gbps']:.1f} "
            f"| {r['cast_vs_memmove']:.2f} |"
        )


if __name__ == "__main__":
    main()
