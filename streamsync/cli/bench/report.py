"""The bench's results as Markdown: the results table and the bounds."""

from __future__ import annotations

from typing import Any

from streamsync.cli.bench.models import MiB, human


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _cpu(row: dict[str, Any]) -> str:
    cpu = row.get("cpu_s")
    return "-" if cpu is None else f"{cpu['sender']:.2f} / {cpu['receiver']:.2f}"


def _threads(data: dict[str, Any]) -> str:
    """The torch thread setting the two-process paths ran with."""
    threads = data["config"].get("threads")
    if threads is None:
        default = data["machine"].get("torch_threads")
        return f"torch's default thread count ({default}) in every process"
    return f"torch.set_num_threads({threads}) in each two-process path's processes"


def _slots(data: dict[str, Any]) -> str:
    """The ring slots the transports ran with."""
    if data["config"].get("slots") is not None:
        return f"{data['config']['slots']} slots"
    by = {r["transport"]: r["slots"] for r in data.get("results", []) if "slots" in r}
    if len(set(by.values())) == 1:
        return f"{next(iter(by.values()))} slots (the transports' default)"
    listed = ", ".join(f"{t} {n}" for t, n in by.items())
    return f"each transport's default slots ({listed})"


def format_table(data: dict[str, Any]) -> str:
    """The results as a Markdown table, the bounds below it."""
    cfg = data["config"]
    lines = [
        f"{human(cfg['size'])} requested, buckets of {human(cfg['bucket_bytes'])} x "
        f"{_slots(data)}, {_threads(data)}, median of {cfg['runs']} runs after a "
        "warm-up; "
        f"{data['machine']['cpus']} CPUs, torch {data['machine']['torch']}",
        "",
        "| transport | scenario | GB/s | pack | transfer | load | bound | x bound "
        "| CPU s tx / rx | extra memory tx / rx (budget) | ok |",
        "|---|---|---:|---:|---:|---:|---|---:|---|---|---|",
    ]
    for r in data["results"]:
        if not r["ok"]:
            lines.append(f"| {r['transport']} | {r['scenario']} | FAILED: {r['error']} |")
            continue
        ph, mem = r["phases_gbps"], r["memory"]
        lines.append(
            f"| {r['transport']} | {r['scenario']} | {r['gbps']:.2f} | {_fmt(ph['pack'])} "
            f"| {_fmt(ph['transfer'])} | {_fmt(ph['load'])} | {r['bound']} "
            f"{_fmt(r['bound_gbps'])} | {_fmt(r['vs_bound'])} "
            f"| {_cpu(r)} | {mem['sender']['extra_bytes'] / MiB:.0f} / "
            f"{mem['receiver']['extra_bytes'] / MiB:.0f} MiB "
            f"({mem['budget_bytes'] / MiB:.0f}) "
            f"| {'yes' if r['verified'] and r['received_bytes'] == r['model_bytes'] else 'NO'} |"
        )
    lines += ["", "| bound | GB/s | what |", "|---|---:|---|"]
    for name, b in data["bounds"].items():
        at = f" (buckets of {human(b['bucket_bytes'])})" if "bucket_bytes" in b else ""
        lines.append(f"| {name} | {b['gbps']:.2f} | {b['what']}{at} |")
    return "\n".join(lines)
