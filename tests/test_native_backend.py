"""The ``streamsync`` vLLM weight-transfer backend without an engine: vLLM's factories and
base classes, our worker-side engine on a fake vLLM-style model, and ``weight_source``.

The worker engine is driven the way vLLM's worker drives it (parse the dict, then call the
engine), by a client that holds the engine in this process; the real server is in
``test_vllm_native.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from server_harness import ProtocolOnly

import streamsync as ss
from streamsync.facts import EngineFacts
from streamsync.testing.fakes import FakeVllmModel, fake_state_dict

pytestmark = pytest.mark.vllm


def over_json(info: Any) -> Any:
    """What crosses HTTP: JSON only (anything else, such as pickled bytes, fails here)."""
    return json.loads(json.dumps(info))


class InProcessClient:
    """A ``VLLMWeightSyncClient`` on a worker engine in this process, calling it as vLLM's
    worker does (dicts in, the engine's own parse), with what it is given through JSON."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.version: str | None = None
        self.active = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(over_json(init_info)))

    def shutdown_weight_transfer_engine(self) -> None:
        self.engine.shutdown()

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is active")
        self.engine.start_weight_update()
        self.active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.engine.update_weights(over_json(update_info))
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update()
        self.active = False
        self.version = weight_version


class LoadOnly:
    """A lifecycle for the fake model: ``load_weights`` only (it has nothing to process)."""

    name = "test-load-only"

    def prepare(self, inst: Any) -> None:
        pass

    def load(self, inst: Any, tensors: Any) -> set[str]:
        return set(inst.model.load_weights(tensors))

    def finalize(self, inst: Any) -> None:
        pass


@pytest.fixture
def worker() -> Iterator[tuple[Any, FakeVllmModel]]:
    from vllm.config import VllmConfig, WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import streamsync.vllm.native  # noqa: F401  (registers the backend)
    from streamsync.vllm.lifecycles import LIFECYCLES, register_lifecycle

    register_lifecycle(LoadOnly)

    model = FakeVllmModel()
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="streamsync"), VllmConfig(), torch.device("cpu"), model
    )
    yield engine, model
    engine.shutdown()
    LIFECYCLES.pop(LoadOnly.name, None)


def trainer(client: Any, source: Any, **options: Any) -> Any:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from streamsync.vllm.native import StreamsyncInitInfo

    options.setdefault("worker_options", {"lifecycle": LoadOnly.name, "quirks": []})
    options.setdefault("timeout", 20)
    return WeightTransferTrainerFactory.trainer_init(
        StreamsyncInitInfo(rank=0, bucket_bytes=64 << 10, **options),
        client=client,
        source=source,
    )


