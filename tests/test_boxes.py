"""A sharded channel's receiver without vLLM: :class:`BoxTensor` reads as the whole tensor
inside its box and fails by the tensor's name outside it or on any other op; the slices a
worker's ``Needs`` give (``slices_of``) and how received tensors are handed to the loaders
(``wrap``). On a real TP=2 engine: ``test_vllm_boxes.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from math import prod
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsync.boxes import BoxTensor, Sharded, box_union, slices_of, wrap
from streamsync.errors import ConfigError, ReceiverFailedError, ShapeMismatchError
from streamsync.facts import Box, Need, Needs
from streamsync.pipeline import NamedTensor
from streamsync.vllm.sink import ModelInstance, VllmSink


def _box_tensor(
    whole: torch.Tensor, start: tuple[int, ...], stop: tuple[int, ...], name: str = "w"
) -> BoxTensor:
    index = tuple(map(slice, start, stop))
    return BoxTensor(name, whole[index].clone(), start, tuple(whole.shape))


def _all_received(mask: torch.Tensor, dim: int, start: int, length: int) -> bool:
    """Whether every index ``start:start + length`` of ``dim`` lies in the received region
    ``mask`` marks (a box: an index is received when any element at it is)."""
    part = mask.narrow(dim, start, length).movedim(dim, 0).reshape(length, -1)
    return bool(part.any(1).all())


def _step(data: st.DataObject, shape: tuple[int, ...]) -> tuple[str, Callable[[Any], Any], Any]:
    """One read a loader makes, drawn for a tensor of ``shape``: its label, the op, and
    ``(dim, start, length)`` it reads (``None`` for ``unsqueeze``, which reads nothing)."""
    ndim = len(shape)
    kind = data.draw(st.sampled_from(["narrow", "torch.narrow", "select", "index", "unbind"]))
    kind = data.draw(st.sampled_from([kind, "unsqueeze"]))
    if kind == "unsqueeze":
        dim = data.draw(st.integers(-ndim - 1, ndim))
        return f"unsqueeze({dim})", lambda t: t.unsqueeze(dim), None
    dim = data.draw(st.integers(-ndim, ndim - 1)) if kind not in ("index", "unbind") else 0
    n = shape[dim]
    if kind in ("narrow", "torch.narrow"):
        start = data.draw(st.integers(0, n - 1))
        length = data.draw(st.integers(1, n - start))
        label = f"{kind}({dim}, {start}, {length})"
        if kind == "narrow":
            return label, lambda t: t.narrow(dim, start, length), (dim, start, length)
        return label, lambda t: torch.narrow(t, dim, start, length), (dim, start, length)
    i = data.draw(st.integers(-n, n - 1))
    if kind == "select":
        return f"select({dim}, {i})", lambda t: t.select(dim, i), (dim, i % n, 1)
    if kind == "index":
        return f"[{i}]", lambda t: t[i], (0, i % n, 1)
    return f"unbind()[{i}]", lambda t: t.unbind()[i], (0, 0, n)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_box_tensor_reads_as_the_whole_inside_its_box(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    start = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    stop = tuple(data.draw(st.integers(a + 1, n)) for a, n in zip(start, shape, strict=True))
    whole = torch.arange(prod(shape), dtype=torch.float32).view(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[tuple(map(slice, start, stop))] = True
    got: Any = _box_tensor(whole, start, stop)
    want, done = whole, []
    while isinstance(got, BoxTensor) and len(done) < 5:
        label, op, reads = _step(data, tuple(got.shape))
        if reads is not None and not _all_received(mask, *reads):
            with pytest.raises(ReceiverFailedError, match=r"tensor 'w': .* received only"):
                op(got)
            return
        got, want, mask, done = op(got), op(want), op(mask), [*done, label]
        assert got.shape == want.shape, done
    if isinstance(got, BoxTensor):
        box = got.box
        region = tuple(map(slice, box.start, box.stop))
        assert bool(mask[region].all()) and int(mask.sum()) == got.received.numel(), done
        assert torch.equal(got.received, want[region]), done
    else:
        assert type(got) is torch.Tensor and bool(mask.all()), done
        assert torch.equal(got, want), done


def test_a_loader_copies_what_narrow_returns() -> None:
    whole = torch.randn(8, 6)
    rows = _box_tensor(whole, (4, 0), (8, 6), "model.layers.0.mlp.down_proj.weight")
    param = torch.zeros(4, 6)
    param.data.copy_(rows.narrow(0, 4, 4))
    assert torch.equal(param, whole[4:])
    # As an MoE loader reaches an expert's rows: unsqueeze, [0], narrow.
    assert torch.equal(rows.unsqueeze(0)[0].narrow(0, 5, 2), whole[5:7])


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t + 1,
        lambda t: t.double(),
        lambda t: t.view(-1),
        lambda t: t.detach(),
        lambda t: t.data,
        lambda t: t.sum(),
        lambda t: t[1:2],
        lambda t: t[None],
        lambda t: torch.cat([t, t]),
        lambda t: torch.zeros(t.shape).copy_(t),
        lambda t: torch.zeros(t.shape)[4:].copy_(t.narrow(0, 2, 4)),  # outside the box
        lambda t: t.narrow(1, 0, 3).narrow(0, 0, 8),  # reaches rows 0:4
        lambda t: t.unbind(0),  # rows 0:4 were not received
        lambda t: t[3],
    ],
    ids=[
        "add",
        "double",
        "view",
        "detach",
        "data",
        "sum",
        "slice",
        "none-index",
        "cat",
        "copy-from-it",
        "narrow-outside",
        "chain-outside",
        "unbind-outside",
        "index-outside",
    ],
)
def test_any_other_read_fails_naming_the_tensor(op: Callable[[Any], Any]) -> None:
    t = _box_tensor(torch.randn(8, 6), (4, 0), (8, 6), "lm_head.weight")
    with pytest.raises(
        ReceiverFailedError, match=r"tensor 'lm_head.weight': .* received only \[4:8, 0:"
    ):
        op(t)


def test_a_cast_fails_and_a_no_op_one_stays_a_box() -> None:
    half = _box_tensor(torch.randn(4, 2).to(torch.bfloat16), (0, 0), (2, 2), "e")
    with pytest.raises(ReceiverFailedError, match="tensor 'e'"):
        half.float()
    same = _box_tensor(torch.randn(4, 2), (0, 0), (2, 2), "e")
    assert same.float() is same and same.to(torch.float32) is same  # reads nothing


def test_shape_queries_clone_and_repr() -> None:
    whole = torch.randn(6, 4)
    t = _box_tensor(whole, (2, 1), (5, 3), "x")
    assert (t.shape, t.dim(), t.numel(), len(t), t.dtype) == ((6, 4), 2, 24, 6, whole.dtype)
    assert t.tensor_name == "x" and t.box == Box((2, 1), (5, 3))
    assert repr(t) == "BoxTensor('x', shape=[6, 4], received=[2:5, 1:3], dtype=torch.float32)"
    copy = t.clone()
    assert isinstance(copy, BoxTensor) and copy.box == t.box
    assert copy.received.data_ptr() != t.received.data_ptr()
    assert torch.equal(copy.received, whole[2:5, 1:3])


@pytest.mark.parametrize(
    ("data_shape", "start", "shape"),
    [((2, 3), (3, 0), (4, 3)), ((2, 3), (0,), (4, 3)), ((2, 3), (0, 0), (2, 2))],
)
def test_a_box_that_does_not_fit_is_refused(
    data_shape: tuple[int, ...], start: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    with pytest.raises(ShapeMismatchError, match="tensor 'x': received data of shape"):
        BoxTensor("x", torch.zeros(data_shape), start, shape)


def _needs(instance: str, *needs: Need) -> Needs:
    return Needs(instance=instance, layout="l", needs=needs)


def test_slices_of_one_instance() -> None:
    rows = Need("a", (8, 4), "float32", Box((4, 0), (8, 4)))
    whole = Need("norm", (4,), "float32", None)
    assert slices_of([_needs("main", rows, whole)]) == {"a": (Box((4, 0), (8, 4)), (8, 4))}
    assert slices_of([]) == {}


def test_slices_of_two_instances_is_the_bounding_box() -> None:
    main = _needs(
        "main",
        Need("a", (8, 4), "float32", Box((4, 0), (6, 4))),
        Need("b", (8, 4), "float32", Box((0, 0), (4, 4))),
        Need("c", (8, 4), "float32", Box((0, 0), (4, 2))),
        Need("only-main", (8,), "float32", Box((0,), (4,))),
    )
    drafter = _needs(
        "drafter",
        Need("a", (8, 4), "float32", Box((5, 1), (7, 3))),
        Need("b", (8, 4), "float32", None),  # read whole by one: sent whole
        Need("c", (8, 4), "float32", Box((4, 2), (8, 4))),  # together all of it
    )
    want = {"a": (Box((4, 0), (7, 4)), (8, 4)), "only-main": (Box((0,), (4,)), (8,))}
    assert slices_of([main, drafter]) == want
    assert slices_of([drafter, main]) == want


def test_slices_of_instances_that_disagree_on_a_shape() -> None:
    main = _needs("main", Need("a", (8, 4), "float32", None))
    drafter = _needs("drafter", Need("a", (4, 4), "float32", Box((0, 0), (2, 4))))
    with pytest.raises(ShapeMismatchError, match=r"tensor 'a': model instance 'drafter'"):
        slices_of([main, drafter])


def test_box_union() -> None:
    assert box_union(Box((1, 2), (3, 4)), Box((0, 3), (2, 6))) == Box((0, 2), (3, 6))
    with pytest.raises(ValueError, match="no union"):
        box_union(Box((1,), (2,)), Box((0, 0), (1, 1)))


def test_wrap() -> None:
    slices = {"a": (Box((4, 0), (8, 4)), (8, 4))}
    part, full, other = torch.randn(4, 4), torch.randn(8, 4), torch.randn(3)
    (_, wrapped), (_, kept), (_, passed) = wrap([("a", part), ("a", full), ("b", other)], slices)
    assert isinstance(wrapped, BoxTensor) and wrapped.shape == (8, 4)
    assert wrapped.box == Box((4, 0), (8, 4)) and wrapped.received is part
    assert kept is full and passed is other
    assert torch.equal(wrapped.narrow(0, 4, 4), part)
    with pytest.raises(ShapeMismatchError) as failed:
        wrap([("a", torch.randn(2, 4))], slices)
    message = str(failed.value)
    assert all(s in message for s in ("'a'", "[2, 4]", "[4:8, 0:4]", "[4, 4]", "[8, 4]"))


class RankOne(torch.nn.Module):
    """Rank 1 of 2 of a tensor-parallel model: rows 4:8 of a tied embedding and head, a
    whole norm; its ``load_weights`` narrows what it is given as vLLM's loaders do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(3)
        self.given: list[str] = []

    def load_weights(self, weights: Iterable[NamedTensor]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            self.given.append(name)
            param = params[name]
            param.data.copy_(tensor if param.shape == tensor.shape else tensor.narrow(0, 4, 4))
        return set(self.given)


class Direct:
    """A lifecycle that loads into the live parameters."""

    name = "direct"

    def prepare(self, inst: ModelInstance) -> None:
        pass

    def load(self, inst: ModelInstance, tensors: Sequence[NamedTensor]) -> set[str]:
        return set(inst.model.load_weights(tensors))  # type: ignore[operator]

    def finalize(self, inst: ModelInstance) -> None:
        pass


def test_a_sink_with_slices_hands_the_loaders_box_tensors() -> None:
    model, vocab = RankOne(), torch.randn(8, 3)
    rows = (Box((4, 0), (8, 3)), (8, 3))
    target = VllmSink(
        [ModelInstance("main", model)],
        lifecycle=Direct(),
        quirks=[],
        delta=True,
        slices={"embed.weight": rows, "head.weight": rows},
    )
    target.prepare()
    target.load([("embed.weight", vocab[4:].clone()), ("norm.weight", torch.ones(3))])
    # The tie's fingerprint is the received box's: the same box, the same bytes.
    target.load([("head.weight", vocab[4:].clone())])
    target.finalize()
    assert model.given == ["embed.weight", "head.weight", "norm.weight"]
    assert torch.equal(model.embed.weight, vocab[4:])
    # A delta's kept copies are what was received: the boxes.
    assert target.state.copies["main"]["embed.weight"].shape == (4, 3)
    target.prepare()
    target.load([("embed.weight", vocab[4:].clone())])
    with pytest.raises(ReceiverFailedError, match=r"ties 'head\.weight' to 'embed\.weight'"):
        target.load([("head.weight", vocab[4:] + 1)])
    with pytest.raises(ShapeMismatchError, match=r"tensor 'embed\.weight': received shape"):
        target.load([("embed.weight", vocab[5:].clone())])


# -- the trainer side: each rank's shards as a pipeline stage of a collective sync sees them --


def _ranks_of(whole: torch.Tensor, dim: int, size: int) -> list[Sharded]:
    """Every rank's :class:`Sharded` of ``whole``, split along ``dim`` as FSDP2 splits it."""
    n, chunk = whole.shape[dim], -(-whole.shape[dim] // size)
    boxes: list[Box | None] = []
    for r in range(size):
        lo, hi = [0] * whole.dim(), list(whole.shape)
        lo[dim], hi[dim] = min(r * chunk, n), min((r + 1) * chunk, n)
        boxes.append(Box(tuple(lo), tuple(hi)) if hi[dim] > lo[dim] else None)
    out = []
    for r, held in enumerate(boxes):
        local = whole[tuple(map(slice, held.start, held.stop))] if held else whole.new_empty(0)
        out.append(Sharded("w", local, boxes, tuple(whole.shape), r))
    return out


def _whole_of(shards: list[Sharded]) -> torch.Tensor:
    """The tensor the ranks' shards make together (every element held by exactly one)."""
    out = torch.full(tuple(shards[0].shape), float("nan"), dtype=torch.float64)
    for one in shards:
        held = one.boxes[one.rank]
        if held is not None:
            out[tuple(map(slice, held.start, held.stop))] = one.local.double()
    return out


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=2, max_size=3),
    size=st.integers(1, 4),
    data=st.data(),
)
def test_indexing_a_sharded_tensor_indexes_every_ranks_shard(
    shape: list[int], size: int, data: st.DataObject
) -> None:
    whole = torch.arange(prod(shape), dtype=torch.float64).reshape(shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    index: list[Any] = []
    for n in shape[: data.draw(st.integers(1, len(shape)))]:
        if data.draw(st.booleans()):
            index.append(data.draw(st.integers(-n, n - 1)))
        else:
            a = data.draw(st.integers(0, n))
            index.append(slice(a, data.draw(st.integers(a, n))))
    shards = [s[tuple(index)] for s in _ranks_of(whole, dim, size)]
    want = whole[tuple(index)]
    assert all(tuple(s.shape) == tuple(want.shape) for s in shards)
    if want.numel():
        assert torch.equal(_whole_of(shards), want)


def test_a_sharded_tensor_refuses_by_name_an_index_it_cannot_follow() -> None:
    shard = _ranks_of(torch.zeros(4, 4), 0, 2)[0]
    with pytest.raises(ConfigError, match=r"tensor 'w': index slice\(None, None, 2\)"):
        shard[:, ::2]


def test_quantize_fp8_on_shards_is_the_whole_tensors_quantization_cut() -> None:
    from streamsync.adapters.quantize_fp8 import _quantize_sharded, quantize_block_fp8

    whole = torch.randn(4, 256, 96, generator=torch.Generator().manual_seed(0))
    want_fp8, want_scale = quantize_block_fp8(whole)
    for dim in (0, 1):  # experts split, rows split on a block boundary
        pairs = [_quantize_sharded("w", s, (128, 128)) for s in _ranks_of(whole, dim, 2)]
        assert torch.equal(_whole_of([f for f, _ in pairs]), want_fp8.double())
        assert torch.equal(_whole_of([s for _, s in pairs]), want_scale.double())
        assert pairs[0][1].name == "w_scale_inv"
    with pytest.raises(ConfigError, match=r"tensor 'w': trainer rank 0 holds columns 0:48"):
        _quantize_sharded("w", _ranks_of(whole, 2, 2)[0], (128, 128))
