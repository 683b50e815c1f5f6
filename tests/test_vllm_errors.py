"""Into vLLM, a sync that cannot load fails with the same named errors a plain module's sink
raises: an unknown name with its close matches, a wrong shape with both shapes, and FP8
weights sent to an engine that is not FP8 with what to drop. The engine keeps serving, and
the next full sync lands."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm_harness import (
    TRAINER,
    assert_matches,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
    sync,
)

import streamsync as ss
from streamsync.adapters import expand_moe, quantize_fp8
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm

GATE = "model.layers.0.mlp.gate_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("errors")
    trainer = build_tiny_model(path, "dense", seed=0)
    llm = make_llm(str(path))
    yield llm, trainer
    shutdown(llm)


def _send(llm: Any, weights: Any, **kwargs: Any) -> ss.SyncReport:
    from streamsync.vllm import update_weights

    async def main() -> ss.SyncReport:
        return await update_weights(
            llm, weights, endpoint=f"shm://errors-{os.getpid()}", bucket_bytes=256 << 10, **kwargs
        )

    return TRAINER.run(main, timeout=300)


def _still_serves(llm: Any, trainer: torch.nn.Module, seed: int) -> None:
    perturb(trainer, seed=seed)
    report = sync(llm, trainer, f"shm://errors-{os.getpid()}")
    assert report.complete
    assert_matches(engine_outputs(llm), reference_outputs(trainer))


def test_a_misspelt_name_is_unknown_with_its_close_matches(dense: tuple[Any, Any]) -> None:
    llm, trainer = dense
    weight = dict(trainer.named_parameters())[GATE].detach()
    misspelt = GATE.replace("gate_proj", "gate_prj")
    with pytest.raises(ss.UnknownTensorError) as caught:
        _send(llm, [(misspelt, weight)])
    message = str(caught.value)
    assert f"tensor {misspelt!r} is not a parameter or buffer of" in message
    assert f"close matches: {GATE}" in message
    _still_serves(llm, trainer, seed=1)


@pytest.mark.parametrize(
    ("name", "cut"),
    [(GATE, lambda w: w[: w.shape[0] // 2]), (Q, lambda w: w[:, :-2])],
    ids=["fused-part-rows", "columns"],
)
def test_a_wrong_shape_names_both_shapes(dense: tuple[Any, Any], name: str, cut: Any) -> None:
    llm, trainer = dense
    weight = dict(trainer.named_parameters())[name].detach()
    wrong = cut(weight).contiguous()
    with pytest.raises(ss.ShapeMismatchError) as caught:
        _send(llm, [(name, wrong)])
    assert (
        f"tensor {name!r}: received shape {list(wrong.shape)}, the engine's is {list(weight.shape)}"
    ) in str(caught.value)
    _still_serves(llm, trainer, seed=2)


def test_fp8_weights_into_an_engine_that_is_not_fp8_say_what_to_drop(
    dense: tuple[Any, Any],
) -> None:
    llm, trainer = dense
    before = engine_outputs(llm)
    with pytest.raises(ss.ConfigError) as caught:
        _send(llm, ss.named_tensors(trainer), pipeline=expand_moe() | quantize_fp8())
    message = str(caught.value)
    assert "the engine's weights are not FP8" in message
    assert "drop quantize_fp8()" in message
    assert_matches(engine_outputs(llm), before)  # refused before anything was loaded
    _still_serves(llm, trainer, seed=3)
