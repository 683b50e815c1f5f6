"""``split_buffers`` and the receiver-side buffer router: a buffer updated by a training step
reaches every receiving model instance, from either side's knowledge of what is a buffer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import pytest
import torch

import streamsync as ss
from streamsync import ShapeMismatchError, UnknownTensorError, WireFormatError
from streamsync._channel import receiver_state
from streamsync.adapters import cast, split_buffers
from streamsync.adapters.split_buffers import (
    BufferRouter,
    BufferSink,
    buffer_names,
    manifest_names,
)
from streamsync.report import LoadResult
from streamsync.sink import BUFFER_MANIFEST

E, H = 4, 8


class Gate(torch.nn.Module):
    """A DeepSeek-V3-style router: scores plus an aux-loss-free balancing bias, a buffer
    that the training step updates outside autograd."""

    def __init__(self, bias_as_parameter: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(E, H))
        bias = torch.zeros(E)
        if bias_as_parameter:  # how vLLM's DeepSeek gate holds it
            self.e_score_correction_bias = torch.nn.Parameter(bias, requires_grad=False)
        else:
            self.register_buffer("e_score_correction_bias", bias)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(x @ self.weight.t())
        if self.training:
            with torch.no_grad():
                top = (scores + self.e_score_correction_bias).topk(2, dim=-1).indices
                load = torch.bincount(top.flatten(), minlength=E).float()
                self.e_score_correction_bias += 0.01 * torch.sign(load.mean() - load)
        return scores


class Layer(torch.nn.Module):
    def __init__(self, bias_as_parameter: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(H, H)
        self.gate = Gate(bias_as_parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.proj(x))


class Trainer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((layer(x) for layer in self.layers), torch.zeros(()))


class Engine(torch.nn.Module):
    """An engine model whose ``load_weights`` only knows linear ``.weight``/``.bias`` names
    and silently skips the rest, as many engine loaders do. ``layers`` picks which trainer
    layers it holds (a drafter holds fewer); ``bias_as_parameter`` holds the correction bias
    as a parameter, as vLLM does, so only the sender knows it is a buffer."""

    def __init__(self, layers: Sequence[int] = (0, 1), *, bias_as_parameter: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): Layer(bias_as_parameter) for i in layers}).to(
            torch.bfloat16
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        done = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name in params and name.endswith((".weight", ".bias")):
                    params[name].copy_(tensor)
                    done.add(name)
        return done


class LoadWeights:
    """A sink calling ``load_weights`` on each instance."""

    def __init__(self, *models: Engine) -> None:
        self.models = models
        self.seen: list[str] = []

    def prepare(self) -> None:
        self.seen = []

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.seen += [n for n, _ in tensors]
        for m in self.models:
            m.load_weights(tensors)

    def finalize(self) -> LoadResult:
        return LoadResult(loaded=tuple(self.seen))


BIAS = "layers.{}.gate.e_score_correction_bias"


def trained() -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer()
    opt = torch.optim.SGD(trainer.parameters(), lr=0.1)
    trainer(torch.randn(16, H)).pow(2).mean().backward()
    opt.step()
    assert trainer.layers[1].gate.e_score_correction_bias.abs().sum() > 0  # it moved
    return trainer


async def sync(trainer: Trainer, sink: Any, pipeline: Any = None) -> ss.SyncReport:
    url = "memory://split-buffers"
    out: dict[str, ss.SyncReport] = {}

    async def receive() -> None:
        out["recv"] = await ss.receive(url, sink)

    async with anyio.create_task_group() as tg:
        tg.start_soon(receive)
        await ss.send(trainer, url, pipeline=pipeline, bucket_bytes=4096)
    return out["recv"]


def assert_synced(trainer: Trainer, model: Engine) -> None:
    for i in model.layers:
        want = trainer.layers[int(i)].gate.e_score_correction_bias
        have = model.layers[i].gate.e_score_correction_bias
        assert have.dtype == torch.bfloat16
        assert torch.equal(have, want.to(torch.bfloat16)), f"layer {i}"
        assert torch.equal(
            model.layers[i].proj.weight, trainer.layers[int(i)].proj.weight.bfloat16()
        )


async def test_receiver_side_buffers_reach_main_and_drafter() -> None:
    trainer = trained()
    main, drafter = Engine(), Engine(layers=[1])
    # Without the router the engine loader silently drops the buffer: the test can fail.
    await sync(trainer, LoadWeights(main, drafter), cast(torch.bfloat16))
    assert main.layers["1"].gate.e_score_correction_bias.abs().sum() == 0

    sink = BufferSink(LoadWeights(main, drafter), {"main": main, "drafter": drafter})
    report = await sync(trainer, sink, cast(torch.bfloat16))
    assert_synced(trainer, main)
    assert_synced(trainer, drafter)
    assert BIAS.format(0) in report.loaded
    # ...and the buffers never reached load_weights.
    assert not any("e_score" in n for n in sink.sink.seen)  # type: ignore[attr-defined]


async def test_sender_side_manifest_routes_names_the_engine_holds_as_parameters() -> None:
    trainer = trained()
    main = Engine(bias_as_parameter=True)
    drafter = Engine(layers=[1], bias_as_parameter=True)
    # The receiving models register no buffer of that name: receiver-side routing alone
    # hands it to load_weights, which drops it.
    await sync(trainer, BufferSink(LoadWeights(main, drafter), [main, drafter]))
    assert main.layers["0"].gate.e_score_correction_bias.abs().sum() == 0

    sink = BufferSink(LoadWeights(main, drafter), [main, drafter])
    await sync(trainer, sink, split_buffers(trainer) | cast(torch.bfloat16))
    assert_synced(trainer, main)
    assert_synced(trainer, drafter)
    assert sink.router.applied == {
        "instance0": {BIAS.format(0), BIAS.format(1)},
        "instance1": {BIAS.format(1)},
    }


class _Declaring:
    """A sink that records what it loads and the buffer names declared to it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.declared: list[frozenset[str]] = []

    def prepare(self) -> None:
        pass

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.seen += [n for n, _ in tensors]

    def finalize(self) -> None:
        pass

    def declare_buffers(self, names: frozenset[str]) -> None:
        self.declared.append(names)


