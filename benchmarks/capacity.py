"""The capacity model of BENCHMARKS.md: bytes on the busiest NIC and seconds per weight sync,
by arithmetic, from one trainer to N tensor-parallel engines, for each way of moving bytes.

A sync takes the busiest NIC's bytes over the delivered rate B: each trainer NIC sends and
each engine NIC receives at once, the fabric is non-blocking, latency and packing are free.
Trainer: M FSDP2 ranks, one GPU and one 400 Gb/s NIC each (8 per node), rank m holding
model/M. Engine: TP=8 workers on one node with one NIC per GPU (``--engine-nics``); a worker
reads model/TP of every tensor, plus the replicated ones (norms: counted as nothing). Delta:
the wire shrinks by the measured wire share w of a steady-state delta, on every slice alike,
the comparison run on the GPU that holds the shard (milliseconds, not counted).

Run: python benchmarks/capacity.py [--gbps 45] [--delta-wire 0.065] [--engine-nics 8]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ENGINES", "MODELS", "Mode", "Model", "modes", "seconds", "table"]

#: Tensor-parallel workers per engine: one engine is one node of 8 GPUs.
TP = 8
#: Fleet sizes, in engines.
ENGINES = (8, 64, 512)


@dataclass(frozen=True)
class Model:
    """A checkpoint as it travels: ``nbytes`` per full copy."""

    name: str
    nbytes: float


#: 70B in bf16; 1.03e12 parameters in FP8 with an fp32 scale per 128x128 block.
MODELS = (
    Model("70B bf16", 70e9 * 2),
    Model("1T FP8", 1.03e12 * (1 + 4 / 128**2)),
)


@dataclass(frozen=True)
class Mode:
    """One way of moving a sync's bytes: bytes per busiest NIC on each side.

    ``sender`` maps (model bytes S, engines N) to the bytes of one trainer NIC; ``engine`` maps
    S to the bytes into one engine node, spread over ``lanes`` of its NICs.
    """

    name: str
    sender_nics: int
    sender_formula: str
    engine_formula: str
    sender: Callable[[float, int], float]
    engine: Callable[[float], float]
    lanes: int


def modes(trainer_ranks: tuple[int, ...], wire: float, engine_nics: int) -> list[Mode]:
    """Today's fan-out, the broadcast ring, its sharded form, and sharded point-to-point
    (dense, then delta at wire share ``wire``) from each of ``trainer_ranks`` sender NICs."""
    per_worker = min(TP, engine_nics)
    found = [
        Mode(
            "full fan-out, 1 NIC (today)",
            1,
            "8·N·S",
            "8·S",
            lambda s, n: TP * n * s,
            lambda s: TP * s,
            per_worker,
        ),
        Mode("ring/tree, 1 NIC", 1, "S", "S", lambda s, n: s, lambda s: s, 1),
        Mode(
            "sharded ring, 8 NICs",
            TP,
            "S/8",
            "S",
            lambda s, n: s / TP,
            lambda s: s,
            per_worker,
        ),
    ]
    for share, label in ((1.0, "sharded"), (wire, "sharded + delta")):
        w = "" if share == 1.0 else "w·"
        for m in trainer_ranks:
            found.append(
                Mode(
                    f"{label}, M = {m}",
                    m,
                    f"{w}N·S/{m}",
                    f"{w}S",
                    lambda s, n, m=m, share=share: share * n * s / m,
                    lambda s, share=share: share * s,
                    per_worker,
                )
            )
    return found


def busiest(mode: Mode, model: Model, engines: int) -> float:
    """Bytes on the busiest NIC, sender or engine side."""
    return max(mode.sender(model.nbytes, engines), mode.engine(model.nbytes) / mode.lanes)


def seconds(mode: Mode, model: Model, engines: int, rate: float) -> float:
    """One sync's time at ``rate`` bytes per second per NIC."""
    return busiest(mode, model, engines) / rate


def _num(x: float) -> str:
    """Two significant figures below 10, whole numbers with thousands separators above."""
    return f"{x:,.0f}" if x >= 10 else f"{x:#.2g}"


def _gb(nbytes: float) -> str:
    return f"{_num(nbytes / 1e12)} TB" if nbytes >= 1e13 else f"{_num(nbytes / 1e9)} GB"


def _time(s: float) -> str:
    if s >= 3600:
        return f"{_num(s)} s ({s / 3600:.1f} h)"
    return f"{_num(s)} s ({s / 60:.0f} min)" if s >= 600 else f"{_num(s)} s"


def table(found: list[Mode], rate: float) -> list[str]:
    """The markdown lines: each mode's bytes per NIC, then each model and fleet's seconds
    and bytes per sender NIC under each mode."""
    lines = [
        "| mode | sender NICs | bytes per sender NIC | into one engine node | "
        + " | ".join(f"per engine NIC, {m.name}" for m in MODELS)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(MODELS),
    ]
    for mode in found:
        per_nic = " | ".join(_gb(mode.engine(m.nbytes) / mode.lanes) for m in MODELS)
        nics = f"{mode.lanes} NIC" + ("s" if mode.lanes > 1 else "")
        lines.append(
            f"| {mode.name} | {mode.sender_nics} | {mode.sender_formula} | "
            f"{mode.engine_formula} over {nics} | {per_nic} |"
        )
    lines += ["", "| model → engines | " + " | ".join(m.name for m in found) + " |"]
    lines.append("|---|" + "---:|" * len(found))
    for model in MODELS:
        for n in ENGINES:
            cells = (
                f"{_time(seconds(mode, model, n, rate))}, {_gb(mode.sender(model.nbytes, n))}"
                for mode in found
            )
            lines.append(f"| {model.name} → {n} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gbps", type=float, default=45.0, help="GB/s delivered per 400 Gb/s NIC (line: 50)"
    )
    parser.add_argument(
        "--delta-wire", type=float, default=0.065, help="a delta's wire share w (lr 1e-6)"
    )
    parser.add_argument("--trainer-ranks", default="8,64", help="M: trainer GPUs, one NIC each")
    parser.add_argument("--engine-nics", type=int, default=8, help="NICs per engine node")
    args = parser.parse_args(argv)
    ranks = tuple(int(m) for m in args.trainer_ranks.split(","))
    found = modes(ranks, args.delta_wire, args.engine_nics)
    print(
        f"TP={TP} engines, {args.engine_nics} NICs per engine node, "
        f"B = {args.gbps:g} GB/s per NIC, w = {args.delta_wire:g}; "
        "cells: seconds (the busiest NIC's bytes / B), bytes per sender NIC"
    )
    print()
    print("\n".join(table(found, args.gbps * 1e9)))


if __name__ == "__main__":
    main()
