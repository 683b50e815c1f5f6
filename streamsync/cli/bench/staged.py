"""``streamsync bench --staged``: how long the engine stops generating for a staged sync
against a plain one, while requests run.

The demo's model (``dense-400m`` of :mod:`streamsync.testing.models`: a Qwen3 of about 400
MiB in bf16, random weights, built locally) is served in bf16 by one CPU ``AsyncLLM``, its
engine core in a process of its own, through one channel ``WeightSync(llm,
"zmq+tcp://127.0.0.1:0")``. Per run, two long greedy requests (``ignore_eos``) generate;
once they produce tokens steadily, one sync of the same weights goes through:

* **plain**: ``await sync.update(weights)``;
* **staged**: ``await sync.stage(weights)``, then ``await sync.commit(mode="keep")``.

After a warm-up of each, they alternate ``runs`` times. Per run: the sync's seconds as the
trainer waits for it (stage and commit together); the engine's **pause**, the longest gap
between two consecutive outputs of a running request that overlaps the sync's window
(beside the steady gap between outputs measured before it); the tokens every request
produced inside the window; and for a staged sync the commit's own seconds and the
workers' apply (the ``apply`` phase of the commit's report). Every request must still be
generating when the window ends (else its pause is cut short); the table says when one was
not.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamsync.sources import named_tensors

SCHEMA = "streamsync.cli.bench.staged/1"
#: The model the comparison uses (the demo's).
KIND = "dense-400m"
#: The channel's endpoint (port 0: the sender picks its own).
ENDPOINT = "zmq+tcp://127.0.0.1:0"
#: Target: the staged sync's pause over the plain sync's (medians).
PAUSE_TARGET = 0.25
#: Assumed host-to-device copy rate of a GPU engine's apply (GB/s, 1e9 bytes), for the
#: projection: an assumption, not measured here.
H2D_GBPS = 25.0
MODES = ("plain", "staged")
#: The models' ``max_position_embeddings``.
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class StagedConfig:
    """What to measure."""

    runs: int = 3
    timeout: float = 120.0
    kind: str = KIND
    #: Requests generating while each sync runs.
    requests: int = 2
    #: Each request's ``max_tokens``: enough to outlast a sync's window (checked); the
    #: model's positions (512) bound it.
    max_tokens: int = 500
    #: Outputs each request produces before a window opens; the steady gap is measured over
    #: the later half of them.
    lead: int = 12
    #: Outputs each request produces after a window closes before it is aborted.
    tail: int = 2


# -- what one run measures ----------------------------------------------------------------------
def window_figures(
    stamps: list[list[tuple[float, int]]], start: float, end: float
) -> dict[str, Any]:
    """The figures of one sync window ``[start, end]`` from each request's outputs, as
    ``(time, tokens so far)`` in order: ``pause_s``, the longest gap between two consecutive
    outputs of one request that overlaps the window; ``steady_gap_s``, the median gap
    between a request's consecutive outputs before the window (the later half of them);
    ``tokens``, what every request produced inside the window; ``outlasted``, whether every
    request produced an output after the window (else the pause may be cut short)."""
    pause = 0.0
    steady: list[float] = []
    tokens = 0
    outlasted = True
    for outputs in stamps:
        before = [t for t, _ in outputs if t <= start]
        gaps = [b - a for a, b in itertools.pairwise(before)]
        steady += gaps[len(gaps) // 2 :]
        for (a, _), (b, _) in itertools.pairwise(outputs):
            if b > start and a < end:
                pause = max(pause, b - a)
        at_start = max((n for t, n in outputs if t <= start), default=0)
        at_end = max((n for t, n in outputs if t <= end), default=0)
        tokens += at_end - at_start
        outlasted = outlasted and any(t > end for t, _ in outputs)
    return {
        "pause_s": pause,
        "steady_gap_s": statistics.median(steady) if steady else 0.0,
        "tokens": tokens,
        "outlasted": outlasted,
    }


# -- the run ----------------------------------------------------------------------------------
def run_staged_bench(
    config: StagedConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Start the engine, then the warm-ups and the alternating runs; plain data (the
    ``--json``)."""
    import anyio

    note = progress or (lambda label: None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from streamsync.testing.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="streamsync-bench-staged-") as tmp:
        note(f"staged: building {config.kind}")
        model = build_tiny_model(Path(tmp), config.kind, seed=0, dtype=torch.bfloat16)
        weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
        del model
        runs = anyio.run(_engine_runs, config, tmp, weights, note)
    model_bytes = sum(t.nbytes for t in weights.values())
    return {
        "schema": SCHEMA,
        "model": config.kind,
        "model_bytes": model_bytes,
        "runs": config.runs,
        "requests": config.requests,
        "max_tokens": config.max_tokens,
        "target": PAUSE_TARGET,
        "h2d_gbps": H2D_GBPS,
        "rows": {mode: [r for r in runs if r["mode"] == mode] for mode in MODES},
    }


