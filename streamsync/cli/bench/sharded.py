"""``streamsync bench --sharded``: sharded syncs into TP=2 vLLM engines against the full fan-out.

The demo's model (``dense-400m`` of :mod:`streamsync.testing.models`: a Qwen3 of about 400
MiB in bf16, random weights, built locally) is served in bf16 by one or two CPU vLLM
engines with ``tensor_parallel_size=2``, each engine core and worker in a process of its
own. Per transport, in the same run, after a warm-up of each and alternating ``runs`` times
over the same weights:

* **full**: ``WeightSync(llms, endpoint, sharded=False)``, every worker receives every
  tensor whole (today's fan-out);
* **sharded**: ``WeightSync(llms, endpoint, sharded=True)``, each worker receives only the
  slices its loaders read, one sender per worker layout.

Then **sharded+delta**: ``WeightSync(..., sharded=True, delta=True)`` after a cold sync,
``runs`` syncs each after an AdamW step at ``lr`` on fp32 master weights (random gradients,
as ``bench --delta`` trains), bf16 on the wire.

Per row: the seconds of each sync as the trainer waits for it (its RPCs included), the
bytes the busiest worker received, the bytes the trainer sent (``rank_bytes``), and the
bound: what a worker must receive, ``(model - replicated) / TP + replicated``, where
``replicated`` are the tensors every worker reads whole (from the sharded channel's
``needs``). Each engine's greedy outputs after the sharded and the delta syncs are checked
against those after a full sync of the same weights.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamsync.boxes import slices_of
from streamsync.cli.bench.engine import _engine_core_mode
from streamsync.facts import Needs
from streamsync.sources import named_tensors
from streamsync.vllm import WeightSync

SCHEMA = "streamsync.cli.bench.sharded/1"
#: The model the comparison uses (the demo's).
KIND = "dense-400m"
#: Tensor-parallel workers per engine.
TP = 2
#: The transports it runs over (port 0: each route's sender picks its own).
SHARDED_TRANSPORTS: dict[str, str] = {
    "zmq+tcp": "zmq+tcp://127.0.0.1:0",
    "torch+gloo": "torch+gloo://127.0.0.1:0",
}
#: Targets: the busiest worker's bytes over the bound; a sharded sync's seconds over the
#: full fan-out's (over zmq+tcp to one engine).
BYTES_TARGET = 1.05
SECONDS_TARGET = 0.6
MODES = ("full", "sharded", "sharded+delta")


@dataclass(frozen=True)
class ShardedConfig:
    """What to measure."""

    engines: int = 1
    transports: tuple[str, ...] = tuple(SHARDED_TRANSPORTS)
    runs: int = 3
    lr: float = 1e-5
    timeout: float = 120.0
    kind: str = KIND


@dataclass(frozen=True)
class Bound:
    """What each worker of a TP engine must receive of a model."""

    model_bytes: int
    #: Bytes of the tensors every worker reads whole.
    replicated_bytes: int
    tp: int

    @property
    def worker_bytes(self) -> int:
        """``(model - replicated) / TP + replicated``: each split byte once, the rest whole."""
        return math.ceil((self.model_bytes - self.replicated_bytes) / self.tp) + (
            self.replicated_bytes
        )


def bound_of(needs: Mapping[str, Needs], sizes: Mapping[str, int], tp: int) -> Bound:
    """The :class:`Bound` of a model whose tensors' wire bytes are ``sizes``, from a sharded
    channel's ``needs`` (keyed ``<worker>.<instance>``): a tensor is replicated when every
    worker reads it whole."""
    per_worker: dict[str, list[Needs]] = {}
    for key, one in needs.items():
        per_worker.setdefault(key.rpartition(".")[0], []).append(one)
    whole: set[str] | None = None
    for found in per_worker.values():
        read = {need.name for one in found for need in one.needs}
        mine = read - set(slices_of(found))
        whole = mine if whole is None else whole & mine
    replicated = sum(sizes[n] for n in whole or () if n in sizes)
    return Bound(sum(sizes.values()), replicated, tp)


# -- the run ----------------------------------------------------------------------------------
def run_sharded_bench(
    config: ShardedConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Start the engines, then every transport's full, sharded and delta syncs; plain data
    (the ``--json``)."""
    note = progress or (lambda label: None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # One core per worker; two engines on two cores share them.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(TP))))
    from streamsync.testing.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="streamsync-bench-sharded-") as tmp:
        note(f"sharded: building {config.kind}")
        trainer = build_tiny_model(Path(tmp), config.kind, seed=0, dtype=torch.bfloat16)
        master = {n: t.detach().float() for n, t in trainer.state_dict().items()}
        del trainer
        with _engines(tmp, config.engines, note) as llms:
            trained = _Trainer(master, config.lr)
            rows = []
            for transport in config.transports:
                rows += _transport_rows(config, transport, llms, trained, note)
    return {
        "schema": SCHEMA,
        "model": config.kind,
        "model_bytes": sum(t.numel() for t in master.values()) * torch.bfloat16.itemsize,
        "engines": config.engines,
        "tp": TP,
        "runs": config.runs,
        "lr": config.lr,
        "targets": {"bytes": BYTES_TARGET, "seconds": SECONDS_TARGET},
        "rows": rows,
    }


