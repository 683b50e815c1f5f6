"""ModuleSink: strict errors name the tensor and apply nothing of the bucket; reports."""

from __future__ import annotations

import pytest
import torch
from conftest import run_both

import streamsync as ss
from streamsync import DtypeMismatchError, ModuleSink, ShapeMismatchError, UnknownTensorError
from streamsync._channel import receiver_state
from streamsync.wire.slot import allocate_slot
from streamsync.wire.unpack import Unpacker


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2)
        self.register_buffer("stat", torch.zeros(2))


def bucket_of(**tensors: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return list(tensors.items())


@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        (("a.wieght", torch.ones(3, 4)), UnknownTensorError, ["'a.wieght'", "a.weight"]),
        (("b.weight", torch.ones(3, 3)), ShapeMismatchError, ["'b.weight'", "[3, 3]", "[2, 3]"]),
        (
            ("b.weight", torch.ones(2, 3, dtype=torch.float16)),
            DtypeMismatchError,
            ["'b.weight'", "torch.float16", "torch.float32"],
        ),
    ],
)
def test_strict_errors_name_the_tensor_and_apply_nothing(
    bad: tuple[str, torch.Tensor], error: type[Exception], words: list[str]
) -> None:
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sink = ModuleSink(model)
    sink.prepare()
    # The good tensor comes first in the bucket: it must not be applied either.
    with pytest.raises(error) as info:
        sink.load([("a.bias", torch.full((3,), 7.0)), bad])
    for word in words:
        assert word in str(info.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_loaded_and_missing_are_reported() -> None:
    model = Tiny()
    sink = ModuleSink(model)
    sink.prepare()
    sink.load([("a.weight", torch.ones(3, 4)), ("stat", torch.ones(2))])
    result = sink.finalize()
    assert result.loaded == ("a.weight", "stat")
    assert result.missing == ("a.bias", "b.bias", "b.weight")
    assert torch.equal(model.a.weight, torch.ones(3, 4))
    assert torch.equal(model.stat, torch.ones(2))


def test_sink_copies_so_reused_slots_cannot_corrupt_it() -> None:
    model = Tiny()
    sink = ModuleSink(model)
    slot = torch.ones(3, 4)
    sink.prepare()
    sink.load([("a.weight", slot)])
    slot.fill_(-1)  # the transport reuses the slot
    assert torch.equal(model.a.weight, torch.ones(3, 4))


def test_non_strict_skips_unknown_and_converts_dtype() -> None:
    model = Tiny()
    sink = ModuleSink(model, strict=False)
    sink.prepare()
    sink.load([("zzz", torch.ones(1)), ("stat", torch.ones(2, dtype=torch.float16))])
    result = sink.finalize()
    assert result.unexpected == ("zzz",)
    assert model.stat.dtype == torch.float32 and torch.equal(model.stat, torch.ones(2))
    with pytest.raises(ShapeMismatchError):
        sink.load([("stat", torch.ones(3))])


def test_tied_weights_count_as_loaded_through_either_name() -> None:
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(5, 4)
    model.head = torch.nn.Linear(4, 5, bias=False)
    model.head.weight = model.emb.weight
    sink = ModuleSink(model)
    sink.prepare()
    sink.load([("emb.weight", torch.ones(5, 4))])
    assert sink.finalize().missing == ()


class Three(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4))
        self.big = torch.nn.Parameter(torch.zeros(3000))  # 12000 bytes: chunked in 4 KiB
        self.c = torch.nn.Parameter(torch.zeros(4))


async def test_sync_error_carries_partial_report_and_sender_fails_too() -> None:
    model = Three()
    # "a" is applied with bucket 0; "c", wrong, comes in the last bucket, with the end of
    # "big" (written into the model in place as its chunks arrived).
    weights = {"a": torch.ones(4), "big": torch.arange(3000.0), "c": torch.ones(5)}
    out = await run_both(
        rx=lambda: ss.receive("memory://partial", ModuleSink(model), timeout=5),
        tx=lambda: ss.send(weights, "memory://partial?slots=4", bucket_bytes=4096, timeout=5),
    )
    assert isinstance(out["rx"], ShapeMismatchError) and "'c'" in str(out["rx"])
    report = out["rx"].report
    assert report is not None and not report.complete
    assert set(report.loaded) == {"a", "big"}
    assert torch.equal(model.a, torch.ones(4)) and torch.equal(model.c, torch.zeros(4))
    assert isinstance(out["tx"], ss.ReceiverFailedError)
    assert "'c'" in str(out["tx"])