async def _engine_runs(
    config: StagedConfig, path: str, weights: dict[str, torch.Tensor], note: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The engine on ``path`` for every run (warm-ups left out of what it returns)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.cli.bench.engine import _engine_core_mode
    from streamsync.vllm import WeightSync

    args = AsyncEngineArgs(
        model=path,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        max_num_seqs=max(4, config.requests),
        seed=0,
        worker_extension_cls="streamsync.vllm.WorkerExtension",
    )
    note("staged: starting the engine (AsyncLLM, engine core in a process of its own)")
    with _engine_core_mode(False):
        llm = AsyncLLM.from_engine_args(args)
    try:
        async with WeightSync(llm, ENDPOINT, timeout=config.timeout) as sync:
            await sync.update(_named(weights))  # the channel's first sync: not timed
            out = []
            for i in range(config.runs + 1):
                for mode in MODES:
                    label = "warm-up" if i == 0 else f"run {i} of {config.runs}"
                    note(f"staged: {mode}, {label}")
                    one = await _one_run(config, llm, sync, mode, weights)
                    if i > 0:
                        out.append({"mode": mode, **one})
            return out
    finally:
        llm.shutdown()


def _named(weights: dict[str, torch.Tensor]) -> Any:
    return named_tensors(weights)


async def _one_run(
    config: StagedConfig, llm: Any, sync: Any, mode: str, weights: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """One sync (``mode``) while ``config.requests`` requests generate: its figures."""
    import anyio
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens, ignore_eos=True)
    stamps: list[list[tuple[float, int]]] = [[] for _ in range(config.requests)]
    lead, after = anyio.Event(), anyio.Event()
    window: list[float] = []
    finished: list[bool] = [False] * config.requests

    def check() -> None:
        if not lead.is_set() and all(
            len(s) >= config.lead or done for s, done in zip(stamps, finished, strict=True)
        ):
            lead.set()
        if len(window) == 2 and all(
            sum(t > window[1] for t, _ in s) >= config.tail or done
            for s, done in zip(stamps, finished, strict=True)
        ):
            after.set()

    async def generate(r: int) -> None:
        prompt = {"prompt_token_ids": [1 + r, 2, 3, 4]}
        async for part in llm.generate(prompt, params, str(uuid.uuid4())):
            stamps[r].append((time.perf_counter(), len(part.outputs[0].token_ids)))
            check()
        finished[r] = True
        check()

    figures: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        for r in range(config.requests):
            tg.start_soon(generate, r)
        with anyio.fail_after(config.timeout):
            await lead.wait()
        start = time.perf_counter()
        if mode == "plain":
            report = await sync.update(_named(weights))
        else:
            report = await sync.stage(_named(weights))
            committing = time.perf_counter()
            committed = await sync.commit(mode="keep")
            figures["commit_s"] = time.perf_counter() - committing
            if "apply" in committed.phases:
                figures["apply_s"] = committed.phases["apply"]
            figures["stage_s"] = committing - start
        end = time.perf_counter()
        window[:] = [start, end]
        check()
        if not report.complete or report.missing:
            raise RuntimeError(f"sync incomplete: missing {list(report.missing)[:5]}")
        with anyio.fail_after(config.timeout):
            await after.wait()
        tg.cancel_scope.cancel()  # aborts the requests
    return {"seconds": end - start, **figures, **window_figures(stamps, start, end)}


# -- the table --------------------------------------------------------------------------------
def _span(values: list[float], spec: str = ".3f") -> str:
    """``median (min-max)``."""
    low, high, mid = min(values), max(values), statistics.median(values)
    if low == high:
        return format(mid, spec)
    return f"{mid:{spec}} ({low:{spec}}-{high:{spec}})"


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def format_staged(data: dict[str, Any]) -> str:
    """The comparison as a Markdown table, with the target's verdict and the projection."""
    mib = 2**20
    rows = data["rows"]
    lines = [
        f"Staged against plain syncs into one CPU vLLM AsyncLLM (engine core in a process of "
        f"its own): {data['model']}, bf16 ({data['model_bytes'] / mib:.1f} MiB per sync) over "
        f"zmq+tcp, while {data['requests']} greedy requests generate; {data['runs']} runs "
        "each after a warm-up, alternating over the same weights. Median (min-max) over the "
        "runs. Seconds: the sync as the trainer waits for it (stage and commit together); "
        "pause: the longest gap between two consecutive outputs of a request that overlaps "
        "the sync; steady gap: between outputs before it; tokens: what every request "
        "produced during the sync; commit: its seconds as the trainer waits (vLLM's pause, "
        "the apply, the version, the resume); apply: the slowest worker's copy of the staged "
        "version into the model",
        "",
        "| mode | sync s | commit s | apply s | pause s | steady gap s | tokens during sync "
        "| requests outlasted |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode in MODES:
        runs = rows.get(mode, [])
        if not runs:
            continue
        commit, apply = (
            _span([r[key] for r in runs]) if all(key in r for r in runs) else "-"
            for key in ("commit_s", "apply_s")
        )
        outlasted = sum(r["outlasted"] for r in runs)
        lines.append(
            f"| {mode} | {_span([r['seconds'] for r in runs])} | {commit} | {apply} "
            f"| {_span([r['pause_s'] for r in runs])} "
            f"| {_span([r['steady_gap_s'] for r in runs])} "
            f"| {_span([float(r['tokens']) for r in runs], '.0f')} "
            f"| {'yes' if outlasted == len(runs) else f'NO ({len(runs) - outlasted} runs)'} |"
        )
    lines += ["", *_verdicts(data)]
    return "\n".join(lines)


def _verdicts(data: dict[str, Any]) -> list[str]:
    """The pause ratio against its target, the requests' check, and the projection."""
    plain, staged = data["rows"].get("plain"), data["rows"].get("staged")
    if not plain or not staged:
        return []
    out = []
    short = [m for m in MODES if not all(r["outlasted"] for r in data["rows"][m])]
    if short:
        out.append(
            f"WARNING: some requests ended before the sync did ({', '.join(short)}): their "
            "pause is cut short; raise max_tokens"
        )
    plain_pause, staged_pause = _median(plain, "pause_s"), _median(staged, "pause_s")
    ratio = staged_pause / plain_pause if plain_pause > 0 else float("inf")
    met = "met" if ratio <= data["target"] else "MISSED"
    out.append(
        f"pause staged / plain {ratio:.2f} (medians: {staged_pause:.3f} s / {plain_pause:.3f} "
        f"s; target <= {data['target']:.2f}: {met})"
    )
    mib = 2**20
    model = data["model_bytes"]
    # The apply's host copy: the workers' own time where they report it, else the commit's.
    worker = all("apply_s" in r for r in staged)
    copy = _median(staged, "apply_s" if worker else "commit_s")
    copy_gbps = model / copy / 1e9 if copy > 0 else float("inf")
    overhead = staged_pause - copy
    h2d = model / (data["h2d_gbps"] * 1e9)
    what = "the workers' apply" if worker else "the commit's seconds"
    below = ", below zero: 0 is projected" if overhead < 0 else ""
    out.append(
        f"projection: a staged pause on a GPU engine ~ {model / mib:.1f} MiB / "
        f"{data['h2d_gbps']:g} GB/s H2D (an assumption, not measured) = {h2d:.3f} s + the "
        f"pause overhead measured here {overhead:.3f} s (staged pause {staged_pause:.3f} s "
        f"minus the apply's host copy {copy:.3f} s: {what}, {copy_gbps:.2f} GB/s{below}) = "
        f"{h2d + max(overhead, 0.0):.3f} s"
    )
    return out
