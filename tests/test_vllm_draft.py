"""Real syncs into the CPU build of vLLM with a draft model: both instances updated."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    assert_matches,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
    sync,
)

from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


def spec_metrics(llm: Any) -> dict[str, float]:
    return {
        m.name.removeprefix("vllm:spec_decode_"): m.value
        for m in llm.get_metrics()
        if "spec_decode" in m.name and hasattr(m, "value")
    }


def test_draft_model_both_instances_updated(tmp_path: Path) -> None:
    """A draft-model engine: the sync reaches the main model and the drafter. With both on
    the trainer's weights, every drafted token is accepted."""
    main_path, draft_path = tmp_path / "main", tmp_path / "draft"
    trainer = build_tiny_model(main_path, "dense", seed=0)
    build_tiny_model(draft_path, "dense", seed=1)  # a different drafter to start with
    llm = make_llm(
        str(main_path),
        disable_log_stats=False,
        speculative_config={
            "method": "draft_model",
            "model": str(draft_path),
            "num_speculative_tokens": 3,
        },
    )
    try:
        before = spec_metrics(llm)
        engine_outputs(llm)
        after = spec_metrics(llm)
        assert after["num_accepted_tokens"] - before["num_accepted_tokens"] < (
            after["num_draft_tokens"] - before["num_draft_tokens"]
        )
        # Three consecutive syncs, over shm and over zmq.
        endpoints = [
            f"shm://draft-{os.getpid()}",
            f"zmq+ipc://{tmp_path}/draft.sock",
            "zmq+tcp://127.0.0.1:0",  # bound when the channel opens
        ]
        for step in range(3):
            perturb(trainer, seed=300 + step)
            want = reference_outputs(trainer)
            report = sync(llm, trainer, endpoints[step])
            assert set(report.instances) == {"worker0.main", "worker0.drafter"}
            assert all(not r.missing for r in report.instances.values())
            before = spec_metrics(llm)
            assert_matches(engine_outputs(llm), want)
            after = spec_metrics(llm)
            drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            assert drafted > 0 and accepted == drafted
    finally:
        shutdown(llm)
