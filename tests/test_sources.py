"""``named_tensors`` over modules, mappings and iterables."""

from __future__ import annotations

import pytest
import torch

from streamsync import named_tensors


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("bias_correction", torch.zeros(2))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


async def test_module_yields_params_and_persistent_buffers_by_state_dict_name() -> None:
    m = WithBuffers()
    names = [n async for n, _ in named_tensors(m)]
    assert names == list(m.state_dict())
    assert sorted(names) == ["bias_correction", "lin.bias", "lin.weight"]  # not "cache"


async def test_module_tensors_are_detached_views_not_copies() -> None:
    m = WithBuffers()
    items = {n: t async for n, t in named_tensors(m)}
    assert not items["lin.weight"].requires_grad
    assert items["lin.weight"].data_ptr() == m.lin.weight.data_ptr()


async def test_mapping_and_sync_and_async_iterables() -> None:
    data = {"a": torch.ones(1), "b": torch.zeros(1)}
    assert [n async for n, _ in named_tensors(data)] == ["a", "b"]
    assert [n async for n, _ in named_tensors(list(data.items()))] == ["a", "b"]

    async def gen():  # type: ignore[no-untyped-def]
        for item in data.items():
            yield item

    assert [n async for n, _ in named_tensors(gen())] == ["a", "b"]


async def test_source_is_lazy() -> None:
    made = []

    def gen():  # type: ignore[no-untyped-def]
        for i in range(3):
            made.append(i)
            yield f"t{i}", torch.ones(1)

    stream = named_tensors(gen())
    await anext(stream)
    assert made == [0]


async def test_bad_items_name_the_problem() -> None:
    with pytest.raises(TypeError, match="'w' is a list"):
        [x async for x in named_tensors([("w", [1, 2])])]
    with pytest.raises(TypeError, match="not a str"):
        [x async for x in named_tensors([(3, torch.ones(1))])]
    with pytest.raises(TypeError, match="named_tensors"):
        named_tensors(42)
