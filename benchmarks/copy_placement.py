"""A copy's speed against where its destination sits past its source, modulo 4 KiB: glibc's
``memmove`` and the library's own copy (``streamsync._copies.large_copy``) on one thread,
in GB/s, each distance measured alternately.

A receiver copies a slot's entries (page-aligned in the slot) into tensors that torch's
allocator places 64 bytes into a page: the destination is 64 bytes past the source. A copy
that runs upwards there waits on its own stores ("4K aliasing"); the library's copy runs
downwards when the destination is just past the source, as glibc's ``memmove`` does.

Run: .venv/bin/python benchmarks/copy_placement.py [--mib 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time
from collections.abc import Callable

import torch

from streamsync._copies import large_copy

#: Distances of the destination past the source, modulo 4 KiB, in bytes.
DISTANCES = (0, 16, 64, 112, 128, 256, 2048, 4032, 4080)


def _median_gbps(copy: Callable[[int, int, int], object], dst: int, src: int, n: int) -> float:
    copy(dst, src, n)  # warm up
    times = []
    for _ in range(7):
        start = time.perf_counter()
        copy(dst, src, n)
        times.append(time.perf_counter() - start)
    return n / statistics.median(times) / 1e9


def measure(nbytes: int) -> dict[str, dict[int, float]]:
    """One round: each copy at each distance, ``nbytes`` each time."""
    # Page-aligned buffers, one page longer than the copy, so that any distance fits.
    src_map = mmap.mmap(-1, nbytes + 4096)
    dst_map = mmap.mmap(-1, nbytes + 4096)
    src = torch.frombuffer(src_map, dtype=torch.uint8)
    dst = torch.frombuffer(dst_map, dtype=torch.uint8)
    src.fill_(1)
    dst.zero_()
    copies: dict[str, Callable[[int, int, int], object]] = {
        "glibc": ctypes.memmove,
        "library": large_copy(),
    }
    out: dict[str, dict[int, float]] = {name: {} for name in copies}
    try:
        for distance in DISTANCES:
            for name, copy in copies.items():
                out[name][distance] = _median_gbps(
                    copy, dst.data_ptr() + distance, src.data_ptr(), nbytes
                )
    finally:
        del src, dst
        src_map.close()
        dst_map.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=48, help="MiB per copy")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| round | copy | " + " | ".join(f"+{d} B" for d in DISTANCES) + " |")
    print("|---:|---|" + "---:|" * len(DISTANCES))
    for i in range(args.rounds):
        for name, by_distance in measure(args.mib << 20).items():
            cells = " | ".join(f"{by_distance[d]:.1f}" for d in DISTANCES)
            print(f"| {i + 1} | {name} | {cells} |")


if __name__ == "__main__":
    main()