@contextlib.contextmanager
def _engines(path: str, count: int, note: Callable[[str], None]) -> Iterator[Any]:
    """``count`` TP engines on ``path`` (a list with two or more, as ``WeightSync`` takes
    several), each engine core in a process of its own; shut down after."""
    from streamsync.cli.verify import make_llm

    llms: list[Any] = []
    with _engine_core_mode(False):
        try:
            for e in range(count):
                note(f"sharded: starting engine {e} (TP={TP})")
                llms.append(
                    make_llm(
                        path,
                        dtype="bfloat16",
                        tensor_parallel_size=TP,
                        distributed_executor_backend="mp",
                    )
                )
            yield llms if count > 1 else llms[0]
        finally:
            for llm in llms:
                with contextlib.suppress(Exception):  # best effort at exit
                    llm.llm_engine.engine_core.shutdown()


class _Trainer:
    """fp32 master weights trained by AdamW on random gradients; bf16 on the wire."""

    def __init__(self, master: dict[str, torch.Tensor], lr: float) -> None:
        self.params = {n: torch.nn.Parameter(t) for n, t in master.items()}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr)
        self.generator = torch.Generator().manual_seed(0)
        self.weights = self._wire()

    def _wire(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()}

    def step(self) -> float:
        """One step; returns the fraction of bf16 elements it changed."""
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.generator)
        self.optimizer.step()
        before, self.weights = self.weights, self._wire()
        changed = sum(
            int((self.weights[n].view(torch.int16) != b.view(torch.int16)).sum())
            for n, b in before.items()
        )
        return changed / sum(t.numel() for t in before.values())


def _timed(sync: Any, weights: dict[str, torch.Tensor]) -> tuple[float, Any]:
    start = time.perf_counter()
    report = sync.update(named_tensors(weights))
    seconds = time.perf_counter() - start
    if not report.complete or report.missing:
        raise RuntimeError(f"sync incomplete: missing {list(report.missing)[:5]}")
    return seconds, report


def _outputs(llms: Any) -> list[Any]:
    from streamsync.cli.verify import engine_outputs

    return [engine_outputs(llm) for llm in (llms if isinstance(llms, list) else [llms])]


def _row(transport: str, mode: str, runs: list[tuple[float, Any]]) -> dict[str, Any]:
    reports = [r for _, r in runs]
    phases = dict.fromkeys(p for r in reports for p in r.phases)
    return {
        "transport": transport,
        "mode": mode,
        "seconds": [s for s, _ in runs],
        "worker_bytes": reports[-1].worker_bytes,
        "max_worker_bytes": max(max(r.worker_bytes.values()) for r in reports),
        "all_workers_bytes": max(sum(r.worker_bytes.values()) for r in reports),
        "rank_bytes": max(r.rank_bytes.get(0, 0) for r in reports),
        "unsliced": sorted({n for r in reports for n in r.unsliced}),
        # The sender's phases (medians); ``end``: after the last bucket, until the workers
        # reported (their last loads and the engine's finalize).
        "phases_s": {p: statistics.median(r.phases.get(p, 0.0) for r in reports) for p in phases},
    }


