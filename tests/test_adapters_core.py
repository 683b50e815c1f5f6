"""The small adapters, composition with ``|``, and early-exit closing."""

from __future__ import annotations

import anyio
import pytest
import torch

from streamsync import Adapter, Chain, named_tensors
from streamsync.adapters import Bucketer, bucket, cast, rename, select, unbucket


async def collect(stream) -> list:  # type: ignore[no-untyped-def]
    return [item async for item in stream]


async def test_cast_only_touches_high_precision_floats() -> None:
    src = {
        "w": torch.randn(3),
        "i": torch.arange(3),
        "f8": torch.zeros(2).to(torch.float8_e4m3fn),
        "b": torch.ones(2, dtype=torch.bool),
    }
    out = dict(await collect(cast(torch.bfloat16)(named_tensors(src))))
    assert out["w"].dtype == torch.bfloat16
    assert out["i"].dtype == torch.int64
    assert out["f8"].dtype == torch.float8_e4m3fn
    assert out["b"].dtype == torch.bool


async def test_cast_only_predicate() -> None:
    src = {"a.weight": torch.randn(2), "a.bias": torch.randn(2)}
    out = dict(
        await collect(cast(torch.float16, only=lambda n: n.endswith("weight"))(named_tensors(src)))
    )
    assert out["a.weight"].dtype == torch.float16
    assert out["a.bias"].dtype == torch.float32


async def test_rename_by_mapping_and_function() -> None:
    src = {"a": torch.ones(1), "b": torch.ones(1)}
    assert [n for n, _ in await collect(rename({"a": "x"})(named_tensors(src)))] == ["x", "b"]
    assert [n for n, _ in await collect(rename(str.upper)(named_tensors(src)))] == ["A", "B"]


async def test_select_drops_and_keeps_order() -> None:
    src = {f"t{i}": torch.ones(1) for i in range(6)}
    out = await collect(select(lambda n: int(n[1:]) % 2 == 0)(named_tensors(src)))
    assert [n for n, _ in out] == ["t0", "t2", "t4"]


async def test_composition_runs_left_first_and_is_an_adapter() -> None:
    chain = rename(lambda n: "x." + n) | select(lambda n: n.startswith("x."))
    assert isinstance(chain, Adapter)
    out = await collect(chain(named_tensors({"a": torch.ones(1)})))
    assert [n for n, _ in out] == ["x.a"]
    # Composing two chains flattens them.
    longer = chain | cast(torch.float16)
    assert isinstance(longer, Chain) and len(longer.stages) == 3


async def test_plain_functions_compose_on_either_side() -> None:
    async def double(source):  # type: ignore[no-untyped-def]
        async for name, t in source:
            yield name, t * 2

    chain = double | select(lambda n: True)
    out = await collect(chain(named_tensors({"a": torch.ones(1)})))
    assert torch.equal(out[0][1], torch.full((1,), 2.0))
    chain2 = select(lambda n: True) | double
    assert torch.equal(
        (await collect(chain2(named_tensors({"a": torch.ones(1)}))))[0][1], torch.full((1,), 2.0)
    )


def test_cast_fuses_into_the_bucketer() -> None:
    chain = select(lambda n: True) | cast(torch.bfloat16) | bucket(4096)
    assert len(chain.stages) == 2
    assert isinstance(chain.stages[1], Bucketer) and chain.stages[1].cast is not None


async def test_fused_and_unfused_cast_give_identical_bytes() -> None:
    src = {"w": torch.randn(300), "i": torch.arange(5)}
    fused = cast(torch.bfloat16) | bucket(1024)
    plain = cast(torch.bfloat16)
    packed = [b.pack() async for b in fused(named_tensors(src))]
    got = dict(await collect(unbucket()(_aiter(packed))))
    want = dict(await collect(plain(named_tensors(src))))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype


async def _aiter(items):  # type: ignore[no-untyped-def]
    for item in items:
        yield item


async def test_early_exit_closes_the_source() -> None:
    closed = anyio.Event()

    async def source():  # type: ignore[no-untyped-def]
        try:
            for i in range(100):
                yield f"t{i}", torch.ones(1)
        finally:
            closed.set()

    stream = (rename(str.upper) | select(lambda n: True) | cast(torch.float16))(source())
    first = await anext(stream)
    assert first[0] == "T0"
    await stream.aclose()
    assert closed.is_set()


def test_not_an_adapter_is_refused() -> None:
    with pytest.raises(TypeError, match="not an adapter"):
        Chain(select(lambda n: True), 42)  # type: ignore[arg-type]
