"""``streamsync bench --delta``: delta syncs against dense ones, on a model being trained.

A Qwen3-shaped model (:func:`~streamsync.cli.bench.models.synthetic_model` of ``--size``
bf16 bytes) keeps fp32 master weights and takes ``--steps`` AdamW steps at each learning
rate (random gradients: Adam's step does not depend on their scale). After every step it is
synced, ``cast(bf16)`` on the wire, through a dense and a delta channel of each transport,
one after the other (so the two are measured side by side, step by step), to 1 and to 3
receiver processes that hold the model and take patches in place. Per step: the fraction of
bf16 elements that changed, each channel's wire bytes and sender seconds, and the delta
encoder's scan rate. At the end every receiver's model is checked bit-exact against the
trainer's last weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import streamsync as ss
from streamsync.adapters import cast
from streamsync.cli.bench.models import human, synthetic_model
from streamsync.testing.conformance_sides import _HeldSink
from streamsync.testing.peers import Peers, free_port

SCHEMA = "streamsync.cli.bench.delta/1"
_URLS: dict[str, Callable[[str], str]] = {
    "shm": lambda tag: f"shm://bench-delta-{tag}-{time.monotonic_ns()}",
    "zmq+tcp": lambda tag: f"zmq+tcp://127.0.0.1:{free_port()}",
    "torch+gloo": lambda tag: f"torch+gloo://127.0.0.1:{free_port()}",
}
DELTA_TRANSPORTS = tuple(_URLS)


@dataclass(frozen=True)
class DeltaConfig:
    """What to measure."""

    size: int = 256 << 20
    steps: int = 5
    lrs: tuple[float, ...] = (1e-6, 1e-5)
    transports: tuple[str, ...] = DELTA_TRANSPORTS
    receivers: tuple[int, ...] = (1, 3)
    bucket_bytes: int = 64 << 20
    timeout: float = 120.0


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# A receiver's model: tensors held across syncs, patched in place (the conformance
# suite's delta sink).
_Held = _HeldSink


def child(job: dict[str, Any], results: Any) -> None:
    """A receiver process: ``syncs`` syncs into a held model; reports its digest."""
    try:
        sink = _Held()

        async def run() -> None:
            async with ss.open_receiver(job["url"], connect_timeout=job["timeout"]) as rx:
                for _ in range(job["syncs"]):
                    await ss.receive(rx, sink, timeout=job["timeout"])

        asyncio.run(run())
        results.put({"ok": True, "url": job["url"], "digest": _digest(sink.held)})
    except BaseException as exc:
        results.put({"ok": False, "url": job["url"], "error": f"{type(exc).__name__}: {exc}"})


def _initialised(model: Any) -> dict[str, torch.Tensor]:
    """fp32 master weights as a Qwen3 starts: matrices N(0, 0.02), norms at one (the bf16
    step size of a weight, hence how often a small update changes it, scales with it)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, (shape, _) in model.shapes.items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.02
    return out


