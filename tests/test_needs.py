"""What each worker reads of each checkpoint tensor (:class:`Needs`): the box a recorded op
chain reads, the structs on the wire, and a sharded channel asking each worker once when it
opens. The same on a real TP=2 vLLM engine is in ``test_vllm_needs.py``."""

from __future__ import annotations

import contextlib
import os
from math import prod
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import ThreadEngine, rpc

from streamsync.engine.channel import EngineChannel
from streamsync.errors import ConfigError, ProtocolVersionError, WireFormatError
from streamsync.facts import WORKER_PROTOCOL, Box, Need, Needs
from streamsync.vllm.slices import need_of, read_box, replay

NARROW_ROWS = (("narrow", (0, 64, 64), ()),)
NARROW_COLS = (("narrow", (1, 0, 32), ()),)
# How an MoE loader reaches expert 2's half of its intermediate dim.
EXPERT = (("unsqueeze", (0,), ()), ("__getitem__", (0,), ()), ("narrow", (0, 16, 16), ()))


@pytest.mark.parametrize(
    ("shape", "chains", "box"),
    [
        ((128, 64), [NARROW_ROWS], Box((64, 0), (128, 64))),
        ((128, 64), [NARROW_COLS], Box((0, 0), (128, 32))),
        ((32, 8), [EXPERT], Box((16, 0), (32, 8))),
        # Two parts of one tensor: their bounding box.
        (
            (128, 64),
            [(("narrow", (0, 0, 8), ()),), (("narrow", (0, 40, 8), ()),)],
            Box((0, 0), (48, 64)),
        ),
        ((4, 6), [(("t", (), ()), ("narrow", (0, 2, 2), ()))], Box((0, 2), (4, 4))),
        ((10,), [()], Box((0,), (10,))),
        # A flat view of rows 1 and 2.
        ((4, 6), [(("view", (-1,), ()), ("narrow", (0, 6, 12), ()))], Box((1, 0), (3, 6))),
        ((4, 6), [(("reshape", (3, 8), ()), ("__getitem__", (2,), ()))], Box((2, 0), (4, 6))),
        ((10,), [(("narrow", (0, 3, 0), ()),)], None),
        ((), [()], Box((), ())),
    ],
)
def test_the_box_a_chain_reads(
    shape: tuple[int, ...], chains: list[tuple[object, ...]], box: Box | None
) -> None:
    assert read_box(shape, chains) == box


