"""Trainer ranks as Ray actors into a TP=2 engine actor on another node, on a real Ray
cluster of two nodes on this machine (``ray.cluster_utils.Cluster``): two FSDP2 rank actors
in a gloo group on the trainer's node, an ``AsyncLLM`` with two tensor-parallel workers in an
actor on the engine's node. Rank 0 drives the engine (``WeightSync(handle, endpoint,
sharded=True, ranks=Ranks())``), rank 1 takes part (``RankPeer``); each sends its own shards
from its node's address, sharded, delta and staged. After each step the engine serves exactly
what a plain full sync of the same weights gives it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import pytest
from conftest import extra
from ray_harness import ENGINE, ENGINE_ENV, AsyncEngine, TrainerRank, worker_path

from streamsync.boxes import slices_of
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
        .remote(str(path), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    )
    try:
        ray.get(engine.__ray_ready__.remote(), timeout=600)
        yield engine, engine_node, path
    finally:
        ray.kill(engine)
        ray.shutdown()
        nodes.shutdown()


def rank_actors(path: Path) -> list[Any]:
    """Two FSDP2 rank actors on the trainer's node, in a gloo group of their own."""
    from streamsync.vllm.ray import node_address

    with socket.socket() as s:
        s.bind((node_address(), 0))
        master = f"{node_address()}:{s.getsockname()[1]}"
    options = {"num_cpus": 0, "resources": {"trainer": 1}}
    return [
        ray.remote(TrainerRank).options(**options).remote(str(path), rank, 2, master)
        for rank in range(2)
    ]


def node_of(actor: Any) -> str:
    return str(ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())))


def tokens_reach(engine: Any, count: int) -> int:
    deadline = time.monotonic() + 120
    while (now := ray.get(engine.generated.remote())) < count:
        assert time.monotonic() < deadline, f"{now} of {count} tokens within 120 s"
        time.sleep(0.01)
    return int(now)


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
        ray.get(
            [
                rank0.open.remote(engine, delta=True, staged=True, timeout=60),
                rank1.open.remote(engine, delta=True, timeout=60),
            ]
        )
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
            [rank0.stage.remote(STEPS - 1), rank1.update.remote(STEPS - 1, (engine, started + 3))]
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
        reads = {
            need.name: prod(need.box.shape if need.box is not None else need.shape)
            for instance in mine
            for need in instance.needs
        }
        assert full.worker_bytes[f"worker{w}"] == 4 * sum(reads.values()), w
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