def test_send_weights_through_vllms_factories(worker: tuple[Any, FakeVllmModel]) -> None:
    from streamsync.vllm.native.trainer import StreamsyncTrainerEngine
    from streamsync.vllm.native.worker import StreamsyncWeightTransferEngine

    engine, model = worker
    assert isinstance(engine, StreamsyncWeightTransferEngine)
    client = InProcessClient(engine)
    for step in range(2):
        weights = fake_state_dict(seed=step)
        sender = trainer(client, weights) if step == 0 else sender  # noqa: F821
        assert isinstance(sender, StreamsyncTrainerEngine)
        sender.send_weights(weights, weight_version=f"v{step}")
        assert sender.last_report.tensors == len(weights)
        got = model.named_weights()
        assert torch.equal(got["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
        assert client.version == f"v{step}"
        assert engine.last_result.ok
    sender.shutdown()


def test_the_worker_count_comes_from_the_workers_and_is_checked(
    worker: tuple[Any, FakeVllmModel],
) -> None:
    """The workers say how many they are as they connect: a client with only vLLM's
    protocol calls needs no ``receivers``; a count given that they contradict is refused
    by name at init (not after a connect timeout)."""
    engine, model = worker
    sender = trainer(ProtocolOnly(InProcessClient(engine)), None)
    try:
        assert sender.receivers == 1
        weights = fake_state_dict(seed=3)
        sender.send_weights(weights)
        assert torch.equal(model.named_weights()["lm_head.weight"], weights["lm_head.weight"])
        assert sender.channel.facts == (EngineFacts.here(),)  # the worker's, not asked
    finally:
        sender.shutdown()
    with pytest.raises(ss.ConfigError, match=r"receivers=2\) but the engine's workers say .* 1"):
        trainer(ProtocolOnly(InProcessClient(engine)), None, receivers=2)
    sender = trainer(ProtocolOnly(InProcessClient(engine)), None, receivers=1)
    try:
        sender.send_weights(fake_state_dict(seed=4))
    finally:
        sender.shutdown()


def test_an_unreachable_server_is_named() -> None:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from streamsync.testing.peers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ss.PeerBrokenError, match=rf"vLLM server at {url} cannot be reached"):
        trainer(HTTPVLLMWeightSyncClient(url, timeout=5), None)


def test_errors_are_named_and_the_next_update_works(worker: tuple[Any, FakeVllmModel]) -> None:
    engine, model = worker
    client = InProcessClient(engine)
    sender = trainer(client, None)
    try:
        bad = {**fake_state_dict(seed=1), "model.no_such.weight": torch.zeros(2)}
        with pytest.raises(ss.UnknownTensorError, match=r"model\.no_such\.weight"):
            sender.send_weights(bad)
        assert not client.active  # the worker's update ended; the engine serves on
        # A second start while one runs is refused by the engine, by name.
        client.start_weight_update()
        with pytest.raises(ss.ReceiverFailedError, match="start_weight_update"):
            sender.send_weights(fake_state_dict(seed=2))
        client.finish_weight_update()
        weights = fake_state_dict(seed=3)
        sender.send_weights(weights)
        got = model.named_weights()["lm_head.weight"]
        assert torch.equal(got, weights["lm_head.weight"])
    finally:
        sender.shutdown()


def test_wrong_secret_fails_at_init(worker: tuple[Any, FakeVllmModel]) -> None:
    from streamsync.vllm.native.worker import TransferInit

    engine, _ = worker

    class WrongSecret(InProcessClient):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            init = TransferInit.from_wire(init_info)
            wrong = {**init.to_wire(), "transport": {"secret": "not-the-secret"}, "timeout": 5}
            super().init_weight_transfer_engine(wrong)

    with pytest.raises(ss.StreamsyncError) as info:
        trainer(WrongSecret(engine), None, secret="the-secret", timeout=5)
    assert isinstance(info.value, ss.AuthenticationError), repr(info.value)


def test_update_before_init_and_bad_init_are_named(worker: tuple[Any, FakeVllmModel]) -> None:
    engine, _ = worker
    with pytest.raises(ss.ConfigError, match="init_weight_transfer_engine"):
        engine.start_weight_update()
    with pytest.raises(ss.ConfigError, match="valid fields: endpoint"):
        engine.parse_init_info({"endpoint": "zmq+tcp://127.0.0.1:1", "packed": True})
    with pytest.raises(ss.ProtocolVersionError):
        engine.parse_init_info({"endpoint": "zmq+tcp://127.0.0.1:1", "version": 99})


def test_weight_source_runs_our_pipeline_for_vllms_backends() -> None:
    from vllm.distributed.weight_transfer.base import WeightSource

    from streamsync.adapters import cast, rename
    from streamsync.vllm.native import weight_source

    weights = fake_state_dict(seed=0)
    pipeline = rename({"lm_head.weight": "output.weight"}) | cast(torch.bfloat16)
    source = weight_source(weights, pipeline=pipeline)
    assert isinstance(source, WeightSource)
    meta = source.metadata()
    names = [m.name for m in meta]
    assert "output.weight" in names and "lm_head.weight" not in names
    assert all(m.dtype == torch.bfloat16 for m in meta)
    for _ in range(2):  # re-iterable, one fresh pass per round, agreeing with metadata()
        got = list(source)
        assert [(n, t.dtype, tuple(t.shape)) for n, t in got] == [
            (m.name, m.dtype, m.shape) for m in meta
        ]
    # vLLM's own grouping over it (what its backends iterate).
    groups = list(source.iter_groups())
    assert sum(len(names) for names, _ in groups) == len(meta)
    out = dict(got)
    assert torch.equal(out["output.weight"], weights["lm_head.weight"].to(torch.bfloat16))

    module = torch.nn.Linear(4, 3)
    assert [m.name for m in weight_source(module).metadata()] == ["weight", "bias"]
    fresh = weight_source(lambda: iter(weights.items()))
    assert len(list(fresh)) == len(list(fresh)) == len(weights)
    with pytest.raises(ss.ConfigError, match="only once"):
        weight_source(iter(weights.items()))


def test_a_worker_error_crosses_http_as_data(worker: tuple[Any, FakeVllmModel]) -> None:
    """Over HTTP only the server's error text comes back: the worker's error kind, message
    and partial report ride in it as data, and come out as the worker's own class."""
    from streamsync.vllm.native.trainer import _rpc_error

    engine, _ = worker
    failures: list[ss.StreamsyncError] = []

    class OverHttp(InProcessClient):
        def update_weights(self, update_info: dict[str, Any]) -> None:
            try:
                super().update_weights(update_info)
            except ss.StreamsyncError as exc:
                failures.append(exc)
                body = json.dumps({"error": {"message": f"Internal error: {exc}", "code": 500}})
                error = RuntimeError("500 Server Error: Internal Server Error")
                error.response = SimpleNamespace(text=body)  # type: ignore[attr-defined]
                raise error from None

    sender = trainer(OverHttp(engine), None)
    try:
        bad = {**fake_state_dict(seed=1), "model.no_such.weight": torch.zeros(2)}
        with pytest.raises(ss.UnknownTensorError, match=r"model\.no_such\.weight"):
            sender.send_weights(bad)
    finally:
        sender.shutdown()
    (failure,) = failures
    text = RuntimeError("500")
    text.response = SimpleNamespace(text=json.dumps({"detail": str(failure)}))  # type: ignore[attr-defined]
    error = _rpc_error("update_weights", text)
    assert type(error) is ss.UnknownTensorError
    assert "model.no_such.weight" in str(error) and "streamsync-result" not in str(error)
    assert error.report is not None and error.report == failure.report


def test_sharded_init_learns_the_workers_needs_as_they_connect() -> None:
    """``StreamsyncInitInfo(sharded=True)``: each worker says what it reads as it connects
    (nothing is asked of the client), keyed as ``EngineChannel.needs`` keys them, with
    workers of one layout sharing one tuple; workers that read slices are told their routes
    in a second init and the channel serves them there. (What a sharded sync then sends each
    worker is in ``test_vllm_native.py``, on a real TP=2 server.)"""
    from streamsync.engine.worker import WorkerReceivers
    from streamsync.facts import Box, Need, Needs, WorkerFacts
    from streamsync.vllm.native.worker import TransferInit

    told = [
        Needs(
            instance="main",
            layout="tp0",
            needs=(Need("a", (4, 2), "float32", Box((0, 0), (2, 2))),),
        ),
        Needs(
            instance="main",
            layout="tp0",
            needs=(Need("a", (4, 2), "float32", Box((0, 0), (2, 2))),),
        ),
        Needs(instance="main", layout="tp1", needs=(Need("a", (4, 2), "float32", None, "why"),)),
    ]
    engine_facts = EngineFacts(vllm_version=(0, 1, 2))

    class Workers(ProtocolOnly):
        """Three workers that connect where the init says and introduce themselves."""

        def __init__(self) -> None:
            self.inits: list[TransferInit] = []
            self.workers: list[WorkerReceivers] = []

        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            init = TransferInit.from_wire(over_json(init_info))
            self.inits.append(init)
            self.shutdown_weight_transfer_engine()
            for rank, needs in enumerate(told):
                facts = WorkerFacts(
                    rank=rank,
                    workers=len(told),
                    engine=engine_facts,
                    needs=(needs,) if init.needs else (),
                )
                worker = WorkerReceivers(f"worker{rank}", rank=rank)
                self.workers.append(worker)
                introduction = {"group": len(told), "facts": facts.to_bytes()}
                worker.open(init.endpoint_of(rank), {**init.transport, **introduction}, timeout=10)

        def shutdown_weight_transfer_engine(self) -> None:
            for worker in self.workers:
                worker.shutdown()
            self.workers = []

    client = Workers()
    plain = trainer(client, None, endpoint="zmq+tcp://127.0.0.1:0")
    try:
        assert dict(plain.needs) == {} and plain.receivers == 3
        assert [i.needs for i in client.inits] == [False]
        assert plain.channel.facts == (engine_facts,)
    finally:
        plain.shutdown()
    client.inits.clear()
    sender = trainer(client, None, sharded=True, endpoint="zmq+tcp://127.0.0.1:0")
    try:
        assert [i.needs for i in client.inits] == [True, False]
        first, second = client.inits
        assert first.routes == () and len(second.routes) == 3
        assert {r.endpoint for r in second.routes[:2]} != {second.routes[2].endpoint}
        needs = sender.needs
        assert sorted(needs) == ["worker0.main", "worker1.main", "worker2.main"]
        assert needs["worker0.main"].needs is needs["worker1.main"].needs
        assert needs["worker0.main"].needs == told[0].needs
        assert needs["worker2.main"].needs == told[2].needs
        assert needs["worker2.main"].instance == "worker2.main"
        with pytest.raises(TypeError):
            needs["worker0.main"] = told[0]  # type: ignore[index]
        sender._sync.wait_ready(timeout=10)  # every worker is on its route
    finally:
        sender.shutdown()


def test_staging_through_any_client_that_can_also_pause(
    worker: tuple[Any, FakeVllmModel],
) -> None:
    """``staged=True`` through a client with vLLM's protocol calls and ``pause``,
    ``reset_prefix_cache`` and ``resume`` (the few lines that make vLLM's Ray client one):
    each ``send_weights`` stages, then commits in one pause, in that order. A client that
    cannot pause is refused by name before anything moves."""
    engine, model = worker
    calls: list[str] = []

    class Pausing(ProtocolOnly):
        def pause(self, mode: str = "keep") -> None:
            calls.append(f"pause:{mode}")

        def reset_prefix_cache(self) -> None:
            calls.append("reset")

        def resume(self) -> None:
            calls.append("resume")

    sender = trainer(Pausing(InProcessClient(engine)), None, staged=True, pause_mode="wait")
    try:
        for step in range(2):
            weights = fake_state_dict(seed=10 + step)
            sender.send_weights(weights, weight_version=f"v{step}")
            got = model.named_weights()["lm_head.weight"]
            assert torch.equal(got, weights["lm_head.weight"])
        assert calls == ["pause:wait", "reset", "resume"] * 2
    finally:
        sender.shutdown()
    sender = trainer(ProtocolOnly(InProcessClient(engine)), None, staged=True)
    try:
        before = model.named_weights()["lm_head.weight"].clone()
        with pytest.raises(ss.ConfigError, match="ProtocolOnly cannot pause its engine"):
            sender.send_weights(fake_state_dict(seed=20))
        assert torch.equal(model.named_weights()["lm_head.weight"], before)
    finally:
        sender.shutdown()


def test_one_client_over_two_engines_counts_both() -> None:
    """A client that drives two engines as one (as vLLM's ``RayVLLMWeightSyncClient`` does
    with a list of actor handles, each call to every engine at once): each engine's worker
    says it is one of one, of its own engine; the trainer waits for both and every sync
    reaches both models."""
    import concurrent.futures

    from vllm.config import VllmConfig, WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import streamsync.vllm.native  # noqa: F401  (registers the backend)
    from streamsync.vllm.lifecycles import LIFECYCLES, register_lifecycle

    register_lifecycle(LoadOnly)
    models = [FakeVllmModel(), FakeVllmModel()]
    engines = [
        WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="streamsync"), VllmConfig(), torch.device("cpu"), m
        )
        for m in models
    ]
    clients = [InProcessClient(e) for e in engines]
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def every(name: str) -> Any:
        def call(*args: Any) -> None:
            for running in [pool.submit(getattr(c, name), *args) for c in clients]:
                running.result()

        return call

    class Both:
        init_weight_transfer_engine = staticmethod(every("init_weight_transfer_engine"))
        shutdown_weight_transfer_engine = staticmethod(every("shutdown_weight_transfer_engine"))
        start_weight_update = staticmethod(every("start_weight_update"))
        update_weights = staticmethod(every("update_weights"))
        finish_weight_update = staticmethod(every("finish_weight_update"))

    try:
        sender = trainer(Both(), None)
        try:
            assert sender.receivers == 2 and len(sender.channel.facts) == 2
            for step in range(2):
                weights = fake_state_dict(seed=30 + step)
                sender.send_weights(weights)
                for model in models:
                    got = model.named_weights()["lm_head.weight"]
                    assert torch.equal(got, weights["lm_head.weight"])
        finally:
            sender.shutdown()
    finally:
        pool.shutdown()
        for engine in engines:
            engine.shutdown()
        LIFECYCLES.pop(LoadOnly.name, None)
