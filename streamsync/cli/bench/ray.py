"""``streamsync bench --ray``: the same sync into a vLLM engine hosted in a Ray actor and into
one made in this process, side by side.

The demo's model (``dense-400m`` of :mod:`streamsync.testing.models`: a Qwen3 of about 400
MiB in bf16, random weights, built locally), served in fp32 by two engines alike: an ``LLM``
made here and one made in a Ray actor (``ray.remote(LLM)``) on a local Ray runtime, each with
its engine core in a process of its own, as vLLM runs it. One
:class:`~streamsync.vllm.WeightSync` per engine over ``zmq+tcp`` on this node's address as Ray
reports it (``cast(float32)`` fused into packing) syncs the same weights, alternating,
``runs`` times after a warm-up of each; both engines then answer the fixed prompts alike.

The figures are the seconds of each sync, their medians and the ratio (actor /
in-process) against :data:`TARGET`: what driving the engine through its actor's handle costs.
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

from streamsync.adapters import cast

#: The model the comparison uses (the demo's).
KIND = "dense-400m"
#: The actor-hosted engine's sync seconds against the in-process engine's.
TARGET = 1.1
_QUIET = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_ray_bench(
    *,
    runs: int,
    timeout: float,
    progress: Callable[[str], None] | None = None,
    kind: str = KIND,
) -> dict[str, Any]:
    """Run the comparison (``kind``: the model of :mod:`streamsync.testing.models`, the
    demo's by default); returns plain data (the ``--json``)."""
    note = progress or (lambda label: None)
    for key, value in _QUIET.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import ray
    from vllm import LLM

    from streamsync.cli.verify import PROMPTS, engine_outputs, llm_options, outputs_from, sampling
    from streamsync.testing.models import build_tiny_model
    from streamsync.vllm import WeightSync
    from streamsync.vllm.ray import node_address

    started_ray = not ray.is_initialized()
    if started_ray:
        note("ray: starting a local Ray runtime")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    here_s: list[float] = []
    actor_s: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="streamsync-bench-ray-") as tmp:
            note(f"ray: building {kind}")
            model = build_tiny_model(Path(tmp) / "model", kind, seed=0, dtype=torch.bfloat16)
            options = llm_options(str(Path(tmp) / "model"))
            note("ray: starting the engine in this process and the engine in an actor")
            env = {"runtime_env": {"env_vars": dict(_QUIET)}}
            actor: Any = ray.remote(LLM).options(num_cpus=0, **env).remote(**options)
            llm = LLM(**options)
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=timeout)
                endpoint = f"zmq+tcp://{node_address()}:0"
                opened = {"pipeline": cast(torch.float32), "timeout": timeout}
                with (
                    WeightSync(llm, endpoint, **opened) as here,
                    WeightSync(actor, endpoint, **opened) as there,
                ):
                    note("ray: warm-up")
                    here.update(model)
                    there.update(model)
                    for i in range(runs):
                        note(f"ray: run {i + 1} of {runs}")
                        for sync, seconds in ((here, here_s), (there, actor_s)):
                            start = time.perf_counter()
                            report = sync.update(model)
                            seconds.append(time.perf_counter() - start)
                            if not report.complete or report.missing:
                                raise RuntimeError(f"sync incomplete: missing {report.missing[:5]}")
                requests = [{"prompt_token_ids": p} for p in PROMPTS]
                theirs = outputs_from(
                    ray.get(actor.generate.remote(requests, sampling(), use_tqdm=False))
                )
                ours = engine_outputs(llm)
                same = ours.tokens == theirs.tokens and ours.max_logprob_diff(theirs) == 0
            finally:
                ray.kill(actor)
                with contextlib.suppress(Exception):  # best effort at exit
                    llm.llm_engine.engine_core.shutdown()
    finally:
        if started_ray:
            ray.shutdown()
    return {
        "model": kind,
        "runs": runs,
        "bytes": report.nbytes,
        "in_process_s": here_s,
        "actor_s": actor_s,
        "in_process_median_s": statistics.median(here_s),
        "actor_median_s": statistics.median(actor_s),
        "ratio": statistics.median(actor_s) / statistics.median(here_s),
        "target": TARGET,
        "verified": same,
    }


def format_ray_table(data: dict[str, Any]) -> str:
    """The comparison as a Markdown table."""

    def spread(values: list[float]) -> str:
        return f"{min(values):.3f}-{max(values):.3f}"

    met = "met" if data["ratio"] <= data["target"] else "MISSED"
    same = "yes" if data["verified"] else "NO"
    return "\n".join(
        [
            f"A sync into a vLLM engine in a Ray actor against one in this process: "
            f"{data['model']} ({data['bytes'] / 2**20:.0f} MiB fp32 on the wire, zmq+tcp), "
            f"{data['runs']} runs each after a warm-up, alternating",
            "",
            "| engine | median s | range s |",
            "|---|---:|---:|",
            f"| in this process | {data['in_process_median_s']:.3f} "
            f"| {spread(data['in_process_s'])} |",
            f"| in a Ray actor | {data['actor_median_s']:.3f} | {spread(data['actor_s'])} |",
            "",
            f"actor / in-process: {data['ratio']:.2f} (target <= {data['target']:.1f}: {met}); "
            f"both engines answer alike: {same}",
        ]
    )
