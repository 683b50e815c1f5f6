"""``VllmSink`` without an engine: tied parameters are loaded under every name, tied names
with different values and tensors left on the meta device fail by name.

The model is a small module with a vLLM-style ``load_weights`` that records what it was
given; the lifecycle loads straight into it. The real engine is in ``test_vllm_tied.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
import torch

import streamsync as ss
from streamsync.pipeline import NamedTensor
from streamsync.vllm.sink import ModelInstance, VllmSink


class TiedModel(torch.nn.Module):
    """An embedding and a head that share one parameter, as vLLM's tied Qwen3 does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.given: list[str] = []

    def load_weights(self, weights: Iterable[NamedTensor]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        done = set()
        for name, tensor in weights:
            self.given.append(name)
            params[name].data.copy_(tensor)
            done.add(name)
        return done


class Direct:
    """A lifecycle that loads into the live parameters."""

    name = "direct"

    def prepare(self, inst: ModelInstance) -> None:
        pass

    def load(self, inst: ModelInstance, tensors: Sequence[NamedTensor]) -> set[str]:
        return set(inst.model.load_weights(tensors))  # type: ignore[operator]

    def finalize(self, inst: ModelInstance) -> None:
        pass


def sink(model: torch.nn.Module) -> VllmSink:
    return VllmSink([ModelInstance("main", model)], lifecycle=Direct(), quirks=[])


def run(target: VllmSink, *buckets: list[NamedTensor]) -> ss.LoadResult:
    target.prepare()
    for bucket in buckets:
        target.load(bucket)
    return target.finalize()


def test_a_tied_parameter_sent_once_is_loaded_under_every_name() -> None:
    model = TiedModel()
    new = torch.randn(8, 4)
    result = run(sink(model), [("embed.weight", new)], [("norm.weight", torch.ones(4))])
    assert model.given == ["embed.weight", "head.weight", "norm.weight"]
    assert torch.equal(model.head.weight, new)
    assert {"embed.weight", "head.weight"} <= set(result.loaded)


def test_both_names_with_the_same_bytes_load_once_each() -> None:
    model = TiedModel()
    new = torch.randn(8, 4)
    target = sink(model)
    for _ in range(2):  # the names found once serve every later sync
        model.given = []
        run(target, [("head.weight", new)], [("embed.weight", new.clone())])
        assert model.given == ["head.weight", "embed.weight"]


def test_tied_names_with_different_values_fail_by_name() -> None:
    model = TiedModel()
    new = torch.randn(8, 4)
    target = sink(model)
    target.prepare()
    target.load([("embed.weight", new)])
    with pytest.raises(ss.ReceiverFailedError, match=r"ties 'head\.weight' to 'embed\.weight'"):
        target.load([("head.weight", new + 1)])


def test_a_tensor_left_on_the_meta_device_fails_by_name() -> None:
    model = TiedModel()
    model.norm.bias = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ss.ReceiverFailedError, match=r"1 tensor\(s\) without values.*'norm\.bias'"):
        run(sink(model), [("embed.weight", torch.randn(8, 4))])
