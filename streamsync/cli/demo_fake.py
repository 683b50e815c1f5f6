"""``streamsync demo --engine fake``: the trainer and a vLLM-style fake model in one
process, over ``memory://`` (no vLLM needed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch

import streamsync as ss
from streamsync.adapters import cast, select
from streamsync.testing import FakeConfig, FakeVllmModel, LoadWeightsSink, fake_state_dict
from streamsync.testing.shapes import VLLM_STACKED


def demo_fake(args: argparse.Namespace) -> int:
    """Run ``streamsync demo --engine fake``; exit status 1 if any step fails verification."""
    cfg = FakeConfig(hidden_size=256, num_hidden_layers=4, intermediate_size=512, vocab_size=2048)
    trainer = fake_state_dict(cfg, seed=0)
    engine = FakeVllmModel(cfg, dtype=torch.bfloat16)
    pipeline = select(lambda name: "rotary" not in name) | cast(torch.bfloat16)
    url = args.transport or "memory://demo"
    reports: list[dict[str, Any]] = []
    failed = False

    async def step(index: int) -> tuple[ss.SyncReport, bool]:
        gen = torch.Generator().manual_seed(index + 1)
        for tensor in trainer.values():  # a "training step"
            tensor.add_(torch.randn(tensor.shape, generator=gen) * 0.01)
        out: dict[str, ss.SyncReport] = {}

        async def rx() -> None:
            out["rx"] = await ss.receive(url, LoadWeightsSink(engine), timeout=args.timeout)

        async def tx() -> None:
            size, timeout = args.bucket_bytes, args.timeout
            out["tx"] = await ss.send(
                trainer, url, pipeline=pipeline, bucket_bytes=size, timeout=timeout
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(rx)
            tg.start_soon(tx)
        return out["tx"], _verify(trainer, engine) and not out["rx"].missing

    for index in range(args.steps):
        report, ok = anyio.run(step, index)
        failed |= not ok
        sys.stdout.write(
            f"step {index + 1}/{args.steps}: {report.nbytes / 2**20:.2f} MiB, "
            f"{report.seconds * 1e3:.1f} ms, {report.gbps:.2f} GB/s, "
            f"verified={'yes' if ok else 'NO'}\n"
        )
        data: dict[str, Any] = msgspec.to_builtins(report)
        data.pop("loaded", None)
        reports.append({"step": index + 1, "verified": ok, **data, "gbps": report.gbps})
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))
    return 1 if failed else 0


def _verify(trainer: dict[str, torch.Tensor], engine: FakeVllmModel) -> bool:
    """Every engine parameter equals the trainer's tensors, stacked and cast as vLLM does."""
    for name, param in engine.named_weights().items():
        stacked = [
            trainer[name.replace(fused, shard)]
            for fused, shard, _ in VLLM_STACKED
            if f".{fused}." in name
        ]
        want = torch.cat(stacked) if stacked else trainer[name]
        if not torch.equal(param, want.to(param.dtype)):
            return False
    return True
