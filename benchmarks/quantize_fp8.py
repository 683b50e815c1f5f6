"""Throughput of block-FP8 quantization (``quantize_block_fp8``), in GB/s of input.

Run: .venv/bin/python benchmarks/quantize_fp8.py [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from streamsync.adapters.quantize_fp8 import quantize_block_fp8

SHAPES = {
    "linear 4096x4096": (4096, 4096),
    "linear 4096x14336": (4096, 14336),
    "MoE gate_up 64x1536x2048": (64, 1536, 2048),
    "MoE down 64x2048x768": (64, 2048, 768),
    "ragged 4000x4100": (4000, 4100),
}


def measure(shape: tuple[int, ...], dtype: torch.dtype, repeat: int) -> tuple[float, float]:
    weight = torch.randn(shape).to(dtype)
    quantize_block_fp8(weight)  # warm up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        quantize_block_fp8(weight)
        best = min(best, time.perf_counter() - start)
    return weight.numel() * weight.element_size() / best / 1e9, weight.numel() / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeat}")
    print(f"{'tensor':28} {'dtype':9} {'GB/s in':>8} {'Gelem/s':>8}")
    for label, shape in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            gbps, gelems = measure(shape, dtype, args.repeat)
            print(f"{label:28} {str(dtype)[6:]:9} {gbps:8.2f} {gelems:8.3f}")


if __name__ == "__main__":
    main()
