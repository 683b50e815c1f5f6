"""The project's targets for ``streamsync bench``'s figures, as a table: each is a metric of
a run's results, compared with a threshold; :func:`evaluate_targets` evaluates the whole
table and :func:`format_targets` writes it, each target with what it means for a user.

Run from the repository root on the JSON of a bench run::

    .venv/bin/streamsync bench --json out/bench.json
    .venv/bin/python benchmarks/targets.py out/bench.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["EACH_TRANSPORT", "TARGETS", "Target", "evaluate_targets", "format_targets"]

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
    #: What the figure means for a user, in words.
    meaning: str = ""
    #: A value below this is not a measurement but the noise of the runs it was fitted
    #: from: reported as such, neither met nor missed.
    noise_below: float | None = None


TARGETS: tuple[Target, ...] = (
    Target(
        "shm vs two memcpys at once",
        "vs_bound",
        ">=",
        0.8,
        "dense bf16",
        "shm",
        meaning="the share of this machine's memory bandwidth a sync over shm gets: any "
        "shared-memory path copies the weights twice, so 1.0 is the most there is",
    ),
    Target(
        "shm vs verl's shared-memory path",
        "vs_verl",
        ">=",
        3.0,
        "dense bf16",
        "shm",
        meaning="how many times faster a sync over shm is than verl's shared-memory weight "
        "transfer moving the same model on the same machine",
    ),
    Target(
        "zmq+tcp vs raw pyzmq tcp",
        "vs_bound",
        ">=",
        0.9,
        "dense bf16",
        "zmq+tcp",
        meaning="the share of raw pyzmq's speed over the same socket a sync over zmq+tcp "
        "gets: what the library costs on top of the network",
    ),
    Target(
        "{transport}: 16 KiB tensors vs 8 MiB tensors",
        "gbps_ratio",
        ">=",
        0.5,
        "small-tensors / large-tensors",
        EACH_TRANSPORT,
        scenario="small-tensors",
        baseline="large-tensors",
        meaning="the share of its speed on large tensors a sync keeps on a model of many "
        "small ones (FP8 scales, per-expert weights)",
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
        meaning="what each tensor adds to a sync beyond its bytes, sender and receiver "
        "together: at 5 us, a model of 100,000 tensors spends half a second on them",
        noise_below=0.0,
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
        meaning="the share of a bf16 sync's speed a sync of fp32 master weights keeps when "
        "they are cast to bf16 on the way (pipeline=cast(bf16))",
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
        meaning="the share of its speed a sync of an MoE model keeps through "
        "expand_moe | split_buffers | cast, against sending it as it is",
    ),
    Target(
        "peak extra memory vs ring + largest tensor",
        "extra_memory",
        "<=",
        1.0,
        "worst side, every transport and scenario",
        meaning="the most memory a sync took beyond the model, on either side, against "
        "the ring's slots plus the largest tensor: above 1.0 a sync needs more than that",
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
            out.append(_verdict(target, transport, value))
    return out


def _verdict(target: Target, transport: str | None, value: float) -> dict[str, Any]:
    """One evaluated target: ``met`` True or False, or None where the value is noise."""
    noise = target.noise_below is not None and value < target.noise_below
    met = None if noise else _COMPARE[target.comparison](value, target.threshold)
    return {
        "target": target.name.format(transport=transport),
        "value": value,
        "want": f"{target.comparison} {target.threshold}",
        "met": met,
        "verdict": "noise" if noise else "met" if met else "missed",
        "detail": target.detail,
        "meaning": target.meaning,
    }


_VERDICTS = {
    "met": "yes",
    "missed": "NO",
    "noise": "noise: below what these runs resolve (more --runs, a larger --size)",
}


def format_targets(targets: list[dict[str, Any]], bounds: dict[str, Any] | None = None) -> str:
    """The evaluated targets as a Markdown table, each with what it means for a user; with
    the run's ``bounds``, what the fused cast's own bound allows of its target."""
    lines = ["| target | value | want | met | what it means |", "|---|---:|---:|---|---|"]
    for t in targets:
        lines.append(
            f"| {t['target']} ({t['detail']}) | {t['value']:.2f} | {t['want']} "
            f"| {_VERDICTS[t['verdict']]} | {t['meaning']} |"
        )
    return "\n".join(lines + cast_ceiling(bounds or {}))


def cast_ceiling(bounds: dict[str, Any]) -> list[str]:
    """What the fused cast's own bound allows of the cast target, where both were measured:
    the cast can be no faster than ``cast_split``, so a bf16 sync that meets its target
    leaves the cast at most ``cast_split / (two_copy_parallel x that target)`` of it."""
    if "cast_split" not in bounds or "two_copy_parallel" not in bounds:
        return []
    dense = next(t for t in TARGETS if t.metric == "vs_bound" and t.transport == "shm")
    cast = next(t for t in TARGETS if t.scenario == "dense-fp32-cast")
    ceiling = bounds["cast_split"]["gbps"] / bounds["two_copy_parallel"]["gbps"]
    return [
        "",
        f"The fp32 cast's own bound (cast_split) is {ceiling:.2f} of two memcpys at once: "
        f"beside a bf16 sync at the {dense.threshold:.2f} of them it is asked for, the cast "
        f"can reach at most {ceiling / dense.threshold:.2f} of bf16, with no overheads at "
        f"all (its target: {cast.threshold:.2f}).",
    ]


def main() -> None:
    """The command line: the targets of a ``streamsync bench --json`` run."""
    parser = argparse.ArgumentParser(description="the project's targets, on a bench run")
    parser.add_argument("json", help="what streamsync bench --json wrote")
    data = json.loads(Path(parser.parse_args().json).read_text())
    print(format_targets(evaluate_targets(data["results"]), data["bounds"]))


if __name__ == "__main__":
    main()
