"""``streamsync bench --vllm``: a sync into a real vLLM engine against vLLM's own reload.

A Qwen3 of about 400 MiB in bf16 (``dense-400m`` of :mod:`streamsync.testing.models`,
random weights, built locally in seconds) is served by an in-process vLLM engine in fp32.
In the same run, alternating, each timed ``runs`` times after a warm-up:

* **reload**: vLLM's ``worker.reload_weights(weights_iterator=...)`` from tensors already in
  the engine's process: the floor, with no transfer at all;
* **update_weights**: :class:`~streamsync.vllm.WeightSync` over ``shm://`` from the trainer's
  bf16 tensors, for each bucket size asked for.

Each pair runs for two wire dtypes, alternating within the pair:

* ``fp32``: reload from fp32 tensors (what the engine holds); update with ``cast(float32)``
  fused into packing (what the demo sends);
* ``bf16``: reload from the trainer's bf16 tensors; update with no pipeline (the default):
  both hand vLLM's weight loaders bf16, which they copy into the fp32 parameters.

The ratio (update / reload, medians) is the figure; the sender's phases (waiting for a free
slot, packing, publishing, the end: the receiver's last loads and ``finalize``) say where the
gap goes.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["format_engine_table", "run_engine_bench"]

#: The model the comparison uses.
KIND = "dense-400m"


def run_engine_bench(
    bucket_sizes: list[int],
    *,
    runs: int,
    timeout: float,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the comparison; returns plain data (the ``engine`` part of ``--json``)."""
    note = progress or (lambda label: None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from streamsync.adapters import cast
    from streamsync.cli.verify import make_llm
    from streamsync.sources import named_tensors
    from streamsync.testing.models import build_tiny_model
    from streamsync.vllm import WeightSync

    with tempfile.TemporaryDirectory(prefix="streamsync-bench-vllm-") as tmp:
        note(f"vllm: building {KIND}")
        t0 = time.perf_counter()
        trainer = build_tiny_model(Path(tmp) / "model", KIND, seed=0, dtype=torch.bfloat16)
        build_s = time.perf_counter() - t0
        weights = {n: t.detach() for n, t in trainer.state_dict().items()}
        del trainer
        note("vllm: starting the engine")
        llm = make_llm(str(Path(tmp) / "model"), dtype="float32")
        try:
            fp32 = {n: t.float() for n, t in weights.items()}  # what the engine holds
            nbytes = sum(t.nbytes for t in fp32.values())
            wires = {"fp32": (fp32, cast(torch.float32)), "bf16": (weights, None)}

            def reload(tensors: dict[str, torch.Tensor]) -> float:
                start = time.perf_counter()
                llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": iter(tensors.items())}
                )
                return time.perf_counter() - start

            reload(fp32)  # warm-up
            rows: list[dict[str, Any]] = []
            for size, wire in ((s, w) for s in bucket_sizes for w in wires):
                note(f"vllm: update_weights, buckets of {size >> 20} MiB, {wire} on the wire")
                in_memory, pipeline = wires[wire]
                endpoint = f"shm://streamsync-bench-vllm-{os.getpid()}-{size}-{wire}"
                ref: list[float] = []
                ours: list[float] = []
                phases: list[dict[str, float]] = []
                with WeightSync(
                    llm, endpoint, pipeline=pipeline, bucket_bytes=size, timeout=timeout
                ) as channel:
                    channel.update(named_tensors(weights))  # warm-up: opens the ring
                    reload(in_memory)
                    for _ in range(runs):
                        ref.append(reload(in_memory))
                        start = time.perf_counter()
                        report = channel.update(named_tensors(weights))
                        ours.append(time.perf_counter() - start)
                        phases.append(dict(report.phases))
                        if not report.complete or report.missing:
                            raise RuntimeError(f"sync incomplete: missing {report.missing[:5]}")
                med_ref, med_ours = statistics.median(ref), statistics.median(ours)
                rows.append(
                    {
                        "bucket_bytes": size,
                        "wire": wire,
                        "wire_bytes": report.nbytes,
                        "buckets": report.buckets,
                        "reload_s": ref,
                        "update_s": ours,
                        "reload_median_s": med_ref,
                        "update_median_s": med_ours,
                        "ratio": med_ours / med_ref,
                        "update_gbps": nbytes / med_ours / 1e9,
                        "phases_s": {
                            k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]
                        },
                    }
                )
        finally:
            with contextlib.suppress(Exception):  # best effort at exit
                llm.llm_engine.engine_core.shutdown()
    return {
        "model": KIND,
        "engine_bytes": nbytes,
        "build_seconds": build_s,
        "runs": runs,
        "rows": rows,
    }


def format_engine_table(engine: dict[str, Any]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        f"Into vLLM: {engine['model']} ({engine['engine_bytes'] / 2**20:.0f} MiB per sync in "
        f"fp32, built in {engine['build_seconds']:.1f} s), median of {engine['runs']} runs "
        "after a warm-up, alternating with vLLM's reload_weights from in-memory tensors of "
        "the wire's dtype (fp32: update_weights casts to fp32 while packing; bf16: the "
        "trainer's tensors as they are, which vLLM's loaders copy into fp32)",
        "",
        "| bucket | wire | buckets | reload s | update_weights s | ratio | GB/s | wait | pack "
        "| publish | end |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in engine["rows"]:
        ph = r["phases_s"]
        lines.append(
            f"| {r['bucket_bytes'] >> 20} MiB | {r.get('wire', 'fp32')} | {r['buckets']} "
            f"| {r['reload_median_s']:.3f} "
            f"| {r['update_median_s']:.3f} | {r['ratio']:.2f} | {r['update_gbps']:.2f} | "
            + " | ".join(f"{ph.get(k, 0.0):.3f}" for k in ("wait", "pack", "publish", "end"))
            + " |"
        )
    return "\n".join(lines)
