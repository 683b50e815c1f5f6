"""Sharded syncs without vLLM: each worker receives only the slices its needs name, over
every transport, with delta syncs on the slices. The same into a real TP=2 engine is in
``test_vllm_sharded.py``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from test_engine import ThreadEngine, rpc

import streamsync as ss
from streamsync.boxes import slices_of
from streamsync.engine.channel import EngineChannel
from streamsync.engine.messages import Route, WorkerOptions
from streamsync.engine.routes import derive_endpoint, plan_routes
from streamsync.facts import Box, Need, Needs
from streamsync.testing.peers import free_port
from streamsync.wire.slot import ALIGN

SHAPES = {"rows": (8, 4), "cols": (4, 8), "norm": (4,), "bias": (8,)}


def needs_of(rank: int, layout: str = "") -> Needs:
    """Rank ``rank`` of two reads half of ``rows`` (dim 0) and of ``cols`` (dim 1), all of
    ``norm``, and nothing of ``bias`` (not in its checkpoint: it travels whole)."""
    return Needs(
        instance="main",
        layout=layout or f"rank{rank}",
        needs=(
            Need("rows", (8, 4), "float32", Box((4 * rank, 0), (4 * rank + 4, 4))),
            Need("cols", (4, 8), "float32", Box((0, 4 * rank), (4, 4 * rank + 4))),
            Need("norm", (4,), "float32", None),
        ),
    )


def expected(weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {
        "rows": weights["rows"][4 * rank : 4 * rank + 4],
        "cols": weights["cols"][:, 4 * rank : 4 * rank + 4],
        "norm": weights["norm"],
        "bias": weights["bias"],
    }


class SliceSink:
    """Keeps what a worker received, by name, across syncs (and patches it in place)."""

    def __init__(self, store: dict[str, torch.Tensor], versions: dict[str, int | None]) -> None:
        self.store, self.versions = store, versions
        self.loaded: set[str] = set()

    @property
    def version(self) -> int | None:
        return self.versions.get("v")

    @version.setter
    def version(self, version: int | None) -> None:
        self.versions["v"] = version

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        kept = self.store.get(name)
        if kept is None or kept.dtype != dtype or tuple(kept.shape) != shape:
            kept = self.store[name] = torch.empty(shape, dtype=dtype)
        return kept

    fail = False

    def prepare(self) -> None:
        self.loaded = set()

    def load(self, tensors: Any) -> None:
        if self.fail:
            raise ss.ReceiverFailedError("this worker's loader broke")
        for name, tensor in tensors:
            if self.store.get(name) is not tensor:
                self.store[name] = tensor.clone()
            self.loaded.add(name)

    def finalize(self) -> ss.LoadResult:
        result = ss.LoadResult(loaded=tuple(sorted(self.loaded)))
        return msgspec.structs.replace(result, instances={"main": result})


class SlicedEngine(ThreadEngine):
    """Two thread workers that say what they read (:func:`needs_of`) and keep what they
    receive; ``routes`` records the route each worker was told."""

    def __init__(self, layouts: tuple[str, str] = ("", "")) -> None:
        super().__init__([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)])
        self.layouts = layouts
        self.stores: list[dict[str, torch.Tensor]] = [{}, {}]
        self.versions: list[dict[str, int | None]] = [{}, {}]
        self.routes: list[Route | None] = [None, None]
        self.failing: set[int] = set()  # ranks whose sink fails at its first bucket

    async def needs(self) -> list[list[Needs]]:
        told = [rpc([needs_of(w, self.layouts[w]).to_wire()]) for w in range(2)]
        return [[Needs.from_wire(n, rank=w) for n in one] for w, one in enumerate(told)]

    def _worker_receive(self, rank: int, endpoint: str, options: Any) -> dict[str, Any]:
        def sink(opts: WorkerOptions, route: Route | None) -> ss.Sink:
            self.routes[rank] = route
            sink = SliceSink(self.stores[rank], self.versions[rank])
            sink.fail = rank in self.failing
            return sink

        return self.workers[rank].handle(endpoint, options, sink).to_wire()


@pytest.fixture
def engine() -> Iterator[SlicedEngine]:
    engine = SlicedEngine()
    for rank, worker in enumerate(engine.workers):
        worker.rank = rank
    yield engine
    engine.shutdown()


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def endpoints(tmp_path: Path) -> list[str]:
    tag = f"{os.getpid()}-{tmp_path.name[-12:]}"
    return [
        f"torch+gloo://127.0.0.1:{free_port()}",
        f"shm://routes-{tag}",
        "zmq+tcp://127.0.0.1:0",
        f"zmq+ipc://{tmp_path}/routes.sock",
    ]


# Every transport an engine's workers reach from other threads or processes (``memory://``
# stays on one event loop, and a channel hosts its senders on a loop of its own).
@pytest.mark.parametrize("kind", ["shm", "zmq+tcp", "zmq+ipc", "torch+gloo"])
def test_each_worker_receives_only_its_slices(
    engine: SlicedEngine, kind: str, tmp_path: Path
) -> None:
    endpoint = next(e for e in endpoints(tmp_path) if e.startswith(kind))
    with EngineChannel(engine, endpoint, sharded=True, timeout=20) as sync:
        for step in range(2):
            trainer = weights(step)
            report = sync.update(trainer)
            for rank in (0, 1):
                want = expected(trainer, rank)
                assert sorted(engine.stores[rank]) == sorted(want)
                for name, tensor in want.items():
                    assert torch.equal(engine.stores[rank][name], tensor), (rank, name)
            # Each worker's bucket: its halves of rows and cols (64 B each), the replicated
            # norm (16 B) and the unsliced bias (32 B), each entry 64-byte aligned.
            share = 3 * ALIGN + 8 * 4
            assert report.worker_bytes == {"worker0": share, "worker1": share}
            assert report.rank_bytes == {0: 2 * share} and report.wire_bytes == 2 * share
            assert report.unsliced == ("bias",)
            assert set(report.instances) == {"worker0.main", "worker1.main"}
    assert engine.routes[0] is not None and engine.routes[1] is not None
    assert engine.routes[0].endpoint != engine.routes[1].endpoint


def test_delta_syncs_send_each_worker_the_changes_in_its_slices(engine: SlicedEngine) -> None:
    endpoint = f"shm://routes-delta-{os.getpid()}"
    trainer = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    with EngineChannel(engine, endpoint, sharded=True, delta=True, timeout=20) as sync:
        first = sync.update(trainer)
        assert first.delta is not None and first.delta.base is None  # the first is full
        trainer["rows"][1, 2] = 1.0  # in worker 0's rows
        trainer["cols"][3, 7] = 2.0  # in worker 1's columns
        for step in range(3):
            report = sync.update(trainer)
            for rank in (0, 1):
                for name, tensor in expected(trainer, rank).items():
                    assert torch.equal(engine.stores[rank][name], tensor), (step, rank, name)
            assert report.delta is not None and report.delta.base is not None
            trainer["norm"][step] += 1.0
        # A delta carries far fewer bytes than the slices themselves.
        assert sum(report.worker_bytes.values()) < first.wire_bytes


def test_replicas_of_one_layout_share_a_route() -> None:
    needs = {
        "engine0.worker0.main": needs_of(0),
        "engine0.worker1.main": needs_of(1),
        "engine1.worker0.main": needs_of(0, "rank0-again"),
        "engine1.worker1.main": needs_of(1),
    }
    plans = plan_routes([k.rpartition(".")[0] for k in needs], needs)
    assert [p.workers for p in plans] == [
        ["engine0.worker0", "engine1.worker0"],
        ["engine0.worker1", "engine1.worker1"],
    ]
    assert plans[0].layouts == ("rank0", "rank0-again") and plans[1].layouts == ("rank1",)


def test_slices_of_a_worker_bound_its_instances_and_drop_names_one_reads_whole() -> None:
    drafter = Needs(
        instance="drafter",
        layout="d",
        needs=(
            Need("rows", (8, 4), "float32", Box((2, 0), (6, 4))),
            Need("cols", (4, 8), "float32", None),
        ),
    )
    slices = slices_of([needs_of(0), drafter])
    assert slices == {"rows": (Box((0, 0), (6, 4)), (8, 4))}


def test_route_endpoints_derive_from_the_channels() -> None:
    port = free_port()
    assert derive_endpoint(f"zmq+tcp://127.0.0.1:{port}", 0) == f"zmq+tcp://127.0.0.1:{port}"
    assert derive_endpoint(f"zmq+tcp://127.0.0.1:{port}", 2) == f"zmq+tcp://127.0.0.1:{port + 2}"
    assert derive_endpoint("zmq+tcp://127.0.0.1:0", 1) == "zmq+tcp://127.0.0.1:0"
    assert derive_endpoint("shm://demo?slots=3", 1) == "shm://demo.1?slots=3"
    assert derive_endpoint("zmq+ipc:///tmp/a.sock", 1) == "zmq+ipc:///tmp/a.sock.1"
    assert derive_endpoint("torch+gloo://10.0.0.1:29500", 1) == "torch+gloo://10.0.0.1:29501"


def test_a_trainer_tensor_of_another_shape_fails_by_name(engine: SlicedEngine) -> None:
    with EngineChannel(engine, f"shm://routes-shape-{os.getpid()}", sharded=True) as sync:
        bad = {**weights(0), "rows": torch.zeros(6, 4)}
        with pytest.raises(ss.ShapeMismatchError, match=r"'rows'.*\[6, 4\].*\[8, 4\]"):
            sync.update(bad)
        assert sync.update(weights(1)).complete


def test_a_worker_that_fails_fails_the_sync_on_every_route_and_the_next_is_full(
    engine: SlicedEngine,
) -> None:
    endpoint = f"shm://routes-fail-{os.getpid()}"
    with EngineChannel(engine, endpoint, sharded=True, delta=True, timeout=20) as sync:
        sync.update(weights(0))
        assert sync.update(weights(1)).delta.base is not None  # type: ignore[union-attr]
        engine.failing = {1}
        with pytest.raises(ss.ReceiverFailedError, match=r"worker 1 .*loader broke") as info:
            sync.update(weights(2))
        assert info.value.report is not None and not info.value.report.complete
        # Worker 0's route may have completed before worker 1's failure reached it; the
        # sync still failed, and no route keeps a baseline the next sync could diff against.
        engine.failing = set()
        after = sync.update(weights(3))
        assert after.delta is not None and after.delta.base is None  # full: versions in doubt
        for rank in (0, 1):
            for name, tensor in expected(weights(3), rank).items():
                assert torch.equal(engine.stores[rank][name], tensor), (rank, name)


def test_a_channel_into_tensor_parallel_workers_is_sharded_unless_told_otherwise(
    engine: SlicedEngine,
) -> None:
    assert EngineChannel(engine, "shm://auto").sharded
    assert not EngineChannel(engine, "shm://auto", sharded=False).sharded
    assert not EngineChannel(engine, "shm://auto", require_all=False).sharded
    single = SlicedEngine()
    single.workers = single.workers[:1]
    try:
        assert not EngineChannel(single, "shm://auto").sharded  # one worker reads it all
    finally:
        single.shutdown()


def test_a_collective_sync_refuses_by_name_an_adapter_that_needs_whole_tensors() -> None:
    from streamsync.adapters import cast, expand_moe, quantize_fp8, rename, split_buffers
    from streamsync.engine.collective import check_pipeline

    check_pipeline(cast(torch.bfloat16) | rename({"a": "b"}) | expand_moe(when="always"))
    check_pipeline(split_buffers(["norm"]) | quantize_fp8())

    async def doubled(source: Any) -> Any:
        async for name, tensor in source:
            yield name, tensor * 2

    with pytest.raises(ss.ConfigError, match=r"stage .*doubled.* runs on whole tensors"):
        check_pipeline(rename({"a": "b"}) | doubled)
