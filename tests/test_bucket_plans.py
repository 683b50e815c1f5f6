"""Bucket plans a sender keeps between syncs (``streamsync._replay``): a source that
matches the last sync's is bucketed by refilling its buckets; one that differs anywhere is
bucketed correctly all the same, and its new shape becomes the plan."""

from __future__ import annotations

import weakref
from typing import Any

import anyio
import pytest
import torch
from conftest import WIRE_DTYPES, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

import streamsync as ss
from streamsync._channel import sender_state
from streamsync._replay import PLANS_PER_SENDER, BucketPlans
from streamsync.adapters import cast
from streamsync.adapters.bucket import Bucketer
from streamsync.pipeline import Chain
from streamsync.wire.frames import BucketHeader
from streamsync.wire.pack import Bucket, CastRule
from streamsync.wire.unpack import Unpacker

Spec = tuple[str, torch.dtype, tuple[int, ...], bool]


def _tensors(specs: list[Spec], seed: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, dtype, shape, transpose) in enumerate(specs):
        t = random_tensor(shape, dtype, seed * 1000 + i)
        out[name] = t.transpose(0, 1) if transpose and t.dim() >= 2 else t
    return out


def _bucketed(
    tensors: dict[str, torch.Tensor],
    bucket_bytes: int,
    rule: CastRule | None,
    plans: BucketPlans | None,
) -> list[Bucket]:
    async def run() -> list[Bucket]:
        buckets = Bucketer(bucket_bytes, cast=rule, plans=plans)(ss.named_tensors(tensors))
        return [b async for b in buckets]

    return anyio.run(run)


def _packed(buckets: list[Bucket]) -> list[tuple[Any, bytes, int]]:
    out = []
    for b in buckets:
        buf = torch.zeros(max(b.nbytes, 1), dtype=torch.uint8)
        layout = b.pack_into(buf)
        out.append((layout, bytes(buf.numpy()), b.tensors))
    return out


def _unpacked(buckets: list[Bucket], bucket_bytes: int) -> dict[str, torch.Tensor]:
    unpacker = Unpacker()
    unpacker.begin(1)
    got: dict[str, torch.Tensor] = {}
    for seq, b in enumerate(buckets):
        assert b.nbytes <= bucket_bytes
        buf = torch.zeros(max(b.nbytes, 1), dtype=torch.uint8)
        layout = b.pack_into(buf)
        header = BucketHeader(1, seq, 0, buf.numel(), layout)
        for name, view in unpacker.feed(header, buf):
            assert name not in got
            got[name] = view.clone()
    assert sum(b.tensors for b in buckets) == len(got)
    return got