async def test_the_manifest_is_a_fact_of_the_stream_that_no_sink_loads() -> None:
    # The receive path takes the manifest out of the stream: a sink that routes buffers is
    # told the names, and no sink's load is handed the manifest tensor.
    trainer = trained()
    plain = LoadWeights(Engine())
    await sync(trainer, plain, split_buffers(trainer))
    assert plain.seen and BUFFER_MANIFEST not in plain.seen
    declaring = _Declaring()
    await sync(trainer, declaring, split_buffers(trainer))
    assert declaring.seen and BUFFER_MANIFEST not in declaring.seen
    assert declaring.declared == [buffer_names(trainer)]
    # A strict ModuleSink takes the stream as it takes the model's own tensors.
    twin = Trainer()
    await sync(trainer, ss.ModuleSink(twin), split_buffers(trainer))
    for name, want in trainer.state_dict().items():
        assert torch.equal(twin.state_dict()[name], want), name


def test_buffer_names_are_the_persistent_ones() -> None:
    assert buffer_names(Trainer()) == {BIAS.format(0), BIAS.format(1)}


async def test_adapter_sends_the_manifest_first_and_the_stream_unchanged() -> None:
    src = {"a": torch.ones(2), "b": torch.zeros(3)}
    out = [x async for x in split_buffers(["b", "z"])(ss.named_tensors(src))]
    assert out[0][0] == BUFFER_MANIFEST and out[0][1].dtype == torch.uint8
    assert out[1:] == list(src.items())
    assert manifest_names(out[0][1]) == {"b", "z"}


