"""Real syncs into the CPU build of vLLM: a Qwen3-MoE, with the expander on and off, and
the CPU MoE prepack quirk shown to be needed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
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


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("moe")
    # Smaller weights than the dense tests: the CPU MoE kernel sums experts in another order
    # than Transformers, and logprob differences grow with the logits.
    trainer = build_tiny_model(path, "moe", seed=0, init_std=0.12)
    llm = make_llm(str(path))
    yield llm, trainer
    shutdown(llm)


@pytest.mark.parametrize("transport", ["shm", "zmq+tcp"])
@pytest.mark.parametrize("expand", [False, True], ids=["packed", "expanded"])
def test_moe_with_expander_on_and_off(
    moe: tuple[Any, torch.nn.Module], expand: bool, transport: str
) -> None:
    from streamsync.adapters import expand_moe

    llm, trainer = moe
    endpoint = {"shm": f"shm://moe-{os.getpid()}", "zmq+tcp": "zmq+tcp://127.0.0.1:0"}
    pipeline = expand_moe(when="always" if expand else "never", model_type="qwen3_moe")
    for step in range(3):
        perturb(trainer, seed=7 + step + 10 * expand + 100 * len(transport))
        want = reference_outputs(trainer)
        report = sync(llm, trainer, endpoint[transport], pipeline=pipeline)
        assert report.instances["worker0.main"].missing == ()
        assert_matches(engine_outputs(llm), want)


def test_moe_needs_the_cpu_prepack_quirk(moe: tuple[Any, torch.nn.Module]) -> None:
    """Without the cpu-moe-prepack fix-up the parameters are right but the outputs are not:
    the reloaded experts compute with weights the CPU kernel cannot read."""
    llm, trainer = moe
    endpoint = f"shm://moe-quirk-{os.getpid()}"
    perturb(trainer, seed=99)
    want = reference_outputs(trainer)
    sync(llm, trainer, endpoint, worker_options={"quirks": []})
    broken = engine_outputs(llm)
    assert broken.tokens != want.tokens
    assert broken.max_logprob_diff(want) > 0.1
    sync(llm, trainer, endpoint)  # with the quirk (the default) the same sync is right
    assert_matches(engine_outputs(llm), want)
