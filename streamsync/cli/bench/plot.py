"""The bench's results as a bar chart (matplotlib, imported when drawing)."""

from __future__ import annotations

from typing import Any

from streamsync.cli.bench.models import human
from streamsync.cli.bench.scenarios import TRANSPORTS


def plot(data: dict[str, Any], path: str) -> None:
    """End-to-end GB/s per transport and scenario, against each transport's bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if r["ok"]]
    transports = list(dict.fromkeys(r["transport"] for r in rows))
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    width = 0.8 / max(1, len(scenarios))
    for j, scenario in enumerate(scenarios):
        xs, ys = [], []
        for i, transport in enumerate(transports):
            for r in rows:
                if (r["transport"], r["scenario"]) == (transport, scenario):
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r["gbps"])
        ax.bar(xs, ys, width * 0.95, label=scenario)
    for i, transport in enumerate(transports):
        spec = TRANSPORTS[transport]
        bound = data["bounds"].get(spec.bound)
        if bound is not None:
            ax.hlines(bound["gbps"], i - 0.45, i + 0.45, colors="black", linestyles="dashed")
            ax.annotate(
                f"{spec.bound} {bound['gbps']:.2f}",
                (i, bound["gbps"]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=8,
            )
    memcpy = data["bounds"].get("memcpy")
    if memcpy is not None:
        ax.axhline(memcpy["gbps"], color="grey", linestyle="dotted", label="memcpy")
    ax.set_xticks(range(len(transports)), transports)
    ax.set_ylabel("GB/s end to end (median)")
    cfg, machine = data["config"], data["machine"]
    ax.set_title(
        f"streamsync bench: {human(cfg['size'])}, {machine['cpus']} CPUs, "
        f"{data['date'][:10]} (dashed: each transport's bound)"
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
