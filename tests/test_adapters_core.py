"""The small adapters, composition with ``|``, and early-exit closing."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from streamsync import ConfigError, adapter, named_tensors
from streamsync.adapters import bucket, cast, rename, select
from streamsync.adapters.bucket import Bucketer
from streamsync.facts import EngineFacts
from streamsync.pipeline import Adapter, Chain, Stage
from streamsync.testing.buckets import pack_bucket, unbucket
from streamsync.wire.pack import BucketBuilder


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
    packed = [pack_bucket(b) async for b in fused(named_tensors(src))]
    got = dict(await collect(unbucket()(_aiter(packed))))
    want = dict(await collect(plain(named_tensors(src))))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype


async def _aiter(items):  # type: ignore[no-untyped-def]
    for item in items:
        yield item


async def counting(closed: anyio.Event) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """A hundred named tensors; sets ``closed`` when the stream is closed."""
    try:
        for i in range(100):
            yield f"t{i}", torch.ones(1)
    finally:
        closed.set()


async def test_early_exit_closes_the_source() -> None:
    closed = anyio.Event()

    stream = (rename(str.upper) | select(lambda n: True) | cast(torch.float16))(counting(closed))
    first = await anext(stream)
    assert first[0] == "T0"
    await stream.aclose()
    assert closed.is_set()


def test_not_an_adapter_is_refused() -> None:
    with pytest.raises(TypeError, match="not an adapter"):
        Chain(select(lambda n: True), 42)  # type: ignore[arg-type]


# --- the one form: @adapter ------------------------------------------------------------------


@adapter
async def take(source: AsyncIterable[Any], count: int, *, suffix: str = "") -> AsyncIterator[Any]:
    """Yield the first ``count`` tensors, renamed with ``suffix``, then stop early."""
    seen = 0
    async for name, tensor in source:
        if seen == count:
            return
        seen += 1
        yield name + suffix, tensor


async def test_a_decorated_generator_is_a_pipeable_stage() -> None:
    src = {f"t{i}": torch.ones(1) for i in range(5)}
    stage = take(2, suffix=".w")
    assert isinstance(stage, Adapter) and isinstance(stage, take)
    assert not isinstance(select(lambda n: True), take)
    assert (stage.count, stage.suffix) == (2, ".w")  # its configuration, by name
    assert repr(stage) == "take(2, suffix='.w')"
    assert [n for n, _ in await collect(stage(named_tensors(src)))] == ["t0.w", "t1.w"]
    chain = rename(str.upper) | take(3)
    assert [n for n, _ in await collect(chain(named_tensors(src)))] == ["T0", "T1", "T2"]


def test_configuration_is_checked_when_the_stage_is_made() -> None:
    with pytest.raises(ConfigError, match=r"take\(\): missing a required argument: 'count'"):
        take()  # type: ignore[call-arg]
    with pytest.raises(
        ConfigError, match=r"take\(\): unknown option 'colour'; valid: count, suffix"
    ):
        take(1, colour="red")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"not a torch\.dtype"):
        cast("bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping or a function"):
        rename(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="predicate"):
        select("a")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least 1024"):
        bucket(10)


async def test_a_stage_that_stops_early_closes_its_source() -> None:
    closed = anyio.Event()

    out = await collect((select(lambda n: True) | take(1))(counting(closed)))
    assert [n for n, _ in out] == ["t0"]
    assert closed.is_set()


def test_fusion_does_not_depend_on_grouping() -> None:
    one, two = cast(torch.float16), cast(torch.bfloat16)
    for chain in (
        one | two | bucket(4096),
        one | (two | bucket(4096)),
        Chain(one, two, Bucketer(4096)),
    ):
        # One cast per bucket: the earlier cast runs on its own (fusing two would round once
        # where the unfused chain rounds twice).
        assert [type(s) for s in chain.stages] == [Stage, Bucketer]
        assert chain.stages[0] is one and isinstance(chain.stages[1], Bucketer)
        assert chain.stages[1].cast is two.rule
    unfused = Chain(one, bucket(4096), fuse=False)
    assert len(unfused.stages) == 2 and unfused.stages[0] is one


def test_fused_cast_decides_on_name_and_dtype_only() -> None:
    seen: list[tuple[str, Any]] = []

    def rule(name: str, dtype: torch.dtype) -> torch.dtype | None:
        seen.append((name, dtype))
        return torch.bfloat16 if dtype == torch.float32 else None

    builder = BucketBuilder(1024, cast=rule)
    list(builder.add("w", torch.randn(8)))
    list(builder.add("i", torch.arange(3)))
    plan = builder.flush()
    assert plan is not None and [e.dtype for e in plan.entries] == ["bfloat16", "int64"]
    assert seen == [("w", torch.float32), ("i", torch.int64)]
    # The rule of cast(...) itself, as the bucketer calls it.
    cast_rule = cast(torch.float16, only=lambda n: n != "skip").rule
    assert cast_rule("w", torch.float32) == torch.float16
    assert cast_rule("w", torch.float16) is None
    assert cast_rule("w", torch.float8_e4m3fn) is None
    assert cast_rule("w.weight_scale_inv", torch.float32) is None
    assert cast_rule("skip", torch.float32) is None


async def test_a_cast_before_a_bucket_that_casts_already_runs_on_its_own() -> None:
    # f32 -> bf16 -> f32 rounds to bf16 and back: a single fused conversion would not.
    to_f32 = cast(torch.float32).rule
    chain = cast(torch.bfloat16) | bucket(4096, cast=to_f32)
    assert len(chain.stages) == 2 and chain.stages[1].cast is to_f32
    src = {"w": torch.randn(300, dtype=torch.float32), "h": torch.randn(7).half()}
    packed = [pack_bucket(b) async for b in chain(named_tensors(src))]
    got = dict(await collect(unbucket()(_aiter(packed))))
    assert torch.equal(got["w"], src["w"].bfloat16().float())
    assert got["h"].dtype == torch.float32 and torch.equal(got["h"], src["h"].bfloat16().float())


@adapter
async def _told(
    source: AsyncIterable[Any], tag: str, *, engines: tuple[EngineFacts, ...] = ()
) -> AsyncIterator[Any]:
    async for name, tensor in source:
        yield f"{tag}:{len(engines)}:{name}", tensor


async def test_a_chain_tells_the_engines_facts_to_the_stages_that_declare_them() -> None:
    facts = (EngineFacts(vllm_version=(0, 24, 0)), EngineFacts(vllm_version=(0, 24, 0)))

    def plain(source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return aiter(source)

    chain = Chain(rename({"w": "v"}), _told("t"), plain)
    told = chain.for_engines(facts)
    # The stages that do not decide from the engines are the same objects; the one that
    # does is a copy told them, the original left as it was.
    assert told.parts[0] is chain.parts[0] and told.parts[2] is plain
    assert told.parts[1].engines == facts and "engines" not in chain.parts[1].config
    weights = {"w": torch.zeros(1)}
    assert [n for n, _ in await collect(told(named_tensors(weights)))] == ["t:2:v"]
    assert [n for n, _ in await collect(chain(named_tensors(weights)))] == ["t:0:v"]
    # Engines come from the sync, not from the caller.
    with pytest.raises(ConfigError, match=r"unknown option 'engines'.*valid: tag"):
        _told("t", engines=facts)  # type: ignore[call-arg]