def _transport_rows(
    config: ShardedConfig, transport: str, llms: Any, trained: _Trainer, note: Callable[[str], None]
) -> list[dict[str, Any]]:
    """One transport's three rows: full and sharded alternating, then sharded deltas."""
    url = SHARDED_TRANSPORTS[transport]
    opts = {"timeout": config.timeout}
    runs: dict[str, list[tuple[float, Any]]] = {"full": [], "sharded": []}
    with (
        WeightSync(llms, url, sharded=False, **opts) as full,
        WeightSync(llms, url, sharded=True, **opts) as sharded,
    ):
        sizes = {n: t.nbytes for n, t in trained.weights.items()}
        bound = bound_of(sharded.needs, sizes, TP)
        note(f"sharded: {transport}, warm-up")
        pair = {"full": full, "sharded": sharded}
        for sync in pair.values():
            _timed(sync, trained.weights)
        for i in range(config.runs):
            note(f"sharded: {transport}, full and sharded, run {i + 1} of {config.runs}")
            for mode, sync in pair.items():
                runs[mode].append(_timed(sync, trained.weights))
        after_sharded = _outputs(llms)
        _timed(full, trained.weights)
        verified = {"sharded": _outputs(llms) == after_sharded}
        changed: list[float] = []
        with WeightSync(llms, url, sharded=True, delta=True, **opts) as delta:
            _timed(delta, trained.weights)  # cold: no baseline on the workers yet
            runs["sharded+delta"] = []
            for i in range(config.runs):
                note(f"sharded: {transport}, delta after step {i + 1} of {config.runs}")
                changed.append(trained.step())
                runs["sharded+delta"].append(_timed(delta, trained.weights))
        after_delta = _outputs(llms)
        _timed(full, trained.weights)
        verified["sharded+delta"] = _outputs(llms) == after_delta
    rows = []
    for mode, done in runs.items():
        row = {**_row(transport, mode, done), "bound_bytes": bound.worker_bytes}
        row["verified"] = verified.get(mode)  # None: the reference
        row["replicated_bytes"] = bound.replicated_bytes
        if mode == "sharded+delta":
            row["changed_fraction"] = changed
        rows.append(row)
    return rows


# -- the table --------------------------------------------------------------------------------
def _span(values: list[float], spec: str = ".3f") -> str:
    low, high = min(values), max(values)
    return format(low, spec) if low == high else f"{low:{spec}}-{high:{spec}}"


_VERIFIED = {True: "yes", False: "NO", None: "reference"}


def format_sharded(data: dict[str, Any]) -> str:
    """The comparison as a Markdown table, with the targets' verdicts below it."""
    mib = 2**20
    engines, rows = data["engines"], data["rows"]
    replicated = rows[0]["replicated_bytes"] if rows else 0
    lines = [
        f"Sharded syncs into {engines} TP={data['tp']} CPU vLLM engine{'s' * (engines > 1)}: "
        f"{data['model']}, bf16 ({data['model_bytes'] / mib:.1f} MiB per full sync); "
        f"{data['runs']} runs each after a warm-up, full and sharded alternating over the same "
        f"weights; sharded+delta: after AdamW steps at lr {data['lr']:g} (fp32 master "
        "weights). Seconds: min-max over the runs, as the trainer waits for each sync; end: "
        "the sender's wait for the workers' reports after its last bucket (median). MiB "
        "per rank: what the trainer's one rank streamed (once per route); to all workers: "
        "what the workers received together; bound: (model - replicated) / TP + replicated "
        f"({replicated / 1024:.0f} KiB replicated)",
        "",
        "| transport | mode | seconds | end s | MiB per worker (max) | MiB to all workers "
        "| MiB per rank | bound MiB | x bound | verified |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['transport']} | {r['mode']} | {_span(r['seconds'])} "
            f"| {r['phases_s'].get('end', 0.0):.3f} "
            f"| {r['max_worker_bytes'] / mib:.1f} | {r['all_workers_bytes'] / mib:.1f} "
            f"| {r['rank_bytes'] / mib:.1f} "
            f"| {r['bound_bytes'] / mib:.1f} | {r['max_worker_bytes'] / r['bound_bytes']:.3f} "
            f"| {_VERIFIED[r['verified']]} |"
        )
    changed = [f for r in rows for f in r.get("changed_fraction", ())]
    if changed:
        lines += ["", f"bf16 elements each step changed: {_span(changed, '.2%')}"]
    lines += ["", *_verdicts(data)]
    return "\n".join(lines)


def _verdicts(data: dict[str, Any]) -> list[str]:
    """The targets, per transport: the sharded bytes over the bound; its seconds over the
    full fan-out's (medians)."""
    targets = data["targets"]
    by = {(r["transport"], r["mode"]): r for r in data["rows"]}
    out = []
    for transport in dict.fromkeys(r["transport"] for r in data["rows"]):
        sharded, full = by.get((transport, "sharded")), by.get((transport, "full"))
        if sharded is None or full is None:
            continue
        ratio = sharded["max_worker_bytes"] / sharded["bound_bytes"]
        seconds = statistics.median(sharded["seconds"]) / statistics.median(full["seconds"])
        met_bytes = "met" if ratio <= targets["bytes"] else "MISSED"
        met_s = "met" if seconds <= targets["seconds"] else "MISSED"
        out.append(
            f"{transport}: bytes per worker / bound {ratio:.3f} (target <= "
            f"{targets['bytes']:.2f}: {met_bytes}); seconds sharded / full {seconds:.2f} "
            f"(medians; target <= {targets['seconds']:.2f}: {met_s})"
        )
    return out
