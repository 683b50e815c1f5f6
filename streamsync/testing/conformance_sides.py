"""The sides of the conformance suite's syncs, as its child processes run them, and the
weights it checks: :func:`conformance_weights` (every wire dtype, odd sizes, a tensor
larger than a bucket) and :func:`digest`. :mod:`streamsync.testing.conformance` is the
suite itself."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch

import streamsync as ss
from streamsync.transports import open_receiver, open_sender

__all__ = ["conformance_weights", "digest"]

_BUCKET_BYTES = 16 << 10
_CONNECT_S = 60.0


def conformance_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic named tensors of every wire dtype, odd sizes, and one tensor larger
    than the suite's 16 KiB buckets (it travels in chunks)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    floats = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    for i, dtype in enumerate(floats):
        out[f"layers.{i}.weight"] = torch.randn(17 + i, 33, generator=gen).to(dtype)
    raw = torch.randint(0, 256, (301,), generator=gen, dtype=torch.int32).to(torch.uint8)
    out["fp8.e4m3"] = raw.view(torch.float8_e4m3fn)
    out["fp8.e5m2"] = raw.flip(0).contiguous().view(torch.float8_e5m2)
    out["mask"] = torch.randint(0, 2, (77,), generator=gen).bool()
    out["ids"] = torch.randint(-(2**40), 2**40, (5, 7), generator=gen)
    out["small.int32"] = torch.randint(-1000, 1000, (3,), generator=gen, dtype=torch.int32)
    out["scalar"] = torch.tensor(float(seed) + 0.5)
    out["empty"] = torch.empty(0, 4)
    out["embed_tokens.weight"] = torch.randn(100, 200, generator=gen).to(torch.bfloat16)  # 40 KB
    return out


def digest(name: str, tensor: torch.Tensor) -> str:
    """A digest of a named tensor's dtype, shape and exact bytes."""
    h = hashlib.sha256(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def _expected(seed: int) -> list[str]:
    return [digest(n, t) for n, t in conformance_weights(seed).items()]


class _HashingSink:
    """Records digests in arrival order; optionally slow, optionally signals its first load."""

    def __init__(self, delay: float = 0.0, on_first_load: Callable[[], Any] | None = None) -> None:
        self.delay = delay
        self.on_first_load = on_first_load
        self.digests: list[str] = []
        self.prepared = 0

    def prepare(self) -> None:
        self.prepared += 1
        self.digests = []

    async def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.digests.extend(digest(n, t) for n, t in tensors)
        if self.on_first_load is not None:
            callback, self.on_first_load = self.on_first_load, None
            callback()
        if self.delay:
            await anyio.sleep(self.delay)

    def finalize(self) -> None:
        pass


async def _slow_source(seed: int, delay: float) -> AsyncIterator[tuple[str, torch.Tensor]]:
    for name, tensor in conformance_weights(seed).items():
        yield name, tensor
        await anyio.sleep(delay)


# -- child processes -----------------------------------------------------------------
def _child(role: str, setup: str, args: dict[str, Any], results: Any) -> None:
    """Entry point of a spawned side: run it and put a plain dict on ``results``."""
    if setup:
        importlib.import_module(setup)
    try:
        side = _receiver_side if role == "receiver" else _sender_side
        out: dict[str, Any] = asyncio.run(side(args, results))
        results.put({"role": role, "ok": True, **out})
    except BaseException as exc:
        results.put({"role": role, "ok": False, "error": type(exc).__name__, "message": str(exc)})


async def _receiver_side(args: dict[str, Any], results: Any) -> dict[str, Any]:
    sink = _HashingSink(args.get("delay", 0.0), lambda: results.put({"event": "loading"}))
    syncs: list[list[str]] = []
    async with open_receiver(args["url"], connect_timeout=_CONNECT_S, **args["options"]) as rx:
        results.put({"event": "joined"})
        for _ in range(args["syncs"]):
            # The first bucket may wait for other children to start; later waits are short.
            await ss.receive(rx, sink, timeout=max(args["timeout"], _CONNECT_S))
            syncs.append(list(sink.digests))
    return {"syncs": syncs}


async def _sender_side(args: dict[str, Any], results: Any) -> dict[str, Any]:
    async with open_sender(args["url"], connect_timeout=_CONNECT_S, **args["options"]) as tx:
        for seed in range(args["syncs"]):
            weights: Any = conformance_weights(seed)
            if args.get("delay"):
                weights = _slow_source(seed, args["delay"])
            size = args.get("bucket_bytes", _BUCKET_BYTES)
            await ss.send(weights, tx, bucket_bytes=size, timeout=args["timeout"])
    return {}


async def _raises(
    exc: type[BaseException], failure: str, call: Callable[[], Any], limit: float
) -> None:
    """Fail with ``failure`` unless ``await call()`` raises ``exc`` within ``limit`` seconds."""
    with anyio.fail_after(limit):
        try:
            await call()
        except exc:
            return
    raise AssertionError(failure)


async def _caught(awaitable: Awaitable[Any]) -> BaseException | None:
    """The streamsync error ``awaitable`` raised, or ``None``."""
    try:
        await awaitable
    except ss.StreamsyncError as exc:
        return exc
    return None


async def _both(**sides: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    """Run each side concurrently: each one's result, or the exception it raised."""
    out: dict[str, Any] = {}

    async def run(key: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            out[key] = await fn()
        except Exception as exc:
            out[key] = exc

    async with anyio.create_task_group() as tg:
        for key, fn in sides.items():
            tg.start_soon(run, key, fn)
    return out


def _open_fds() -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/fd"))
    return 0


def _shm_entries() -> set[str]:
    with contextlib.suppress(OSError):
        # Named semaphores of the harness's own multiprocessing queues are not the transport's.
        return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")}
    return set()
