"""Compose adapters in a training loop: after every optimizer step, stream the policy's
weights (minus rotary caches, cast to bf16) into a rollout copy of the model.

Run: .venv/bin/python examples/trainer_loop.py
"""

from __future__ import annotations

import anyio
import torch

import streamsync as ss
from streamsync.adapters import cast, select


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


async def main(steps: int = 3) -> None:
    policy = make_policy()
    rollout = make_policy().to(torch.bfloat16)  # the inference copy, in bf16
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    pipeline = select(lambda name: "rotary" not in name) | cast(torch.bfloat16)

    for step in range(steps):
        loss = policy(torch.randn(32, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: ss.receive("memory://policy", ss.ModuleSink(rollout)))
            report = await ss.send(
                ss.named_tensors(policy),
                "memory://policy",
                pipeline=pipeline,
                bucket_bytes=64 << 10,
            )
        same = all(
            torch.equal(a.to(torch.bfloat16), b)
            for a, b in zip(
                policy.state_dict().values(), rollout.state_dict().values(), strict=True
            )
        )
        print(f"step {step}: loss={loss.item():.4f} {report.summary()} rollout matches: {same}")
        assert same


if __name__ == "__main__":
    anyio.run(main)