def test_adapter_refuses_what_is_not_names_or_a_module() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module or an iterable"):
        split_buffers("layers.0.bias")
    with pytest.raises(TypeError, match="must be str"):
        split_buffers([1, 2])  # type: ignore[list-item]


def _engine_pair() -> tuple[Engine, Engine]:
    return Engine(), Engine(layers=[1])


def test_apply_casts_and_reports_per_instance() -> None:
    main, drafter = _engine_pair()
    value = torch.arange(E, dtype=torch.float32)
    tensors = [(BIAS.format(1), value), ("layers.1.proj.weight", torch.ones(H, H))]
    rest, applied = BufferRouter({"main": main, "drafter": drafter}).split(tensors)
    assert [n for n, _ in rest] == ["layers.1.proj.weight"]
    assert applied == {"main": [BIAS.format(1)], "drafter": [BIAS.format(1)]}
    for m in (main, drafter):
        assert torch.equal(m.layers["1"].gate.e_score_correction_bias, value.bfloat16())


def test_shape_mismatch_names_buffer_and_instance_and_applies_nothing() -> None:
    main, drafter = _engine_pair()
    tensors = [(BIAS.format(0), torch.ones(E)), (BIAS.format(1), torch.ones(E + 1))]
    with pytest.raises(ShapeMismatchError, match=r"'layers\.1\.gate\.e_score.*'main'.*\[4\]"):
        BufferRouter({"main": main, "drafter": drafter}).split(tensors)
    assert main.layers["0"].gate.e_score_correction_bias.abs().sum() == 0


def test_declared_buffer_nobody_has() -> None:
    tensors = [("layers.9.gate.e_score_correction_bias", torch.ones(E))]
    with pytest.raises(UnknownTensorError, match=r"layers\.9.*'instance0'"):
        BufferRouter([Engine()], buffers=[tensors[0][0]]).split(tensors)
    router = BufferRouter([Engine()], buffers=[tensors[0][0]], strict=False)
    rest, _ = router.split(tensors)
    assert [n for n, _ in rest] == [tensors[0][0]] and router.unexpected == [tensors[0][0]]


def test_manifest_is_validated() -> None:
    with pytest.raises(WireFormatError, match="streamsync::buffers"):
        manifest_names(torch.ones(3))
    bad = torch.frombuffer(bytearray(b'{"a": 1}'), dtype=torch.uint8)
    with pytest.raises(WireFormatError, match="not a list"):
        manifest_names(bad)


async def test_manifest_lasts_one_sync() -> None:
    main = Engine(bias_as_parameter=True)
    sink = BufferSink(LoadWeights(main), [main])
    sink.declare_buffers(manifest_names(torch.frombuffer(bytearray(b'["x"]'), dtype=torch.uint8)))
    assert sink.router.is_buffer("x")
    await sink.prepare()
    assert not sink.router.is_buffer("x")


async def test_buffer_sink_lets_large_parameters_go_straight_into_the_model() -> None:
    import anyio

    import streamsync as ss
    from streamsync.adapters import BufferSink

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = torch.nn.Parameter(torch.zeros(3000))  # chunked in 4 KiB buckets
            self.register_buffer("bias", torch.zeros(2))

    trainer, receiver = Model(), Model()
    with torch.no_grad():
        trainer.big.copy_(torch.arange(3000.0))
        trainer.bias.fill_(5.0)
    sink = BufferSink(ss.ModuleSink(receiver), [receiver])
    async with (
        ss.open_sender("memory://bufsink-direct", slot_bytes=4096) as tx,
        ss.open_receiver("memory://bufsink-direct") as rx,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(lambda: ss.receive(rx, sink, timeout=5))
        await ss.send(trainer, tx, pipeline=split_buffers(trainer), timeout=5)
    assert receiver_state(rx).unpacker._staging is None  # no staging copy for "big"
    assert torch.equal(receiver.big, trainer.big) and torch.equal(receiver.bias, trainer.bias)
