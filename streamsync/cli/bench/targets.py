"""The benchmark's targets, as a table: each is a metric of this run's results,
compared with a threshold; :func:`evaluate_targets` evaluates the whole table."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["EACH_TRANSPORT", "TARGETS", "Target", "evaluate_targets"]

#: ``Target.transport`` for a target checked once per transport that ran.
EACH_TRANSPORT = "each"

Metric = Literal["vs_bound", "vs_verl", "gbps_ratio", "per_tensor_us", "extra_memory"]
Results = dict[tuple[str, str], dict[str, Any]]


@dataclass(frozen=True)
class Target:
    """``metric`` of the results, compared (``comparison``) with ``threshold``.

    Metrics: ``vs_bound``: GB/s of ``transport`` in ``scenario`` over its bound's;
    ``vs_verl``: the same over the verl shared-memory baseline's (best bucket size);
    ``gbps_ratio``: GB/s in ``scenario`` over GB/s in ``baseline``, same transport;
    ``per_tensor_us``: the time per tensor of ``scenario`` beyond its bytes at
    ``baseline``'s rate;
    ``extra_memory``: the worst peak extra memory over its budget (ring + largest tensor),
    either side, every transport and scenario. A target whose results are missing is left
    out. ``name`` may say ``{transport}``.
    """

    name: str
    metric: Metric
    comparison: Literal[">=", "<="]
    threshold: float
    detail: str
    #: A transport's name, :data:`EACH_TRANSPORT`, or None (the metric spans them all).
    transport: str | None = None
    scenario: str = "dense"
    baseline: str | None = None


TARGETS: tuple[Target, ...] = (
    Target("shm vs two memcpys at once", "vs_bound", ">=", 0.8, "dense bf16", "shm"),
    Target("shm vs verl's shared-memory path", "vs_verl", ">=", 3.0, "dense bf16", "shm"),
    Target("zmq+tcp vs raw pyzmq tcp", "vs_bound", ">=", 0.9, "dense bf16", "zmq+tcp"),
    Target(
        "{transport}: 16 KiB tensors vs 8 MiB tensors",
        "gbps_ratio",
        ">=",
        0.5,
        "small-tensors / large-tensors",
        EACH_TRANSPORT,
        scenario="small-tensors",
        baseline="large-tensors",
    ),
    Target(
        "{transport}: fixed cost per tensor, both sides (us)",
        "per_tensor_us",
        "<=",
        5.0,
        "small-tensors vs large-tensors",
        EACH_TRANSPORT,
        scenario="small-tensors",
        baseline="large-tensors",
    ),
    Target(
        "{transport}: fp32 cast vs bf16",
        "gbps_ratio",
        ">=",
        0.9,
        "dense-fp32-cast / dense",
        EACH_TRANSPORT,
        scenario="dense-fp32-cast",
        baseline="dense",
    ),
    Target(
        "{transport}: adapter chain vs none",
        "gbps_ratio",
        ">=",
        0.9,
        "moe-chain / moe",
        EACH_TRANSPORT,
        scenario="moe-chain",
        baseline="moe",
    ),
    Target(
        "peak extra memory vs ring + largest tensor",
        "extra_memory",
        "<=",
        1.0,
        "worst side, every transport and scenario",
    ),
)

_COMPARE: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}


def _vs_bound(ok: Results, target: Target, transport: str | None) -> float | None:
    row = ok.get((str(transport), target.scenario))
    return None if row is None else row["vs_bound"]


def _vs_verl(ok: Results, target: Target, transport: str | None) -> float | None:
    row = ok.get((str(transport), target.scenario))
    return None if row is None else row.get("vs_verl")


def _gbps_ratio(ok: Results, target: Target, transport: str | None) -> float | None:
    row = ok.get((str(transport), target.scenario))
    base = ok.get((str(transport), str(target.baseline)))
    return None if row is None or base is None else float(row["gbps"] / base["gbps"])


def _per_tensor_us(ok: Results, target: Target, transport: str | None) -> float | None:
    """Microseconds a sync of ``scenario`` took per tensor beyond what its bytes cost at the
    per-byte rate of ``baseline`` (few large tensors): the fixed cost of a tensor."""
    row = ok.get((str(transport), target.scenario))
    base = ok.get((str(transport), str(target.baseline)))
    if row is None or base is None or row["tensors"] <= base["tensors"]:
        return None
    byte_cost = base["seconds"] / base["bytes"] * row["bytes"]
    return float((row["seconds"] - byte_cost) / (row["tensors"] - base["tensors"]) * 1e6)


def _extra_memory(ok: Results, target: Target, transport: str | None) -> float | None:
    within = [
        r["memory"][side]["extra_bytes"] / r["memory"]["budget_bytes"]
        for r in ok.values()
        for side in ("sender", "receiver")
    ]
    return max(within) if within else None


_METRICS: dict[str, Callable[[Results, Target, str | None], float | None]] = {
    "vs_bound": _vs_bound,
    "vs_verl": _vs_verl,
    "gbps_ratio": _gbps_ratio,
    "per_tensor_us": _per_tensor_us,
    "extra_memory": _extra_memory,
}


def evaluate_targets(
    results: list[dict[str, Any]], targets: tuple[Target, ...] = TARGETS
) -> list[dict[str, Any]]:
    """Each target's value in ``results`` and whether it is met, in table order (a run of
    per-transport targets listed transport by transport)."""
    ok: Results = {(r["transport"], r["scenario"]): r for r in results if r["ok"]}
    ran = list(dict.fromkeys(t for t, _ in ok))
    out: list[dict[str, Any]] = []
    for each, group in itertools.groupby(targets, lambda t: t.transport == EACH_TRANSPORT):
        rows = list(group)
        checks = [(t, tr) for tr in ran for t in rows] if each else [(t, t.transport) for t in rows]
        for target, transport in checks:
            value = _METRICS[target.metric](ok, target, transport)
            if value is None:
                continue
            out.append(
                {
                    "target": target.name.format(transport=transport),
                    "value": value,
                    "want": f"{target.comparison} {target.threshold}",
                    "met": _COMPARE[target.comparison](value, target.threshold),
                    "detail": target.detail,
                }
            )
    return out
