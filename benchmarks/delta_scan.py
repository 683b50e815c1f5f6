"""How fast the fused delta comparison scans: ``ss_diff_f32_bf16`` (cast an fp32 source to
bf16 and compare it with a bf16 baseline, collecting the changed positions and values) on one
thread, in GB/s of fp32 source, at several shares of changed elements.

The kernel is called directly over the whole tensor with room for every element, so it scans
to the end at every change fraction (through :func:`streamsync.wire.patch.diff_cast` a tensor
with too many changes stops early and goes whole). Its output buffers are touched before the
timing starts. Each tensor is checked against torch's ``src.to(torch.bfloat16) != base``.

``--before PATH`` times an older build side by side, alternating, e.g. main's::

    git show main:streamsync/_kernel.c > /tmp/k/_kernel.c
    gcc -O3 -fno-wrapv -fPIC -shared -I"$(python -c 'import sysconfig as s;
        print(s.get_paths()["include"])')" /tmp/k/_kernel.c -o /tmp/k/before.so -ldl

Run: .venv/bin/python benchmarks/delta_scan.py [--before /tmp/k/before.so] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from streamsync._copies import _SIGNATURES, _library

_SIZES = {"64MiB": 64 << 20, "512MiB": 512 << 20}
_FRACTIONS = (0.0, 1e-4, 0.01, 0.5)


def _load(path: str) -> dict[str, Callable[..., Any]]:
    """The diff entries of a built kernel at ``path`` (a shared object, called by symbol)."""
    lib = ctypes.CDLL(path)
    found = {}
    for name in ("ss_diff_f32_bf16", "ss_diff_f32_bf16_portable"):
        if hasattr(lib, name):
            found[name] = ctypes.CFUNCTYPE(*_SIGNATURES["ss_diff_f32_bf16"])((name, lib))
    return found


def _case(numel: int, fraction: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 source and a bf16 baseline that differs from its cast at ``fraction`` of the
    elements (the lowest bit flipped), spread at random."""
    src = torch.randn(numel, generator=gen)
    base = src.to(torch.bfloat16)
    changed = int(numel * fraction)
    if changed:
        at = torch.randperm(numel, generator=gen)[:changed]
        base.view(torch.int16)[at] ^= 1
    return src, base


def _scan(fn: Callable[..., Any], src: torch.Tensor, base: torch.Tensor, out: Any) -> float:
    pos, vals = out
    start = time.thread_time()
    k = fn(src.data_ptr(), base.data_ptr(), 0, src.numel(), pos.ctypes.data, None,
           vals.ctypes.data, src.numel())  # fmt: skip
    seconds = time.thread_time() - start
    want = (src.to(torch.bfloat16).view(torch.int16) != base.view(torch.int16)).nonzero()
    if k != want.shape[0] or not np.array_equal(pos[:k], want.squeeze(1).numpy()):
        raise AssertionError(f"the kernel found {k} changes, torch {want.shape[0]}")
    return src.numel() * 4 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="an older built kernel to time side by side")
    parser.add_argument("--sizes", default="64MiB,512MiB", help=f"of {sorted(_SIZES)}")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lib = _library()
    if lib is None:
        raise SystemExit("the compiled kernel is not built (setup.py build_ext --inplace)")
    kernels = {"now": lib.ss_diff_f32_bf16}
    if hasattr(lib, "ss_diff_f32_bf16_portable"):
        kernels["now portable"] = lib.ss_diff_f32_bf16_portable
    if args.before:
        kernels.update(
            {f"before{n[16:].replace('_', ' ')}": f for n, f in _load(args.before).items()}
        )
    gen = torch.Generator().manual_seed(0)
    print(f"{'size':>7} {'changed':>8} " + " ".join(f"{name:>15}" for name in kernels))
    for size in args.sizes.split(","):
        numel = _SIZES[size] // 4
        out = (np.zeros(numel + 16, np.int32), np.zeros(numel + 16, np.uint16))
        for fraction in _FRACTIONS:
            src, base = _case(numel, fraction, gen)
            rates: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.repeats):
                for name, fn in kernels.items():
                    rates[name].append(_scan(fn, src, base, out))
            cells = [f"{min(r):6.2f}-{max(r):5.2f}" for r in rates.values()]
            print(f"{size:>7} {fraction:>8g} " + " ".join(f"{c:>15}" for c in cells), flush=True)
    print("GB/s of fp32 source, one thread, min-max of", args.repeats, "runs")


if __name__ == "__main__":
    main()
