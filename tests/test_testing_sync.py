"""A user's unit test of their pipeline, written as the README shows: one call to
``streamsync.testing.sync`` with the public fakes, and ``pytest.raises`` on the class the
failure really has."""

from __future__ import annotations

import pytest
import torch

import streamsync as ss
import streamsync.testing as sst
from streamsync.adapters import cast, rename


async def test_a_pipeline_reaches_the_model() -> None:
    model = torch.nn.Linear(4, 3)
    weights = {"weight": torch.randn(3, 4, dtype=torch.float64), "bias": torch.randn(3).double()}
    report = await sst.sync(weights, ss.ModuleSink(model), pipeline=cast(torch.float32))
    assert report.complete and report.tensors == 2
    assert torch.equal(model.weight, weights["weight"].float())


async def test_a_bad_rename_raises_the_sinks_error() -> None:
    model = torch.nn.Linear(4, 3)
    weights = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
    with pytest.raises(ss.UnknownTensorError, match=r"'linear\.weight'") as info:
        await sst.sync(weights, ss.ModuleSink(model), pipeline=rename({"weight": "linear.weight"}))
    assert info.value.report is not None and not info.value.report.complete


async def test_a_failing_pipeline_raises_its_own_error() -> None:
    def boom(name: str) -> str:
        raise ValueError(f"no name for {name}")

    with pytest.raises(ValueError, match="no name for weight"):
        await sst.sync(
            {"weight": torch.ones(2)}, ss.ModuleSink(torch.nn.Linear(1, 2)), pipeline=rename(boom)
        )


async def test_the_options_are_the_transports() -> None:
    with pytest.raises(ss.ConfigError, match=r"unknown option 'slot' \(did you mean 'slots'"):
        await sst.sync({"w": torch.ones(1)}, ss.ModuleSink(torch.nn.Linear(1, 1)), slot=3)
