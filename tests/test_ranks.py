"""Collective sharded syncs without vLLM: two trainer processes over gloo, their tensors
split in two along dim 0 (as FSDP2 splits them), into two thread workers hosted by rank 0.
Each rank sends the route it owns; every worker receives exactly its slices. The same from
FSDP2 into a real TP=2 engine is in ``test_vllm_ranks.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_harness import join_group

from streamsync.facts import EngineFacts

WORLD = 2


_MESH: list[Any] = []


def _shards(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's DTensors of ``full``: rows split in two (``Shard(0)``, as FSDP2 splits
    them), ``norm`` whole on both (``Replicate``); made locally, with no collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (WORLD,)))
    rank, out = dist.get_rank(), {}
    for name, t in full.items():
        chunk = -(-t.shape[0] // WORLD)
        local = t if name == "norm" else t[rank * chunk : (rank + 1) * chunk].clone()
        placement = Replicate() if name == "norm" else Shard(0)
        out[name] = DTensor.from_local(
            local, _MESH[0], [placement], run_check=False, shape=t.shape, stride=t.stride()
        )
    return out


class _DiesMidStream(dict[str, torch.Tensor]):
    """A rank's shards whose rank dies once the sync has taken the first of them."""

    def __init__(self, shards: dict[str, torch.Tensor], out: dict[str, Any], path: Path) -> None:
        super().__init__(shards)
        self.out, self.path = out, path

    def items(self) -> Any:
        for i, item in enumerate(super().items()):
            if i == 1:
                torch.save(self.out, self.path)
                os._exit(0)
            yield item


def _worker(rank: int, ports: Any, out_dir: str, fail: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    join_group(rank, WORLD, ports)
    try:
        import anyio
        from test_routes import SlicedEngine, weights

        import streamsync as ss
        from streamsync.engine.channel import EngineChannel
        from streamsync.vllm import RankPeer, Ranks

        class TellingEngine(SlicedEngine):
            async def hello(self) -> EngineFacts:
                return EngineFacts(vllm_version=(0, 24, 0))

        out: dict[str, Any] = {"reports": [], "errors": [], "partial": []}
        if rank == 0:
            engine = TellingEngine()
            for r, worker in enumerate(engine.workers):
                worker.rank = r
            if fail == "worker":
                engine.failing = {1}
            try:
                endpoint = f"shm://ranks-{os.getpid()}"
                with EngineChannel(
                    engine, endpoint, sharded=True, ranks=Ranks(), delta=True, timeout=20
                ) as sync:
                    for step in range(3):
                        try:
                            out["reports"].append(sync.update(_shards(weights(step))))
                            out["facts"] = sync.channel.facts
                        except ss.StreamsyncError as exc:
                            out["errors"].append(f"{type(exc).__name__}: {exc}")
                            out["partial"].append(exc.report is None or not exc.report.complete)
                out["stores"] = engine.stores
            finally:
                engine.shutdown()
        else:

            async def peer() -> None:
                async with RankPeer(
                    Ranks(), "zmq+tcp://127.0.0.1:0", delta=True, timeout=20
                ) as peer:
                    out["facts"] = peer.facts
                    for step in range(3):
                        if fail == "rank" and step == 1:
                            torch.save(out, Path(out_dir) / f"rank{rank}.pt")
                            os._exit(0)  # this rank dies between two syncs
                        shards = _shards(weights(step))
                        if fail == "midrank" and step == 1:
                            shards = _DiesMidStream(shards, out, Path(out_dir) / f"rank{rank}.pt")
                        try:
                            out["reports"].append(await peer.update(shards))
                        except ss.StreamsyncError as exc:
                            out["errors"].append(f"{type(exc).__name__}: {exc}")

            anyio.run(peer)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        if fail not in ("rank", "midrank"):
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run(tmp_path: Path, *, fail: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    ports = mp.get_context("spawn").Queue()
    mp.spawn(_worker, args=(ports, str(tmp_path), fail), nprocs=WORLD, join=True)
    load = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return load[0], load[1]


@pytest.mark.timeout(180)
def test_each_rank_sends_its_route_and_every_worker_gets_its_slices(tmp_path: Path) -> None:
    from test_routes import expected, weights

    rank0, rank1 = run(tmp_path)
    assert rank0["errors"] == [] and rank1["errors"] == []
    # Every rank's pipeline decides from the engine's facts, which rank 0 shares.
    assert rank1["facts"] == rank0["facts"] == (EngineFacts(vllm_version=(0, 24, 0)),)
    for rank in (0, 1):
        for name, tensor in expected(weights(2), rank).items():
            assert torch.equal(rank0["stores"][rank][name], tensor), (rank, name)
    full, *deltas = rank0["reports"]
    assert full.delta.base is None and all(r.delta.base is not None for r in deltas)
    for mine, theirs in zip(rank0["reports"], rank1["reports"], strict=True):
        # Rank 0 sent worker 0's route, rank 1 worker 1's; both know both.
        assert mine.rank_bytes == theirs.rank_bytes
        assert mine.rank_bytes[0] == mine.worker_bytes["worker0"]
        assert mine.rank_bytes[1] == mine.worker_bytes["worker1"]


@pytest.mark.timeout(180)
def test_a_worker_failing_on_one_ranks_route_fails_the_sync_on_every_rank(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run(tmp_path, fail="worker")
    assert len(rank0["errors"]) == len(rank1["errors"]) == 3
    assert all("loader broke" in e for e in rank0["errors"] + rank1["errors"])


@pytest.mark.timeout(180)
def test_a_rank_that_dies_fails_the_sync_on_the_others_by_name(tmp_path: Path) -> None:
    rank0, rank1 = run(tmp_path, fail="rank")
    assert len(rank0["reports"]) == len(rank1["reports"]) == 1  # the sync before it died
    # Each later sync fails on rank 0, promptly and by name, rather than hanging.
    assert len(rank0["errors"]) == 2
    assert all(e.startswith("PeerBrokenError") and "a rank is gone" in e for e in rank0["errors"])


@pytest.mark.timeout(180)
def test_a_rank_that_dies_mid_sync_fails_it_on_the_others_by_name(tmp_path: Path) -> None:
    rank0, rank1 = run(tmp_path, fail="midrank")
    assert len(rank0["reports"]) == len(rank1["reports"]) == 1  # the sync before it died
    # The sync it died in, and the next, fail on rank 0 by name, none reported complete.
    assert len(rank0["errors"]) == 2 and all(rank0["partial"])
    assert all(e.startswith("PeerBrokenError") and "a rank is gone" in e for e in rank0["errors"])