def _expected(tensors: dict[str, torch.Tensor], rule: CastRule | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        dtype = rule(name, t.dtype) if rule is not None else None
        out[name] = t.to(dtype) if dtype is not None else t
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(_bytes(got[name]), _bytes(t)), name


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
specs = st.lists(
    st.tuples(st.sampled_from(WIRE_DTYPES), shapes, st.booleans()), min_size=0, max_size=10
).map(lambda xs: [(f"t{i}", d, s, tr) for i, (d, s, tr) in enumerate(xs)])


def _mutate(base: list[Spec], change: str, at: int, dtype: torch.dtype) -> list[Spec]:
    if not base and change != "append":
        return base
    i = at % max(len(base), 1)
    out = list(base)
    name, old_dtype, shape, transpose = out[i] if base else ("x", dtype, (3,), False)
    if change == "dtype":
        out[i] = (name, dtype, shape, transpose)
    elif change == "shape":
        out[i] = (name, old_dtype, (*shape, 2), transpose)
    elif change == "name":
        out[i] = (name + "_renamed", old_dtype, shape, transpose)
    elif change == "layout":
        out[i] = (name, old_dtype, shape, not transpose)
    elif change == "drop":
        del out[i]
    elif change == "append":
        out.append(("appended", dtype, (5, 3), False))
    elif change == "insert":
        out.insert(i, ("inserted", dtype, (7,), False))
    return out


@pytest.mark.parametrize(
    "change", ["none", "dtype", "shape", "name", "layout", "drop", "append", "insert", "big"]
)
@settings(max_examples=30, deadline=None)
@given(
    base=specs,
    big=st.integers(0, 3000),
    bucket_bytes=st.sampled_from([1024, 2048, 4096]),
    to_bf16=st.booleans(),
    at=st.integers(0, 20),
    dtype=st.sampled_from(WIRE_DTYPES),
)
def test_every_sync_delivers_its_source_whatever_changed_since_the_plan(
    change: str,
    base: list[Spec],
    big: int,
    bucket_bytes: int,
    to_bf16: bool,
    at: int,
    dtype: torch.dtype,
) -> None:
    # Three syncs on one sender's plans: the first records, the second replays or departs
    # from the plan at the changed tensor, the third replays what the second recorded. A
    # "big" tensor is chunked across buckets (up to 12 KiB of fp32 into 1-4 KiB buckets).
    rule = (
        Chain(cast(torch.bfloat16), ss.adapters.bucket(bucket_bytes)).stages[0].cast
        if to_bf16
        else None
    )
    first = [*base[: at % (len(base) + 1)], ("big", torch.float32, (big,), False)]
    first += base[at % (len(base) + 1) :]
    if change == "big":
        second = [(n, d, (big + 7,), t) if n == "big" else (n, d, s, t) for n, d, s, t in first]
    elif change == "none":
        second = first
    else:
        second = _mutate(first, change, at, dtype)
    plans = BucketPlans()
    for seed, spec in enumerate([first, second, second]):
        tensors = _tensors(spec, seed)
        buckets = _bucketed(tensors, bucket_bytes, rule, plans)
        _same(_unpacked(buckets, bucket_bytes), _expected(tensors, rule))
        assert plans.replayed + plans.placed == len(tensors)
        # Replayed, departed from or recorded: the very buckets a fresh build makes.
        assert _packed(buckets) == _packed(_bucketed(tensors, bucket_bytes, rule, None))
        if seed == 2 or (seed == 1 and change == "none"):
            # The same layout again: nothing placed anew.
            assert (plans.replayed, plans.placed) == (len(tensors), 0)
        elif seed == 0:
            assert (plans.replayed, plans.placed) == (0, len(tensors))


def test_a_replay_sends_what_the_source_checked_and_bad_items_are_named() -> None:
    # A tensor that needs detaching (a parameter, one that requires grad) is sent detached,
    # the replay going on; an item that is no (str, tensor) pair is the source's clear
    # error, whatever the plan.
    plans = BucketPlans()
    tensors = {f"w{i}": torch.randn(128) for i in range(6)}
    _bucketed(tensors, 1024, None, plans)
    assert (plans.replayed, plans.placed) == (0, 6)
    for swapped in (
        torch.nn.Parameter(tensors["w3"] + 1),
        (tensors["w3"] + 2).requires_grad_(),
    ):
        source = {**tensors, "w3": swapped}
        got = _unpacked(_bucketed(source, 1024, None, plans), 1024)
        assert (plans.replayed, plans.placed) == (6, 0)
        _same(got, {n: t.detach() for n, t in source.items()})
    bad: list[tuple[Any, str]] = [
        ({**tensors, "w4": [1.0, 2.0]}, "tensor 'w4' is a list"),
        ({**tensors, 5: tensors["w5"]}, "tensor name 5 is a int"),
    ]
    for source, message in bad:
        with pytest.raises(TypeError, match=message):
            _bucketed(source, 1024, None, plans)

    async def run(items: list[Any]) -> list[Bucket]:
        return [b async for b in Bucketer(1024, plans=plans)(ss.named_tensors(items))]

    with pytest.raises(TypeError, match="expected \\(name, tensor\\) pairs, got tuple"):
        anyio.run(run, [*tensors.items(), ("w6",)])


class _Collect:
    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}

    def prepare(self) -> None:
        pass

    def load(self, tensors: Any) -> None:
        for name, view in tensors:
            self.got[name] = view.clone()

    def finalize(self) -> None:
        pass


