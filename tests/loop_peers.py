"""The two processes of ``test_one_shot_loops.py``: a trainer and an engine that each use
the README's one-shot form, ``asyncio.run(send(...))`` / ``asyncio.run(receive(...))``, once
per step. They report plain dicts (never tensors) to the test."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch

import streamsync as ss

#: Seconds any one wait of a step may take.
TIMEOUT = 20.0
#: Small buckets (and slots): a step is a handshake and a few buckets, not a big copy.
BUCKET_BYTES = 64 << 10
#: Both sides authenticate: a frame meant for another step's peer fails its MAC, loudly.
SECRET = b"one-shot-loop"


def step_weights(step: int) -> dict[str, torch.Tensor]:
    """What the trainer sends at ``step``: different at every step, larger than a bucket."""
    gen = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(96, 256, generator=gen).to(torch.bfloat16),  # 48 KiB
        "layer.0.weight": torch.randn(64, 64, generator=gen),
        "layer.0.bias": torch.full((64,), float(step)),
    }


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Keep:
    """A sink that keeps copies of what it was given."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def prepare(self) -> None:
        self.tensors = {}

    def load(self, batch: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.tensors.update((name, t.clone()) for name, t in batch)

    def finalize(self) -> None:
        pass


def trainer(url: str, steps: int, results: Any) -> None:
    """``asyncio.run(ss.send(weights, url))`` once per step."""
    for step in range(steps):
        t0 = time.monotonic()
        try:
            report = asyncio.run(
                ss.send(
                    step_weights(step),
                    url,
                    bucket_bytes=BUCKET_BYTES,
                    timeout=TIMEOUT,
                    secret=SECRET,
                )
            )
        except Exception as exc:
            results.put({"role": "trainer", "ok": False, "step": step, "error": repr(exc)})
            return
        if report.receivers != 1 or not report.complete or report.refused:
            results.put({"role": "trainer", "ok": False, "step": step, "error": repr(report)})
            return
        results.put({"role": "trainer", "step": step, "seconds": time.monotonic() - t0})
    results.put({"role": "trainer", "ok": True, "steps": steps})


def engine(url: str, steps: int, results: Any) -> None:
    """``asyncio.run(ss.receive(url, sink))`` once per step; every step is checked."""
    sink = Keep()
    for step in range(steps):
        try:
            asyncio.run(
                ss.receive(url, sink, timeout=TIMEOUT, connect_timeout=TIMEOUT, secret=SECRET)
            )
        except Exception as exc:
            results.put({"role": "engine", "ok": False, "step": step, "error": repr(exc)})
            return
        if digest(sink.tensors) != digest(step_weights(step)):
            results.put({"role": "engine", "ok": False, "step": step, "error": "wrong bytes"})
            return
    results.put({"role": "engine", "ok": True, "steps": steps})
