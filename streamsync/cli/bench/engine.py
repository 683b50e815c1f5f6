"""``streamsync bench --vllm``: a sync into a real vLLM engine against vLLM's own reload.

A Qwen3 of about 400 MiB in bf16 (``dense-400m`` of :mod:`streamsync.testing.models`,
random weights, built locally in seconds) is served by a vLLM engine in fp32, its engine
core in a process of its own as vLLM runs it (``--vllm-in-process``: in this one). In the
same run, alternating, each timed ``runs`` times after a warm-up:

* **reload**: vLLM's ``worker.reload_weights(weights_iterator=...)`` from tensors the worker
  holds in its own memory (read from the checkpoint once, before timing): the floor, with
  no transfer at all;
* **update_weights**: :class:`~streamsync.vllm.WeightSync` over ``shm://`` from the trainer's
  bf16 tensors, for each bucket size asked for.

Each pair runs for two wire dtypes, alternating within the pair:

* ``fp32``: reload from fp32 tensors (what the engine holds); update with ``cast(float32)``
  fused into packing (what the demo sends);
* ``bf16``: reload from the checkpoint's bf16 tensors; update with no pipeline (the
  default): both hand vLLM's weight loaders bf16, which they copy into the fp32 parameters.

Both are timed from the trainer's process, so each includes its RPC. The ratio (update /
reload, medians) is the figure; the sender's phases (waiting for a free slot, packing,
publishing, the end: the receiver's last loads and ``finalize``) say where the gap goes.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from streamsync.adapters import cast
from streamsync.sources import named_tensors
from streamsync.vllm import WeightSync
from streamsync.vllm.extension import WorkerExtension

#: The model the comparison uses.
KIND = "dense-400m"

#: The worker extension the comparison's engine runs (streamsync's, and the reload floor).
EXTENSION = "streamsync.cli.bench.engine.BenchWorkerExtension"


class BenchWorkerExtension(WorkerExtension):
    """streamsync's worker extension, plus the floor: vLLM's ``reload_weights`` from
    tensors this worker holds, wherever its engine core runs."""

    def streamsync_bench_hold(self, path: str) -> int:
        """Read the checkpoint in ``path`` into this worker's memory, as stored (bf16) and
        cast to fp32: private copies, not views of a mapped file. Returns the tensor count."""
        from safetensors import safe_open

        held: dict[str, dict[str, torch.Tensor]] = {"bf16": {}, "fp32": {}}
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    tensor = fh.get_tensor(name)
                    held["bf16"][name] = tensor.clone()
                    held["fp32"][name] = tensor.float()
        self.__dict__["_streamsync_bench_held"] = held
        return len(held["bf16"])

    def streamsync_bench_reload(self, wire: str) -> None:
        """vLLM's own reload from the held tensors of ``wire``'s dtype."""
        worker: Any = self
        held = self.__dict__["_streamsync_bench_held"][wire]
        worker.reload_weights(weights_iterator=iter(held.items()))


def run_engine_bench(
    bucket_sizes: list[int],
    *,
    runs: int,
    timeout: float,
    in_process: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the comparison; returns plain data (the ``engine`` part of ``--json``)."""
    with _engine_core_mode(in_process):
        return _run(bucket_sizes, runs=runs, timeout=timeout, progress=progress)


@contextlib.contextmanager
def _engine_core_mode(in_process: bool) -> Iterator[None]:
    """vLLM's switch for where the engine core runs, for the engine started inside; the
    caller's setting is put back after. (vLLM reads it when it starts an engine; once an
    in-process engine ran here it keeps what it read, which the result's ``engine_core``
    shows.)"""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = "0" if in_process else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _run(
    bucket_sizes: list[int],
    *,
    runs: int,
    timeout: float,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    note = progress or (lambda label: None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from streamsync.cli.verify import make_llm
    from streamsync.testing.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="streamsync-bench-vllm-") as tmp:
        note(f"vllm: building {KIND}")
        t0 = time.perf_counter()
        path = Path(tmp) / "model"
        trainer = build_tiny_model(path, KIND, seed=0, dtype=torch.bfloat16)
        build_s = time.perf_counter() - t0
        weights = {n: t.detach() for n, t in trainer.state_dict().items()}
        del trainer
        note("vllm: starting the engine")
        llm = make_llm(str(path), dtype="float32", worker_extension_cls=EXTENSION)
        try:
            core = type(llm.llm_engine.engine_core).__name__
            llm.collective_rpc("streamsync_bench_hold", args=(str(path),))
            nbytes = sum(t.numel() * 4 for t in weights.values())  # what the engine holds
            wires = {"fp32": cast(torch.float32), "bf16": None}

            def reload(wire: str) -> float:
                start = time.perf_counter()
                llm.collective_rpc("streamsync_bench_reload", args=(wire,))
                return time.perf_counter() - start

            reload("fp32")  # warm-up
            rows: list[dict[str, Any]] = []
            for size, wire in ((s, w) for s in bucket_sizes for w in wires):
                note(f"vllm: update_weights, buckets of {size >> 20} MiB, {wire} on the wire")
                pipeline = wires[wire]
                endpoint = f"shm://streamsync-bench-vllm-{os.getpid()}-{size}-{wire}"
                ref: list[float] = []
                ours: list[float] = []
                phases: list[dict[str, float]] = []
                with WeightSync(
                    llm, endpoint, pipeline=pipeline, bucket_bytes=size, timeout=timeout
                ) as channel:
                    # Warm-ups, the update last: every timed reload follows an update,
                    # as in the pairs (a reload right after a reload ran slower here).
                    reload(wire)
                    channel.update(named_tensors(weights))  # opens the ring
                    for _ in range(runs):
                        ref.append(reload(wire))
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
        "engine_core": "this process" if core == "InprocClient" else "own process",
        "engine_bytes": nbytes,
        "build_seconds": build_s,
        "runs": runs,
        "rows": rows,
    }


def format_engine_table(engine: dict[str, Any]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        f"Into vLLM: {engine['model']} ({engine['engine_bytes'] / 2**20:.0f} MiB per sync in "
        f"fp32, built in {engine['build_seconds']:.1f} s; engine core in "
        f"{engine.get('engine_core', 'this process')}), median of {engine['runs']} runs "
        "after a warm-up, alternating with vLLM's reload_weights from tensors of the wire's "
        "dtype in the worker's memory (fp32: update_weights casts to fp32 while packing; bf16: the "
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
