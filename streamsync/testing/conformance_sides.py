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
from streamsync._copies import copy_tensors
from streamsync.transports import open_receiver, open_sender

#: Syncs of the suite's delta case: one full, then deltas.
DELTA_STEPS = 20

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


def delta_weights(step: int) -> dict[str, torch.Tensor]:
    """:func:`conformance_weights` ``(0)`` after ``step`` training-like steps: each flips a
    bit in about 3 % of every tensor's elements (20 % of the largest, whose patch then
    needs two buckets), so floats become NaN, -0.0, anything: compared as bits."""
    out = conformance_weights(0)
    for s in range(1, step + 1):
        gen = torch.Generator().manual_seed(1000 + s)
        for name, tensor in out.items():
            if tensor.numel() == 0:
                continue
            rows = tensor.reshape(-1).view(torch.uint8).view(tensor.numel(), -1)
            share = 0.2 if name == "embed_tokens.weight" else 0.03
            chosen = (torch.rand(tensor.numel(), generator=gen) < share).nonzero().squeeze(1)
            rows[chosen, 0] ^= 1
    return out


def _delta_expected(step: int) -> list[str]:
    return [digest(n, t) for n, t in delta_weights(step).items()]


def digest(name: str, tensor: torch.Tensor) -> str:
    """A digest of a named tensor's dtype, shape and exact bytes."""
    h = hashlib.sha256(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    h.update((flat if flat.is_cpu else flat.cpu()).numpy().tobytes())
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


class _HeldSink:
    """A sink that holds the model itself (name -> tensor) across syncs and takes deltas:
    patches land in its tensors (``target``); it says which version it holds."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.version: int | None = None

    def prepare(self) -> None:
        pass

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        held = self.held.get(name)
        if held is None or held.dtype != dtype or tuple(held.shape) != shape:
            held = self.held[name] = torch.empty(shape, dtype=dtype)
        return held

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        pairs = []
        for name, tensor in tensors:
            own = self.target(name, tensor.dtype, tuple(tensor.shape))
            if own is not tensor:
                pairs.append((own, tensor))
        copy_tensors(pairs)

    def finalize(self) -> None:
        pass

    def digests(self) -> list[str]:
        return [digest(n, self.held[n]) for n in conformance_weights(0) if n in self.held]


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
    held = _HeldSink()
    syncs: list[list[str]] = []
    async with open_receiver(args["url"], connect_timeout=_CONNECT_S, **args["options"]) as rx:
        results.put({"event": "joined"})
        for _ in range(args["syncs"]):
            # The first bucket may wait for other children to start; later waits are short.
            timeout = max(args["timeout"], _CONNECT_S)
            if args.get("delta"):
                await ss.receive(rx, held, timeout=timeout)
                syncs.append(held.digests())
                continue
            await ss.receive(rx, sink, timeout=timeout)
            syncs.append(list(sink.digests))
    return {"syncs": syncs}


async def _sender_side(args: dict[str, Any], results: Any) -> dict[str, Any]:
    reports: list[tuple[int | None, str | None, int, int]] = []  # base, why full, wire, sparse
    async with open_sender(args["url"], connect_timeout=_CONNECT_S, **args["options"]) as tx:
        for seed in range(args["syncs"]):
            weights: Any = conformance_weights(seed)
            if args.get("delay"):
                weights = _slow_source(seed, args["delay"])
            size = args.get("bucket_bytes", _BUCKET_BYTES)
            if args.get("delta"):
                report = await ss.send(
                    delta_weights(seed), tx, bucket_bytes=size, timeout=args["timeout"], delta=True
                )
                assert report.delta is not None
                reports.append(
                    (
                        report.delta.base,
                        report.delta.full_reason,
                        report.wire_bytes,
                        report.delta.sparse,
                    )
                )
                continue
            await ss.send(weights, tx, bucket_bytes=size, timeout=args["timeout"])
    return {"reports": reports}


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