@st.composite
def chains(
    draw: st.DrawFn,
) -> tuple[tuple[int, ...], tuple[tuple[str, tuple[int, ...], tuple[()]], ...]]:
    """A shape and a chain of the views vLLM's loaders take: transposes, narrows, an
    unsqueeze and an int index."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    now, chain = list(shape), []
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["narrow", "t", "unsqueeze", "index", "flat"]))
        dims = len(now)
        if op == "narrow":
            d = draw(st.integers(0, dims - 1))
            start = draw(st.integers(0, now[d] - 1))
            length = draw(st.integers(1, now[d] - start))
            chain.append(("narrow", (d, start, length), ()))
            now[d] = length
        elif op == "t" and dims == 2:
            chain.append(("t", (), ()))
            now.reverse()
        elif op == "unsqueeze":
            chain.append(("unsqueeze", (0,), ()))
            now.insert(0, 1)
        elif op == "index" and dims > 1:
            chain.append(("__getitem__", (draw(st.integers(0, now[0] - 1)),), ()))
            now.pop(0)
        elif op == "flat":
            chain.append(("reshape", (-1,), ()))
            now = [prod(now)]
    return shape, tuple(chain)


@settings(max_examples=200, deadline=None)
@given(chains())
def test_the_box_is_the_bounding_box_of_the_elements_read(case: tuple[Any, Any]) -> None:
    shape, chain = case
    flat = replay(torch.arange(prod(shape)).view(shape), chain).reshape(-1)
    coords = torch.stack(torch.unravel_index(flat, shape), dim=-1)
    want = Box(tuple(coords.min(0).values.tolist()), tuple((coords.max(0).values + 1).tolist()))
    assert read_box(shape, [chain]) == want


def test_a_need_is_whole_when_its_box_is_all_of_the_tensor() -> None:
    assert need_of("w", "float32", (128, 64), [NARROW_ROWS]) == Need(
        "w", (128, 64), "float32", Box((64, 0), (128, 64))
    )
    assert need_of("n", "float32", (64,), [()]).box is None  # type: ignore[union-attr]
    # Two halves read by one worker: the whole.
    halves = [(("chunk", (2,), ()), ("__getitem__", (i,), ())) for i in (0, 1)]
    assert need_of("w", "float32", (8, 2), halves).box is None  # type: ignore[union-attr]
    assert need_of("w", "float32", (8, 2), [(("narrow", (0, 3, 0), ()),)]) is None


def test_a_chain_holds_view_ops_only() -> None:
    with pytest.raises(ValueError, match="'add' is not a view op"):
        replay(torch.zeros(3), [("add", (1,), ())])


NEEDS = Needs(
    instance="main",
    layout="abc",
    needs=(
        Need(
            "model.layers.0.self_attn.o_proj.weight",
            (128, 128),
            "float32",
            Box((0, 64), (128, 128)),
        ),
        Need("model.norm.weight", (128,), "float32", None),
        Need("model.x.weight", (4,), "float32", None, "NotImplementedError: to"),
    ),
)


def test_needs_round_trip_as_plain_values_and_msgpack() -> None:
    assert Needs.from_wire(rpc(NEEDS.to_wire())) == NEEDS
    wire = msgspec.msgpack.encode(NEEDS)
    assert msgspec.msgpack.decode(wire, type=Needs) == NEEDS
    assert NEEDS.version == WORKER_PROTOCOL
    assert NEEDS.needs[0].box.shape == (128, 64)  # type: ignore[union-attr]


def test_needs_of_another_protocol_or_malformed_fail_by_name() -> None:
    with pytest.raises(ProtocolVersionError, match="worker 1's needs of protocol version 4"):
        Needs.from_wire({**NEEDS.to_wire(), "version": 4}, rank=1)
    with pytest.raises(WireFormatError, match=r"worker 0's needs: .*valid fields: instance"):
        Needs.from_wire({**NEEDS.to_wire(), "needs": [["n", [2], "float32", "box"]]})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_the_needs_decoder_raises_only_its_own_errors(data: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        msgspec.msgpack.decode(data, type=Needs)


class NeedsEngine(ThreadEngine):
    """A ``ThreadEngine`` whose workers say what they read, one layout per rank."""

    asked = 0

    async def needs(self) -> list[list[Needs]]:
        self.asked += 1
        told = [
            rpc([msgspec.structs.replace(NEEDS, layout=f"rank{w}").to_wire()]) for w in range(2)
        ]
        return [[Needs.from_wire(n, rank=w) for n in one] for w, one in enumerate(told)]


def test_a_sharded_channel_asks_each_worker_once_and_shares_one_plan_per_layout() -> None:
    engines = [NeedsEngine([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]) for _ in range(2)]
    try:
        with EngineChannel(engines, f"shm://needs-{os.getpid()}", sharded=True, timeout=20) as sync:
            needs = sync.needs
            weights = {"weight": torch.ones(2, 2), "bias": torch.ones(2)}
            assert sync.update(weights).complete
            assert sync.needs == needs  # asked when the channel opened, not per sync
    finally:
        for engine in engines:
            engine.shutdown()
    assert [e.asked for e in engines] == [1, 1]
    assert sorted(needs) == [f"engine{e}.worker{w}.main" for e in (0, 1) for w in (0, 1)]
    assert needs["engine1.worker0.main"].instance == "engine1.worker0.main"
    # DP replicas of one layout share one tuple; the two ranks' layouts differ.
    assert needs["engine1.worker1.main"].needs is needs["engine0.worker1.main"].needs
    assert needs["engine0.worker0.main"].layout != needs["engine0.worker1.main"].layout
    with pytest.raises(TypeError):
        needs["x"] = NEEDS  # type: ignore[index]


def test_only_a_sharded_channel_asks_and_only_a_client_that_can_answer() -> None:
    engine = NeedsEngine([torch.nn.Linear(2, 2)])
    try:
        with EngineChannel(engine, f"shm://needs-plain-{os.getpid()}", timeout=20) as sync:
            assert sync.needs == {}
        assert engine.asked == 0
        with pytest.raises(ConfigError, match=r"sharded=True\): an engine client cannot say"):
            EngineChannel(ThreadEngine([torch.nn.Linear(2, 2)]), "shm://x", sharded=True)
    finally:
        engine.shutdown()
