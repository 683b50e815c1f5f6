"""A collective sharded sync from a 2-rank FSDP2 trainer over gloo into a real TP=2 CPU vLLM
engine: rank 0 drives the engine (``WeightSync(..., sharded=True, ranks=Ranks())``), rank 1
takes part (``RankPeer``); each rank sends the routes it owns, and the engine then serves
exactly what a plain full sync of the same weights gives it. Dense, tied, MoE through the
expander (each expert's slice taken from the rank holding it), and a drafter."""

from __future__ import annotations

import os
from math import prod
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_harness import fsdp2_model, join_group, new_weights, set_shards

pytestmark = pytest.mark.vllm

WORLD = 2
STEPS = 3


def _pipeline(kind: str) -> Any:
    from streamsync.adapters import expand_moe

    return expand_moe(when="always", model_type="qwen3_moe") if kind == "moe" else None


async def _rank1(
    model: torch.nn.Module, full: dict[str, torch.Tensor], kind: str
) -> dict[str, Any]:
    from streamsync.vllm import RankPeer, Ranks

    out: dict[str, Any] = {"rank_bytes": []}
    ranks = Ranks()
    async with RankPeer(
        ranks, "zmq+tcp://127.0.0.1:0", delta=True, timeout=60, pipeline=_pipeline(kind)
    ) as peer:
        for step in range(STEPS):
            set_shards(model, new_weights(full, step))
            report = await peer.update(model)
            out["rank_bytes"].append(report.rank_bytes)
    out["assembled"] = ranks.assembled
    return out


def _rank0(
    model: torch.nn.Module, full: dict[str, torch.Tensor], path: str, kind: str
) -> dict[str, Any]:
    from vllm_harness import engine_outputs, make_llm

    from streamsync.vllm import Ranks, WeightSync

    out: dict[str, Any] = {"reports": [], "seen": [], "want": []}
    extra: dict[str, Any] = {}
    if kind == "drafter":
        extra["speculative_config"] = {
            "method": "draft_model",
            "model": str(Path(path).parent / "draft"),
            "num_speculative_tokens": 2,
        }
    llm = make_llm(path, tensor_parallel_size=2, distributed_executor_backend="mp", **extra)
    try:
        endpoint, ranks = "zmq+tcp://127.0.0.1:0", Ranks()
        pipeline = _pipeline(kind)
        with WeightSync(
            llm,
            endpoint,
            sharded=True,
            ranks=ranks,
            delta=True,
            timeout=60,
            pipeline=pipeline,
            staged=kind == "staged",  # each update stages on every worker, then commits
        ) as sync:
            for step in range(STEPS):
                set_shards(model, new_weights(full, step))
                out["reports"].append(sync.update(model))
                out["seen"].append(engine_outputs(llm))
            out["needs"] = dict(sync.needs)
        out["assembled"] = ranks.assembled
        with WeightSync(llm, f"shm://ranks-plain-{os.getpid()}", pipeline=pipeline) as plain:
            for step in range(STEPS):
                plain.update(new_weights(full, step))
                out["want"].append(engine_outputs(llm))
    finally:
        # Not the harness's shutdown: it destroys the default process group, the trainer's.
        llm.llm_engine.engine_core.shutdown()
    return out


def _worker(rank: int, ports: Any, path: str, out_dir: str, done: Any, kind: str) -> None:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    join_group(rank, WORLD, ports)
    try:
        import anyio

        model, full = fsdp2_model(path)
        out = _rank0(model, full, path, kind) if rank == 0 else anyio.run(_rank1, model, full, kind)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        done.wait(120)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)  # as test_fsdp_source: no gloo teardown in interpreter finalisation


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["dense", "tied", "moe", "drafter", "staged"])
def test_two_fsdp2_ranks_sync_a_tp2_engine(kind: str, tmp_path: Path) -> None:
    from streamsync.boxes import slices_of
    from streamsync.testing.models import build_tiny_model

    path = tmp_path / "model"
    if kind == "moe":
        build_tiny_model(path, "moe", seed=0, init_std=0.12)
    else:
        build_tiny_model(path, "dense", seed=0, tied=kind == "tied")
    if kind == "drafter":
        build_tiny_model(tmp_path / "draft", "dense", seed=1)  # another drafter to start with
    spawn = mp.get_context("spawn")
    done = spawn.Barrier(WORLD)
    args = (spawn.Queue(), str(path), str(tmp_path), done, kind)
    mp.spawn(_worker, args=args, nprocs=WORLD, join=True)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    for got, want in zip(rank0["seen"], rank0["want"], strict=True):
        assert got.tokens == want.tokens and got.max_logprob_diff(want) == 0
    assert rank0["seen"][0].tokens != rank0["seen"][-1].tokens or (
        rank0["seen"][0].max_logprob_diff(rank0["seen"][-1]) > 0
    )
    full, *deltas = rank0["reports"]
    assert full.delta is not None and full.delta.base is None
    assert all(r.delta is not None and r.delta.base is not None for r in deltas)
    # Each rank sent one route (one worker's slices); both ranks see every rank's bytes.
    for report, told in zip(rank0["reports"], rank1["rank_bytes"], strict=True):
        assert report.rank_bytes == told and set(told) == {0, 1}
        assert told[0] == report.worker_bytes["worker0"]
        assert told[1] == report.worker_bytes["worker1"]
    assert all(sum(r.worker_bytes.values()) < sum(full.worker_bytes.values()) for r in deltas)
    # No rank held a whole tensor that a worker reads in part: each assembled that worker's
    # box (half of it), beside its own shard.
    needs = rank0["needs"]
    for w, rank in ((0, rank0), (1, rank1)):
        slices = slices_of([n for k, n in needs.items() if k.startswith(f"worker{w}.")])
        assert slices, "each worker reads part of the TP-split tensors"
        for name, (box, shape) in slices.items():
            assert rank["assembled"][name] == prod(box.shape) < prod(shape), name
    if kind == "staged":  # every sync was staged on both workers, then committed
        assert all("apply" in r.phases for r in rank0["reports"]), rank0["reports"][0].phases
    if kind == "moe":  # the experts went per expert, each cut from its holder's shard
        assert any(".experts.0.gate_proj.weight" in name for name in rank0["assembled"])