async def test_module_sink_takes_a_stream_with_a_buffer_manifest() -> None:
    from streamsync.adapters import split_buffers

    trainer, receiver = Tiny(), Tiny()
    trainer.stat.fill_(3.0)
    out = await run_both(
        rx=lambda: ss.receive("memory://manifest", ModuleSink(receiver), timeout=5),
        tx=lambda: ss.send(
            trainer, "memory://manifest", pipeline=split_buffers(trainer), timeout=5
        ),
    )
    assert out["rx"].complete and out["rx"].missing == ()
    assert torch.equal(receiver.stat, trainer.stat)


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Parameter(torch.zeros(4))
        self.big = torch.nn.Parameter(torch.zeros(3000))  # 12000 bytes: chunked in 4 KiB


async def test_chunks_go_straight_into_the_module_tensor() -> None:
    receiver = Wide()
    trainer = {"small": torch.ones(4), "big": torch.arange(3000.0)}
    sender_side = ss.open_sender("memory://direct", slot_bytes=4096)
    receiving = ss.open_receiver("memory://direct")
    allocated: list[int] = []

    def recording(nbytes: int) -> torch.Tensor:
        allocated.append(nbytes)
        return allocate_slot(nbytes)

    async with sender_side as tx, receiving as rx:
        receiver_state(rx).unpacker = Unpacker(allocate=recording)
        out = await run_both(
            rx=lambda: ss.receive(rx, ModuleSink(receiver), timeout=5),
            tx=lambda: ss.send(trainer, tx, bucket_bytes=4096, timeout=5),
        )
        assert out["rx"].complete and out["rx"].missing == ()
        assert torch.equal(receiver.big, trainer["big"])
        assert torch.equal(receiver.small, trainer["small"])
        # No staging buffer: the chunks were written into receiver.big itself.
        assert allocated == [], allocated


async def test_chunked_shape_mismatch_raises_before_a_byte_is_written() -> None:
    receiver = Wide()
    out = await run_both(
        rx=lambda: ss.receive("memory://direct-bad", ModuleSink(receiver), timeout=5),
        tx=lambda: ss.send(
            {"big": torch.ones(3001)}, "memory://direct-bad", bucket_bytes=4096, timeout=5
        ),
    )
    assert isinstance(out["rx"], ShapeMismatchError) and "'big'" in str(out["rx"])
    assert torch.equal(receiver.big, torch.zeros(3000))
    assert out["rx"].report.loaded == ()


async def test_a_tensor_written_in_place_is_reported_as_applied() -> None:
    receiver = Wide()
    trainer = {"big": torch.arange(3000.0), "small": torch.ones(5)}  # "small" has the wrong shape
    sender_side = ss.open_sender("memory://direct-half", slot_bytes=4096)
    receiving = ss.open_receiver("memory://direct-half")
    async with sender_side as tx, receiving as rx:
        out = await run_both(
            rx=lambda: ss.receive(rx, ModuleSink(receiver), timeout=5),
            tx=lambda: ss.send(trainer, tx, bucket_bytes=4096, timeout=5),
        )
    # "big" completed in the bucket that failed: its bytes are in the module already, so the
    # partial report must say so.
    assert isinstance(out["rx"], ShapeMismatchError)
    assert out["rx"].report.loaded == ("big",) and not out["rx"].report.complete
    assert torch.equal(receiver.big, trainer["big"])