# The README's form, send(named_tensors(model), ...), uses the sender's plans as
# send(model, ...) does; so do named_tensors of a mapping and a pipeline's output.
@pytest.mark.parametrize(
    "form", ["model", "named_tensors(model)", "named_tensors(mapping)", "pipeline"]
)
async def test_a_sender_replays_an_unchanged_model_and_replans_a_changed_one(form: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    targets = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    sink = ss.ModuleSink(targets)
    names = list(model.state_dict())
    sources = {
        "model": lambda: model,
        "named_tensors(model)": lambda: ss.named_tensors(model),
        "named_tensors(mapping)": lambda: ss.named_tensors(dict(model.state_dict())),
        "pipeline": lambda: model,
    }
    pipeline = ss.adapters.select(lambda name: True) if form == "pipeline" else None

    async def sync(tx: Any, rx: Any) -> tuple[int, int]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ss.receive, rx, sink)
            await ss.send(sources[form](), tx, bucket_bytes=4096, pipeline=pipeline)
        return sender_state(tx).plans.replayed, sender_state(tx).plans.placed

    async with ss.open_sender("memory://plans") as tx, ss.open_receiver("memory://plans") as rx:
        # The first sync builds its buckets.
        assert await sync(tx, rx) == (0, len(names))
        with torch.no_grad():
            model[0].weight.add_(1.0)
        # The second fills the same buckets: nothing placed again.
        assert await sync(tx, rx) == (len(names), 0)
        assert torch.equal(targets[0].weight, model[0].weight)
        # A parameter whose data is replaced by a transposed copy (same shape, not
        # contiguous): the plan no longer holds from there on.
        with torch.no_grad():
            model[1].weight.data = model[1].weight.data.t().contiguous().t() + 1
        assert not model[1].weight.is_contiguous()
        assert await sync(tx, rx) == (2, len(names) - 2)
        for name, want in model.state_dict().items():
            assert torch.equal(targets.state_dict()[name], want), name
        # And the new shape is the plan from then on.
        assert await sync(tx, rx) == (len(names), 0)
        assert len(sender_state(tx).plans) == 1


async def test_named_tensors_partly_read_sends_the_rest_and_spent_yields_nothing() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    names = list(model.state_dict())
    stream = ss.named_tensors(model)
    first, _ = await anext(stream)
    assert first == names[0]
    targets = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    async with ss.open_sender("memory://partly") as tx, ss.open_receiver("memory://partly") as rx:
        got: dict[str, ss.SyncReport] = {}

        async def receive() -> None:
            got["rx"] = await ss.receive(rx, ss.ModuleSink(targets, strict=False))

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await ss.send(stream, tx)
    assert sorted(got["rx"].loaded) == sorted(names[1:])  # what was left of the stream
    # A stream a sync took whole is spent, as one it read to the end would be.
    spent = ss.named_tensors(model)
    async with (
        ss.open_sender("memory://spent") as tx,
        ss.open_receiver("memory://spent") as rx,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(ss.receive, rx, ss.ModuleSink(targets))
        await ss.send(spent, tx)
    assert [pair async for pair in spent] == []


async def test_a_cast_given_afresh_each_sync_is_the_same_cast() -> None:
    weights = {f"w{i}": torch.randn(300) for i in range(20)}
    sink = _Collect()
    got = sink.got

    async def sync(tx: Any, rx: Any) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ss.receive, rx, sink)
            await ss.send(weights, tx, pipeline=cast(torch.bfloat16), bucket_bytes=2048)

    async with ss.open_sender("memory://cast") as tx, ss.open_receiver("memory://cast") as rx:
        await sync(tx, rx)
        assert (sender_state(tx).plans.replayed, sender_state(tx).plans.placed) == (0, 20)
        weights = {k: v * 2 for k, v in weights.items()}  # new tensors, same names
        await sync(tx, rx)
        assert (sender_state(tx).plans.replayed, sender_state(tx).plans.placed) == (20, 0)
        for k, v in weights.items():
            assert torch.equal(got[k], v.bfloat16())
    assert cast(torch.bfloat16).rule == cast(torch.bfloat16).rule  # type: ignore[attr-defined]
    assert cast(torch.bfloat16).rule != cast(torch.float16).rule  # type: ignore[attr-defined]


