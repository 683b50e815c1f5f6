"""Tensor-parallel engines: ``WeightSync`` into a CPU vLLM with ``tensor_parallel_size=2``.

vLLM on CPU runs two workers (the ``mp`` executor) when each is given its own core
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every worker receives every bucket and loads its
shard. Dense, tied and Qwen3-MoE (through the expander) models, three syncs each, with
prefix caching on (32-token blocks) and the long prompt asked through the cache before and
after every sync; greedy tokens equal the trainer's and prompt logprobs match within 1e-5.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_harness import (
    LONG_PROMPT,
    PROMPTS,
    assert_matches,
    cached_greedy,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
)

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm

ALL = [*PROMPTS, LONG_PROMPT]


@pytest.mark.parametrize(
    ("kind", "transport"), [("dense", "shm"), ("tied", "zmq+tcp"), ("moe", "shm")]
)
def test_tensor_parallel_engine_three_syncs(
    kind: str, transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamsync.adapters import expand_moe
    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    model = "moe" if kind == "moe" else "dense"
    # Smaller MoE weights: the CPU MoE kernel sums experts in another order.
    trainer = build_tiny_model(
        tmp_path, model, seed=0, tied=kind == "tied", init_std=0.12 if kind == "moe" else None
    )
    pipeline = expand_moe(when="always", model_type="qwen3_moe") if kind == "moe" else None
    endpoint = {
        "shm": f"shm://tp-{kind}-{os.getpid()}",
        "zmq+tcp": "zmq+tcp://127.0.0.1:0",  # bound when the channel opens, after the engine
    }[transport]
    llm = make_llm(
        str(tmp_path),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        enable_prefix_caching=True,
        block_size=32,
    )
    try:
        assert engine_outputs(llm, ALL).tokens == reference_outputs(trainer, ALL).tokens
        with WeightSync(llm, endpoint, pipeline=pipeline, bucket_bytes=256 << 10) as sync:
            for step in range(3):
                cached_greedy(llm, [LONG_PROMPT])
                perturb(trainer, seed=20 * step + len(kind))
                want = reference_outputs(trainer, ALL)
                report = sync.update(ss.named_tensors(trainer))
                assert report.complete and report.receivers == 2
                assert sorted(report.instances) == ["worker0.main", "worker1.main"]
                assert all(r.missing == () for r in report.instances.values()), report
                assert_matches(engine_outputs(llm, ALL), want)
                assert cached_greedy(llm, [LONG_PROMPT])[0] == [want.tokens[-1]]
    finally:
        shutdown(llm)