async def _trajectory(
    config: DeltaConfig, lr: float, transport: str, receivers: int, peers: Peers
) -> dict[str, Any]:
    model = synthetic_model(config.size)
    params = {n: torch.nn.Parameter(t) for n, t in _initialised(model).items()}
    opt = torch.optim.AdamW(params.values(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    urls = {mode: _URLS[transport](f"{mode}{receivers}") for mode in ("dense", "delta")}
    options = {"receivers": receivers, "slot_bytes": config.bucket_bytes}
    rows: list[dict[str, Any]] = []
    for url in urls.values():
        for _ in range(receivers):
            job = {"url": url, "syncs": config.steps + 1, "timeout": config.timeout}
            peers.spawn(child, job)
    async with (
        ss.open_sender(urls["dense"], connect_timeout=config.timeout, **options) as dense,
        ss.open_sender(urls["delta"], connect_timeout=config.timeout, **options) as delta,
    ):
        await dense.wait_ready(timeout=config.timeout)
        await delta.wait_ready(timeout=config.timeout)
        before: dict[str, torch.Tensor] | None = None
        for step in range(config.steps + 1):
            if step:
                for p in params.values():
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            wire = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
            changed = (
                sum(
                    int((wire[n].view(torch.int16) != b.view(torch.int16)).sum())
                    for n, b in before.items()
                )
                if before is not None
                else None
            )
            before = wire
            weights = {n: p.detach() for n, p in params.items()}
            t0 = time.perf_counter()
            plain = await ss.send(
                weights,
                dense,
                pipeline=cast(torch.bfloat16),
                bucket_bytes=config.bucket_bytes,
                timeout=config.timeout,
            )
            t1 = time.perf_counter()
            patched = await ss.send(
                weights,
                delta,
                pipeline=cast(torch.bfloat16),
                bucket_bytes=config.bucket_bytes,
                timeout=config.timeout,
                delta=True,
            )
            t2 = time.perf_counter()
            info = patched.delta
            assert info is not None
            rows.append(
                {
                    "step": step,
                    "changed_fraction": changed / sum(t.numel() for t in wire.values())
                    if changed is not None
                    else None,
                    "dense_seconds": t1 - t0,
                    "delta_seconds": t2 - t1,
                    "dense_wire_bytes": plain.wire_bytes,
                    "delta_wire_bytes": patched.wire_bytes,
                    "base": info.base,
                    "full_reason": info.full_reason,
                    "sparse": info.sparse,
                    "dense": info.dense,
                    "unchanged": info.unchanged,
                    "scan_gbps": patched.nbytes / info.scan_seconds / 1e9
                    if info.scan_seconds
                    else None,
                }
            )
    final = _digest(before or {})
    reports = peers.collect(2 * receivers, config.timeout)
    verified = all(r.get("ok") and r.get("digest") == final for r in reports)
    errors = [r["error"] for r in reports if not r.get("ok")]
    return {
        "lr": lr,
        "transport": transport,
        "receivers": receivers,
        "model_bytes": model.nbytes,
        "steps": rows,
        "verified": verified,
        "errors": errors,
    }


def run_delta(config: DeltaConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every (learning rate, transport, receivers) trajectory; a dict for JSON."""
    out: list[dict[str, Any]] = []
    for lr in config.lrs:
        for transport in config.transports:
            for receivers in config.receivers:
                progress(f"lr {lr:g}, {transport}, {receivers} receiver(s)")
                with Peers(__name__) as peers:
                    out.append(asyncio.run(_trajectory(config, lr, transport, receivers, peers)))
    return {"schema": SCHEMA, "size": config.size, "rows": out}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def format_delta(data: dict[str, Any]) -> str:
    """The table, per trajectory: how many steps went as deltas, their wire and time against
    the dense sync of the same step, and what a user gets from step 2 on, after the first,
    cold delta (a declined channel sends dense syncs)."""
    lines = [
        f"delta against dense, {human(data['size'])} bf16 on the wire (medians; ratios are "
        "delta / dense of the same step, measured side by side)",
        f"{'lr':>7} {'transport':<11}{'rx':>3} {'changed':>8} {'wire':>7} {'delta':>7} "
        f"{'as used':>8} {'dense s':>8} {'delta s':>8} {'scan GB/s':>10} {'deltas':>7} "
        f"{'declined':>9}  ok",
    ]
    for row in data["rows"]:
        steady = [s for s in row["steps"] if s["step"]]
        patched = [s for s in steady if s["sparse"]]
        later = [s for s in steady if s["step"] >= 2]
        declined = any(s["full_reason"] and "do not pay" in s["full_reason"] for s in steady)
        scans = [s["scan_gbps"] for s in patched if s["scan_gbps"]]
        lines.append(
            f"{row['lr']:>7g} {row['transport']:<11}{row['receivers']:>3} "
            f"{_median([s['changed_fraction'] for s in steady]):>7.2%} "
            f"{_median([s['delta_wire_bytes'] / s['dense_wire_bytes'] for s in patched]):>7.3f} "
            f"{_median([s['delta_seconds'] / s['dense_seconds'] for s in patched]):>7.3f} "
            f"{_median([s['delta_seconds'] / s['dense_seconds'] for s in later]):>8.3f} "
            f"{_median([s['dense_seconds'] for s in steady]):>8.3f} "
            f"{_median([s['delta_seconds'] for s in patched]):>8.3f} {_median(scans):>10.2f} "
            f"{sum(s['base'] is not None for s in steady):>3}/{len(steady):<3} "
            f"{'yes' if declined else 'no':>9}  "
            f"{'yes' if row['verified'] else 'NO ' + '; '.join(row['errors'])}"
        )
    lines.append(
        "wire, delta: the steps sent as deltas; as used: steps 2.. (after the first, cold "
        "delta; a declined channel sends dense syncs); deltas: steps sent as deltas"
    )
    return "\n".join(lines)
