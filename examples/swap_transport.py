"""The same sync code over any transport: the transport is a URL argument.

Run: .venv/bin/python examples/swap_transport.py memory://demo
"""

from __future__ import annotations

import sys

import anyio
import torch

import streamsync as ss


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)
    )


async def sync_once(url: str) -> ss.SyncReport:
    trainer, engine = make_model(1), make_model(2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: ss.receive(url, ss.ModuleSink(engine)))
        report = await ss.send(trainer, url, bucket_bytes=64 << 10)
    for (name, a), b in zip(
        trainer.state_dict().items(), engine.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    return report


if __name__ == "__main__":
    url = sys.argv[1] if len(sys.argv) > 1 else "memory://demo"
    print(anyio.run(sync_once, url).summary())
