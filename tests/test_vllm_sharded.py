"""Sharded syncs into a real TP=2 CPU vLLM engine (``WeightSync(..., sharded=True)``): each
worker receives only the slices its loaders read, full and delta syncs alike, and the engine
then serves exactly what a plain full sync of the same weights gives it. Dense, tied, MoE
through the expander, and a draft model."""

from __future__ import annotations

import os
from math import prod
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import assert_matches, engine_outputs, make_llm, reference_outputs, shutdown

import streamsync as ss
from streamsync.boxes import slices_of
from streamsync.facts import Needs
from streamsync.testing.models import build_tiny_model
from streamsync.wire.slot import ALIGN

pytestmark = pytest.mark.vllm


def nudge(model: torch.nn.Module, *, seed: int) -> None:
    """A sparse training step: a few percent of each parameter's elements move."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            flat = param.view(-1)
            picked = torch.rand(flat.shape, generator=gen) < 0.03
            flat[picked] += torch.randn(int(picked.sum()), generator=gen) * 0.05


def start(kind: str, path: Path) -> tuple[Any, torch.nn.Module, Any]:
    """A TP=2 engine of ``kind``, the trainer's model and the pipeline it syncs through."""
    from streamsync.adapters import expand_moe

    main = path / "main"
    extra: dict[str, Any] = {}
    pipeline = None
    if kind == "moe":
        trainer = build_tiny_model(main, "moe", seed=0, init_std=0.12)
        pipeline = expand_moe(when="always", model_type="qwen3_moe")
    else:
        trainer = build_tiny_model(main, "dense", seed=0, tied=kind == "tied")
    if kind == "drafter":
        build_tiny_model(path / "draft", "dense", seed=1)  # a different drafter to start with
        extra["speculative_config"] = {
            "method": "draft_model",
            "model": str(path / "draft"),
            "num_speculative_tokens": 2,
        }
    llm = make_llm(str(main), tensor_parallel_size=2, distributed_executor_backend="mp", **extra)
    return llm, trainer, pipeline


def share(needs: dict[str, Needs], worker: str, sent: dict[str, torch.Tensor]) -> int:
    """The bytes ``worker`` must receive of ``sent`` (the stream after the pipeline): the box
    of each tensor its loaders read in part, the rest whole."""
    mine = [n for key, n in needs.items() if key.startswith(f"{worker}.")]
    slices = slices_of(mine)
    total = 0
    for name, tensor in sent.items():
        box = slices.get(name)
        total += (prod(box[0].shape) if box is not None else tensor.numel()) * tensor.itemsize
    return total


def stream(trainer: torch.nn.Module, pipeline: Any) -> dict[str, torch.Tensor]:
    """The tensors a sync of ``trainer`` carries (after ``pipeline``), copied."""
    from streamsync.engine.loops import EventLoopThread

    async def collect() -> dict[str, torch.Tensor]:
        source = ss.named_tensors(trainer)
        items = pipeline(source) if pipeline is not None else source
        return {name: t.detach().clone() async for name, t in items}

    loop = EventLoopThread("collect")
    try:
        return loop.run(collect, timeout=60)
    finally:
        loop.stop()


@pytest.mark.parametrize("kind", ["dense", "tied", "moe", "drafter"])
def test_sharded_syncs_serve_what_a_plain_sync_serves(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    llm, trainer, pipeline = start(kind, tmp_path)
    try:
        sent, seen, reports = [], [], []
        endpoint = "zmq+tcp://127.0.0.1:0"
        with WeightSync(llm, endpoint, sharded=True, delta=True, pipeline=pipeline) as sync:
            for step in range(3):
                nudge(trainer, seed=step)
                reports.append(sync.update(ss.named_tensors(trainer)))
                sent.append(stream(trainer, pipeline))
                seen.append(engine_outputs(llm))
            needs = dict(sync.needs)
        assert_matches(seen[-1], reference_outputs(trainer))
        # The same weights through a plain full sync: exactly the same outputs.
        with WeightSync(llm, f"shm://sharded-plain-{os.getpid()}") as plain:
            for tensors, got in zip(sent, seen, strict=True):
                plain.update(tensors)
                want = engine_outputs(llm)
                assert got.tokens == want.tokens and got.max_logprob_diff(want) == 0
    finally:
        shutdown(llm)
    full, *deltas = reports
    assert full.delta is not None and full.delta.base is None
    for w in (0, 1):
        # A full sync: each worker its share (its boxes, the replicated tensors), each entry
        # aligned to 64 bytes, and no more.
        due = share(needs, f"worker{w}", sent[0])
        assert due <= full.worker_bytes[f"worker{w}"] <= due + ALIGN * len(sent[0])
        assert due < 0.75 * sum(t.nbytes for t in sent[0].values())
    for report in deltas:
        assert report.delta is not None and report.delta.base is not None, report.delta
        assert all(report.worker_bytes[w] < full.worker_bytes[w] for w in full.worker_bytes)
    assert full.rank_bytes == {0: full.wire_bytes} == {0: sum(full.worker_bytes.values())}