def test_an_unknown_name_without_a_close_match_gets_no_hint() -> None:
    sink = ModuleSink(Tiny())
    sink.prepare()
    with pytest.raises(UnknownTensorError) as info:
        sink.load([("zzzzzz", torch.ones(1))])
    assert "'zzzzzz'" in str(info.value) and "close matches" not in str(info.value)


def test_empty_tensors_are_not_taken_for_tied_weights() -> None:
    # Empty tensors share no storage even when their data pointers agree: loading one of
    # them does not load the other.
    model = torch.nn.Module()
    model.register_buffer("first", torch.zeros(0, 4))
    model.register_buffer("second", torch.zeros(0, 4))
    sink = ModuleSink(model)
    sink.prepare()
    sink.load([("first", torch.zeros(0, 4))])
    assert sink.finalize().missing == ("second",)


class Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 4))
        self.transposed = torch.nn.Parameter(torch.zeros(4, 6).t())  # not contiguous
        self.elsewhere = torch.nn.Parameter(torch.zeros(6, 4, device="meta"))  # not on the CPU


@pytest.mark.parametrize(
    ("strict", "name", "dtype", "offered"),
    [
        (True, "w", torch.float32, "w"),  # the module's own tensor
        (False, "w", torch.float16, None),  # converted by load, from the staging buffer
        (False, "unknown", torch.float32, None),  # skipped by load
        (True, "transposed", torch.float32, None),  # chunks cannot be written into a view
        (True, "elsewhere", torch.float32, None),  # nor into memory off the CPU
    ],
)
def test_target_offers_only_a_tensor_chunks_can_be_written_into(
    strict: bool, name: str, dtype: torch.dtype, offered: str | None
) -> None:
    model = Odd()
    got = ModuleSink(model, strict=strict).target(name, dtype, (6, 4))
    if offered is None:
        assert got is None
    else:
        assert got is not None and got.data_ptr() == getattr(model, offered).data_ptr()


class _Plain:
    def prepare(self) -> None: ...
    def load(self, tensors: object) -> None: ...
    def finalize(self) -> None: ...


class _Targeting(_Plain):
    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None: ...


class _Versioned(_Targeting):
    def __init__(self) -> None:
        self.version: int | None = None


class _TargetNone(_Plain):
    target = None
    version = 3


class _VersionOnly(_Plain):
    version = 3


@pytest.mark.parametrize(
    "sink",
    [_Plain(), _Targeting(), _Versioned(), _TargetNone(), _VersionOnly(), ModuleSink(Tiny())],
    ids=lambda sink: type(sink).__name__,
)
def test_the_sink_kind_checks_agree_with_isinstance(sink: ss.Sink) -> None:
    from streamsync.sink import VersionedSink, as_target, as_versioned

    assert (as_target(sink) is sink) is isinstance(sink, ss.TargetSink)
    assert (as_target(sink) is None) is not isinstance(sink, ss.TargetSink)
    versioned = isinstance(sink, VersionedSink)
    assert (as_versioned(sink) is sink) is versioned
    assert (as_versioned(sink) is None) is not versioned


def test_each_sink_kind_declares_the_hooks_a_receive_and_a_staging_call() -> None:
    # The receive and StagingSink find these hooks by protocol: a sink that lacks one is
    # loaded, staged and checked without it.
    from test_boxes import Direct

    from streamsync.sink import CopyKeepingSink, StageCheckedSink, VersionedSink, WrappingSink
    from streamsync.staging import StagingSink
    from streamsync.vllm.sink import ModelInstance, VllmSink

    plain = ModuleSink(Tiny())
    engine = VllmSink([ModelInstance("main", Tiny())], lifecycle=Direct(), quirks=[], delta=True)
    staged = StagingSink(plain)
    assert isinstance(plain, StageCheckedSink) and isinstance(plain, VersionedSink)
    assert not isinstance(plain, CopyKeepingSink) and not isinstance(plain, WrappingSink)
    assert isinstance(engine, StageCheckedSink) and isinstance(engine, CopyKeepingSink)
    assert not isinstance(engine, WrappingSink)
    assert isinstance(staged, WrappingSink) and staged.inner is plain
    assert not isinstance(staged, StageCheckedSink)
