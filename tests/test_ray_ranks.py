"""Trainer ranks as Ray actors into a TP=2 engine actor on another node, on a real Ray
cluster of two nodes on this machine (``ray.cluster_utils.Cluster``): two FSDP2 rank actors
in a gloo group on the trainer's node, an ``AsyncLLM`` with two tensor-parallel workers in an
actor on the engine's node. Rank 0 drives the engine (``WeightSync(handle, endpoint,
sharded=True, ranks=Ranks())``), rank 1 takes part (``RankPeer``); each sends its own shards
from its node's address, sharded, delta and staged. After each step the engine serves exactly
what a plain full sync of the same weights gives it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from math import prod
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import extra
from ray_harness import (
    ENGINE,
    ENGINE_ENV,
    AsyncEngine,
    TrainerRank,
    die,
    pausing_ray_client,
    tokens_reach,
    worker_path,
    worker_pids,
)

import streamsync as ss
from streamsync.boxes import slices_of
from streamsync.cli.verify import PROMPTS
from streamsync.testing.models import build_tiny_model

pytestmark = pytest.mark.vllm

ray = extra("ray", "ray")

STEPS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:
    """The trainer's node (the head) and the engine's node, with a TP=2 engine actor there."""
    from ray.cluster_utils import Cluster

    worker_path()
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"trainer": 2}, "include_dashboard": False},
    )
    engine_node = nodes.add_node(num_cpus=1, resources={"engine": 1})
    ray.init(address=nodes.address)
    path = tmp_path_factory.mktemp("ray-ranks")
    build_tiny_model(path, "dense", seed=0)
    env = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    options = {"num_cpus": 0, "resources": {"engine": 1}, "runtime_env": {"env_vars": env}}
    engine = (
        ray.remote(AsyncEngine)
        .options(**options)
        .remote(
            str(path),
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            weight_transfer="streamsync",  # vLLM's weight-transfer API too
            **ENGINE,
        )
    )
    try:
        ray.get(engine.__ray_ready__.remote(), timeout=600)
        yield engine, engine_node, path
    finally:
        ray.kill(engine)
        ray.shutdown()
        nodes.shutdown()


def rank_actors(path: Path) -> list[Any]:
    """Two FSDP2 rank actors on the trainer's node, in a gloo group of their own (its store
    on a port rank 0 bound)."""
    options = {"num_cpus": 0, "resources": {"trainer": 1}}
    ranks = [ray.remote(TrainerRank).options(**options).remote(str(path), r, 2) for r in range(2)]
    master = ray.get(ranks[0].master.remote())
    ray.get([r.join.remote(master) for r in ranks])
    return ranks


def node_of(actor: Any) -> str:
    ref = actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
    return str(ray.get(ref))


@pytest.mark.timeout(900)
def test_two_rank_actors_sync_a_tp2_engine_actor_on_another_node(
    cluster: tuple[Any, Any, Path],
) -> None:
    """Sharded, delta and staged, 3 steps: each equals a plain full sync of the same weights
    (tokens and prompt logprobs exactly); each rank sent its worker's slices and assembled no
    tensor whole; each worker got the bytes of what it reads; the last step stages while a
    request generates (half-way through rank 1's shards the engine must produce more tokens)
    and the request's later tokens carry the committed version."""
    engine, engine_node, path = cluster
    ranks = rank_actors(path)
    rank0, rank1 = ranks
    try:
        here = node_of(rank0)
        assert node_of(rank1) == here != engine_node.node_id == node_of(engine)
        open_ranks(ranks, engine, timeout=60)
        needs = ray.get(rank0.needs.remote())
        reports, seen = [], []
        for step in range(STEPS - 1):
            report, told = ray.get([rank0.update.remote(step), rank1.update.remote(step)])
            assert report.rank_bytes == told.rank_bytes
            reports.append(report)
            seen.append(ray.get(engine.outputs.remote()))
        running = engine.generate.remote([[1, 2, 3, 4]], 300)
        started = tokens_reach(engine, 1)
        staged, told = ray.get(
            [
                rank0.stage.remote(STEPS - 1),
                rank1.update.remote(STEPS - 1, partial(tokens_reach, engine, started + 3)),
            ]
        )
        assert staged.rank_bytes == told.rank_bytes
        at_commit = ray.get(engine.generated.remote())
        reports.append(ray.get(rank0.commit.remote()))
        seen.append(ray.get(engine.outputs.remote()))
        ((_, spans),) = ray.get(running, timeout=300)
        assembled = ray.get([r.close.remote() for r in ranks])
        want = []
        for step in range(STEPS):
            ray.get(rank0.plain.remote(engine, step))
            want.append(ray.get(engine.outputs.remote()))
    finally:
        for actor in ranks:
            ray.kill(actor)
    for got, expected in zip(seen, want, strict=True):
        assert got.tokens == expected.tokens and got.max_logprob_diff(expected) == 0
    assert seen[0].max_logprob_diff(seen[-1]) > 0  # the steps moved the weights
    full, *deltas = reports
    assert full.delta is not None and full.delta.base is None
    assert all(r.delta is not None and r.delta.base is not None for r in deltas)
    assert all("apply" in r.phases for r in reports), reports[0].phases
    # Each worker got the bytes of what it reads (fp32), as from an in-process engine; the
    # deltas less.
    for w in range(2):
        mine = [n for k, n in needs.items() if k.startswith(f"worker{w}.")]
        assert full.worker_bytes[f"worker{w}"] == read_bytes(needs, w), w
        assert all(r.worker_bytes[f"worker{w}"] < full.worker_bytes[f"worker{w}"] for r in deltas)
        # No rank held a whole tensor that a worker reads in part: each assembled that
        # worker's box (half of it).
        slices = slices_of(mine)
        assert slices, "each worker reads part of the TP-split tensors"
        for name, (box, shape) in slices.items():
            assert assembled[w][name] == prod(box.shape) < prod(shape), name
    # Tokens came while the version staged; the later ones carry it.
    assert spans[0][0] != str(staged.sync_id) and spans[-1][0] == str(staged.sync_id), spans
    assert at_commit >= started + 3 and spans[-1][1] >= at_commit, (started, at_commit, spans)


@pytest.mark.timeout(900)
def test_vllms_ray_client_shards_deltas_and_stages_into_the_tp2_actor(
    cluster: tuple[Any, Any, Path],
) -> None:
    """The same through vLLM's weight-transfer API: ``StreamsyncInitInfo`` (sharded, delta,
    staged, no ``receivers``) with vLLM's ``RayVLLMWeightSyncClient`` and the documented
    pause, from the driver on the trainer's node. Each step equals a plain full sync of the
    same weights; the workers got the bytes of what they read; the last version stages while
    a request generates, and its later tokens carry the version given."""
    from rank_harness import new_weights
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from streamsync.vllm import WeightSync
    from streamsync.vllm.native import StreamsyncInitInfo
    from streamsync.vllm.ray import node_address

    engine, _, path = cluster
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    full = {n: t.detach().clone() for n, t in model.state_dict().items()}
    endpoint = f"zmq+tcp://{node_address()}:0"
    info = StreamsyncInitInfo(rank=0, endpoint=endpoint, sharded=True, delta=True, staged=True)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=pausing_ray_client(engine), source=ModuleSource(model)
    )
    reports, seen = [], []
    try:
        assert trainer.receivers == 2
        needs = dict(trainer.needs)
        for step in range(STEPS - 1):
            model.load_state_dict(new_weights(full, step))
            trainer.send_weights(weight_version=f"native-{step}")
            reports.append(trainer.last_report)
            seen.append(ray.get(engine.outputs.remote()))
        model.load_state_dict(new_weights(full, STEPS - 1))
        running = engine.generate.remote([[1, 2, 3, 4]], 500)
        tokens_reach(engine, 1)
        started = 0

        def held() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal started
            items = list(model.state_dict().items())
            for i, item in enumerate(items):
                if i == 0:  # the stage has begun
                    started = ray.get(engine.generated.remote())
                if i == len(items) // 2:
                    tokens_reach(engine, started + 3)
                yield item

        trainer.stage_weights(held())
        at_commit = ray.get(engine.generated.remote())
        reports.append(trainer.commit_weights(f"native-{STEPS - 1}"))
        seen.append(ray.get(engine.outputs.remote()))
        ((_, spans),) = ray.get(running, timeout=300)
    finally:
        trainer.shutdown()
    want = []
    with WeightSync(engine, endpoint) as plain:
        for step in range(STEPS):
            plain.update(new_weights(full, step))
            want.append(ray.get(engine.outputs.remote()))
    for got, expected in zip(seen, want, strict=True):
        assert got.tokens == expected.tokens and got.max_logprob_diff(expected) == 0
    full_report, *deltas = reports
    assert full_report.delta is not None and full_report.delta.base is None
    assert all(r.delta is not None and r.delta.base is not None for r in deltas)
    # vLLM's protocol brings back no worker's report: the bytes are the sender's, the sum
    # of what each worker reads.
    assert full_report.wire_bytes == read_bytes(needs, 0) + read_bytes(needs, 1)
    assert spans[0][0] != spans[-1][0] == f"native-{STEPS - 1}", spans
    assert at_commit >= started + 3 and spans[-1][1] >= at_commit, (started, at_commit, spans)