def test_plans_are_kept_per_source_and_the_oldest_goes_first() -> None:
    plans = BucketPlans()
    for i in range(PLANS_PER_SENDER + 2):
        _bucketed({f"source{i}.w": torch.ones(4)}, 1024, None, plans)
    assert len(plans) == PLANS_PER_SENDER
    # A bucket size of its own is a plan of its own.
    _bucketed({f"source{PLANS_PER_SENDER + 1}.w": torch.ones(4)}, 2048, None, plans)
    assert len(plans) == PLANS_PER_SENDER


def test_buckets_made_upstream_pass_and_leave_no_plan() -> None:
    # A plan holds the buckets its own stage makes: a stream that also carries buckets
    # made upstream is bucketed as it comes, and the replay there stops for good.
    plans = BucketPlans()
    tensors = {f"w{i}": torch.randn(64) for i in range(6)}
    _bucketed(tensors, 1024, None, plans)
    upstream = Bucket()
    upstream.append("up", "float32", (4,), 0, 16, torch.ones(4), True)
    upstream.tensors = 1

    async def run() -> list[Bucket]:
        async def items() -> Any:
            for i, pair in enumerate(tensors.items()):
                if i == 3:
                    yield upstream
                yield pair

        return [b async for b in Bucketer(1024, plans=plans)(items())]

    buckets = anyio.run(run)
    assert upstream in buckets
    assert (plans.replayed, plans.placed) == (3, 3)
    _same(
        _unpacked(buckets, 1024),
        {**dict(list(tensors.items())[:3]), "up": torch.ones(4), **dict(list(tensors.items())[3:])},
    )
    assert len(plans) == 1  # the first sync's plan, not replaced


def test_a_plan_holds_no_tensor() -> None:
    plans = BucketPlans()
    tensors = {f"w{i}": torch.ones(100) for i in range(10)}
    alive = [weakref.ref(t) for t in tensors.values()]
    _bucketed(tensors, 1024, None, plans)
    _bucketed(tensors, 1024, None, plans)
    del tensors
    assert all(r() is None for r in alive)


def test_a_stage_without_a_cast_and_one_with_are_different_plans() -> None:
    plans = BucketPlans()
    tensors = {"w": torch.ones(8)}
    stage = Chain(cast(torch.bfloat16), ss.adapters.bucket(1024)).stages[0]
    assert isinstance(stage, Bucketer)
    plain = _packed(_bucketed(tensors, 1024, None, plans))
    casted = _packed(_bucketed(tensors, 1024, stage.cast, plans))
    assert plain != casted
    assert casted == _packed(_bucketed(tensors, 1024, stage.cast, plans))
    assert len(plans) == 2


async def test_a_sender_that_cannot_be_weakly_referenced_keeps_plans_and_deltas() -> None:
    # The plans and the baseline live on the sender's own state, not in a table keyed by
    # the sender: a wrapper of one's own without ``__weakref__`` gets both.
    class Slotted:
        """A sender of one's own whose class has no ``__weakref__``."""

        __slots__ = ("_inner",)

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    weights = {f"w{i}": torch.randn(50) for i in range(5)}
    sink = _Collect()
    async with (
        ss.open_sender("memory://slotted") as opened,
        ss.open_receiver("memory://slotted") as rx,
    ):
        tx = Slotted(opened)
        assert sender_state(tx) is sender_state(opened)
        for _ in range(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ss.receive, rx, sink)
                await ss.send(weights, tx, bucket_bytes=1024)  # type: ignore[arg-type]
            for k, v in weights.items():
                assert torch.equal(sink.got[k], v)
            weights = {k: v + 1 for k, v in weights.items()}
        assert len(sender_state(opened).plans) == 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(ss.receive, rx, sink)
            sent = await ss.send(weights, tx, delta=True)  # type: ignore[arg-type]
        # The sink keeps no version, so the delta-tracked sync goes full, and is recorded.
        assert sent.delta is not None and sent.delta.base is None
        assert sender_state(opened).baseline.version == sent.sync_id
        for k, v in weights.items():
            assert torch.equal(sink.got[k], v)
