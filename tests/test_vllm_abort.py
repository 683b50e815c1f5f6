"""A failed sync into a real vLLM engine is aborted on the worker: the layers still waiting
for weights get their processed tensors back, so the engine keeps serving (without the
abort, meta tensors stay in the model and the next step fails), and the next sync applies.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from vllm_harness import assert_matches, engine_outputs, make_llm, reference_outputs, shutdown, sync

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


def test_failed_sync_leaves_the_engine_serving(tmp_path: Path) -> None:
    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0)
    llm = make_llm(str(tmp_path / "model"))
    endpoint = f"shm://abort-{os.getpid()}"
    try:
        name = "model.layers.1.mlp.down_proj.weight"
        bad = {**trainer.state_dict(), name: torch.zeros(3, 5)}
        shapes = r"received shape \[3, 5\], the engine's is \[128, 256\]"
        with pytest.raises(ss.ShapeMismatchError, match=rf"{name}.*{shapes}"):
            sync(llm, bad, endpoint)  # type: ignore[arg-type]
        engine_outputs(llm)  # serves: no meta tensor left in the model
        perturb(trainer, seed=5)
        want = reference_outputs(trainer)
        sync(llm, trainer, endpoint)
        assert_matches(engine_outputs(llm), want)
    finally:
        shutdown(llm)