def read_bytes(needs: dict[str, Any], worker: int) -> int:
    """The bytes of what worker ``worker`` reads (fp32): its boxes, or whole tensors."""
    mine = [n for k, n in needs.items() if k.startswith(f"worker{worker}.")]
    reads = {
        need.name: prod(need.box.shape if need.box is not None else need.shape)
        for instance in mine
        for need in instance.needs
    }
    return 4 * sum(reads.values())


def open_ranks(ranks: list[Any], engine: Any, timeout: float) -> None:
    rank0, rank1 = ranks
    ray.get(
        [
            rank0.open.remote(engine, delta=True, staged=True, timeout=timeout),
            rank1.open.remote(engine, delta=True, timeout=timeout),
        ]
    )


def served_version(engine: Any) -> str:
    ((_, spans),) = ray.get(engine.generate.remote([PROMPTS[0]], 2))
    return str(spans[-1][0])


@pytest.mark.timeout(900)
def test_a_rank_actor_that_dies_leaves_the_engine_on_its_old_version(
    cluster: tuple[Any, Any, Path],
) -> None:
    """Rank 0's actor SIGKILLed half-way through its shards of a staged sync: the engine
    goes on serving the version before, untouched; the next trainer's first sync is full
    and the engine then serves exactly what a plain full sync gives it."""
    engine, _, path = cluster
    ranks = rank_actors(path)
    try:
        open_ranks(ranks, engine, timeout=30)
        ray.get([r.update.remote(0) for r in ranks])
        before, version = ray.get(engine.outputs.remote()), served_version(engine)
        dying, peer = ranks[0].update.remote(1, die), ranks[1].update.remote(1)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(dying, timeout=120)
        with pytest.raises(ss.StreamsyncError) as info:
            ray.get(peer, timeout=120)
        assert "trainer rank 1 of 2" in str(info.value) and "a rank is gone" in str(info.value)
        after = ray.get(engine.outputs.remote())
        assert after.tokens == before.tokens and after.max_logprob_diff(before) == 0
        assert served_version(engine) == version
    finally:
        for actor in ranks:
            ray.kill(actor)
    # The next trainer's first sync finds the workers still in the dead trainer's sync
    # (it took about 55 s here with the dead one's timeout at 30 s): its own timeout is
    # longer, so that it outlasts that.
    ranks = rank_actors(path)
    try:
        open_ranks(ranks, engine, timeout=90)
        report, _ = ray.get([r.update.remote(1) for r in ranks])
        synced = ray.get(engine.outputs.remote())
        ray.get([r.close.remote() for r in ranks])
        ray.get(ranks[0].plain.remote(engine, 1))
        want = ray.get(engine.outputs.remote())
    finally:
        for actor in ranks:
            ray.kill(actor)
    assert report.delta is not None and report.delta.base is None  # full
    assert synced.tokens == want.tokens and synced.max_logprob_diff(want) == 0
    assert synced.max_logprob_diff(before) > 0


@pytest.mark.timeout(900)
def test_a_killed_engine_worker_fails_the_sync_by_the_actors_name(
    cluster: tuple[Any, Any, Path],
) -> None:
    """SIGKILL of one of the engine's two worker processes half-way through rank 0's shards:
    the sync fails on both ranks within the channel's timeout, naming the engine's actor.
    (Last in this module: the engine is gone after it.)"""
    engine, _, path = cluster
    workers = ray.get(engine.__ray_call__.remote(worker_pids))
    assert len(set(workers)) == 2
    actor_id = engine._actor_id.hex()[:12]
    ranks = rank_actors(path)
    try:
        open_ranks(ranks, engine, timeout=30)
        ray.get([r.update.remote(0) for r in ranks])
        kill = partial(os.kill, workers[1], signal.SIGKILL)
        started = time.monotonic()
        failing = [ranks[0].update.remote(1, kill), ranks[1].update.remote(1)]
        for ref in failing:
            with pytest.raises(ss.StreamsyncError) as info:
                ray.get(ref, timeout=120)
            assert f"AsyncEngine actor {actor_id}" in str(info.value), info.value
        assert time.monotonic() - started < 30 + 15
    finally:
        for actor in ranks:
            ray.kill(actor)
