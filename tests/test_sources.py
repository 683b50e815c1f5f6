"""``named_tensors`` over modules, mappings and iterables; the plain loop ``send`` buckets
them with."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from conftest import WIRE_DTYPES, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsync import named_tensors
from streamsync.adapters import bucket, cast
from streamsync.adapters.bucket import Bucketer
from streamsync.errors import ConfigError
from streamsync.pipeline import Chain
from streamsync.wire.pack import Bucket


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


async def test_merged_is_refused_for_anything_but_a_peft_model() -> None:
    async def gen():  # type: ignore[no-untyped-def]
        yield "a", torch.ones(1)

    for source in ({"a": torch.ones(1)}, gen()):
        with pytest.raises(ConfigError, match="not a peft model"):
            named_tensors(source, merged=True)


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(WIRE_DTYPES), shapes, st.booleans()), max_size=12),
    bucket_bytes=st.integers(1024, 4096),
    big=st.integers(0, 2000),
    to_bf16=st.booleans(),
)
def test_a_mapping_and_a_stream_of_its_pairs_make_the_same_buckets(
    specs: list[tuple[torch.dtype, tuple[int, ...], bool]],
    bucket_bytes: int,
    big: int,
    to_bf16: bool,
) -> None:
    # What named_tensors makes of a mapping and any other stream of the same pairs give the
    # same bytes in the same layouts: chunks, casts and non-contiguous tensors included.
    tensors = {}
    for i, (dtype, shape, transpose) in enumerate(specs):
        t = random_tensor(shape, dtype, i)
        tensors[f"t{i}"] = t.transpose(0, 1) if transpose and t.dim() >= 2 else t
    tensors["big"] = random_tensor((big,), torch.float32, 99)
    stages = (cast(torch.bfloat16), bucket(bucket_bytes)) if to_bf16 else (bucket(bucket_bytes),)
    chain = Chain(*stages)
    (fused,) = chain.stages
    assert isinstance(fused, Bucketer)

    async def one_at_a_time() -> AsyncIterator[tuple[str, torch.Tensor]]:
        async for pair in named_tensors(tensors):
            yield pair

    async def both() -> tuple[list[Bucket], list[Bucket]]:
        plain = [b async for b in chain(named_tensors(tensors))]
        streamed = [b async for b in chain(one_at_a_time())]
        return plain, streamed

    plain, streamed = anyio.run(both)
    assert len(plain) == len(streamed)
    for ours, theirs in zip(plain, streamed, strict=True):
        a = torch.zeros(max(ours.nbytes, 1), dtype=torch.uint8)
        b = torch.zeros(max(theirs.nbytes, 1), dtype=torch.uint8)
        assert ours.pack_into(a) == theirs.pack_into(b)
        assert ours.tensors == theirs.tensors
        assert torch.equal(a, b)


async def test_the_bucketer_closes_its_source_when_stopped_early() -> None:
    closed = []

    def gen():  # type: ignore[no-untyped-def]
        try:
            for i in range(100):
                yield f"t{i}", torch.ones(256)
        finally:
            closed.append(True)

    pairs = gen()  # held here, so only the loop's own close can end it
    buckets = Bucketer(1024)(named_tensors(pairs))
    first = await anext(buckets)
    assert first.names == ["t0"]
    await buckets.aclose()
    assert closed == [True]


async def test_the_bucketer_hands_on_each_bucket_as_it_fills() -> None:
    made = []

    def gen():  # type: ignore[no-untyped-def]
        for i in range(10):
            made.append(i)
            yield f"t{i}", torch.ones(256)  # 1 KiB: one to a 1 KiB bucket

    buckets = Bucketer(1024)(named_tensors(gen()))
    await anext(buckets)
    assert made == [0, 1]  # the second tensor closed the first bucket
    await buckets.aclose()
