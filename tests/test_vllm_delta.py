"""Delta syncs into the CPU build of vLLM, in bf16: after a series of deltas the engine gives
exactly the logprobs that one full sync of the same weights gives (and, within the usual
tolerance, the trainer's), for a dense model, a tied one, an MoE through the expander and a
drafter. A delta patches the worker's checkpoint-coordinate copies, which then load through
the ordinary lifecycle, so fused, repacked and tied layers are rebuilt as in a full sync.

The trainer keeps fp32 master weights and sends bf16; each step changes a small fraction
of elements, as an RL step at a small learning rate does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import TRAINER, engine_outputs, make_llm, reference_outputs, shutdown

import streamsync as ss
from streamsync.testing.models import build_tiny_model

pytestmark = pytest.mark.vllm

STEPS = 4
#: |logprob| difference of a bf16 engine from the fp32 trainer (measured: 0.05-0.08); a
#: stale or missing layer moves them by more than 1.
BF16_TOL = 0.25


def sparse_step(
    model: torch.nn.Module, *, seed: int, fraction: float = 0.03, only: str | None = None
) -> None:
    """A stand-in for a small-learning-rate step: change ``fraction`` of the elements (of
    the parameters whose name contains ``only``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if only is not None and only not in name:
                continue
            chosen = torch.rand(param.shape, generator=gen) < fraction
            noise = torch.randn(param.shape, generator=gen) * 0.02
            param.add_(torch.where(chosen, noise, torch.zeros_like(noise)).to(param.dtype))


def deltas_then_full(
    llm: Any, trainer: torch.nn.Module, endpoint: str, pipeline: Any, *, reference: bool = True
) -> None:
    """``STEPS`` delta syncs, then one full sync of the same weights: the engine's outputs
    after both are identical; with ``reference``, close to the trainer's, and each delta
    patched and moved under a quarter of the full sync's bytes (block-FP8 requantizes whole
    blocks, so there only the identity is asserted)."""
    from streamsync.vllm import WeightSync

    async def main() -> tuple[list[ss.SyncReport], Any, Any]:
        reports = []
        async with WeightSync(
            llm, endpoint, pipeline=pipeline, bucket_bytes=256 << 10, delta=True
        ) as sync:
            for step in range(STEPS):
                # One step changes only q_proj: its fused qkv layer gets one shard as a patch
                # and the other two from the worker's copies.
                sparse_step(trainer, seed=step, only="q_proj" if step == 2 else None)
                reports.append(await sync.update(ss.named_tensors(trainer)))
            after_deltas = engine_outputs(llm)
            full = await sync.update(ss.named_tensors(trainer), delta=False)
            reports.append(full)
            return reports, after_deltas, engine_outputs(llm)

    reports, after_deltas, after_full = TRAINER.run(main, timeout=600)
    first, *deltas, full = reports
    assert first.delta is not None and first.delta.base is None
    for report in deltas:
        assert report.delta is not None and report.delta.full_reason is None, report.delta
        if reference:
            assert report.delta.sparse > 0
            assert report.wire_bytes < first.wire_bytes / 4, (report.wire_bytes, first.wire_bytes)
    if reference:
        assert deltas[1].delta is not None
        assert deltas[1].delta.unchanged > deltas[1].delta.sparse
    assert full.delta is not None and full.delta.full_reason == "a full sync was asked for"
    assert after_deltas.tokens == after_full.tokens
    assert after_deltas.max_logprob_diff(after_full) == 0.0
    # And that full sync serves the trainer's weights: bf16 compute in the engine against
    # the fp32 reference moves logprobs by a few hundredths (greedy near-ties may flip).
    if reference:
        assert after_full.max_logprob_diff(reference_outputs(trainer)) < BF16_TOL


@pytest.mark.parametrize("shape", ["dense", "tied", "moe"])
def test_deltas_give_exactly_what_a_full_sync_gives(shape: str, tmp_path: Path) -> None:
    from streamsync.adapters import cast, expand_moe

    # The MoE with smaller weights, as in test_vllm_moe.py (the CPU kernel sums experts in
    # another order than Transformers).
    extra: dict[str, Any] = {"init_std": 0.12} if shape == "moe" else {}
    trainer = build_tiny_model(
        tmp_path, "moe" if shape == "moe" else "dense", seed=0, tied=shape == "tied", **extra
    )
    pipeline = cast(torch.bfloat16)
    if shape == "moe":
        pipeline = expand_moe(when="always", model_type="qwen3_moe") | pipeline
    llm = make_llm(str(tmp_path), dtype="bfloat16")
    try:
        deltas_then_full(llm, trainer, f"shm://delta-{shape}-{os.getpid()}", pipeline)
    finally:
        shutdown(llm)


def test_deltas_reach_the_drafter(tmp_path: Path) -> None:
    main_path, draft_path = tmp_path / "main", tmp_path / "draft"
    trainer = build_tiny_model(main_path, "dense", seed=0)
    build_tiny_model(draft_path, "dense", seed=1)
    llm = make_llm(
        str(main_path),
        dtype="bfloat16",
        speculative_config={
            "method": "draft_model",
            "model": str(draft_path),
            "num_speculative_tokens": 3,
        },
    )
    try:
        from streamsync.adapters import cast

        deltas_then_full(llm, trainer, f"shm://delta-draft-{os.getpid()}", cast(torch.bfloat16))
    finally:
        shutdown(llm)


def test_deltas_into_a_tensor_parallel_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 (``mp`` executor, a core per worker): each worker keeps its own copies of the
    whole checkpoint tensors, patches them and loads its shard from them."""
    from streamsync.adapters import cast

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    trainer = build_tiny_model(tmp_path, "dense", seed=0)
    llm = make_llm(
        str(tmp_path), dtype="bfloat16", tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    try:
        url = "zmq+tcp://127.0.0.1:0"  # bound when the channel opens: no port to race for
        deltas_then_full(llm, trainer, url, cast(torch.bfloat16))
    finally:
        shutdown(llm)


def test_update_weights_with_delta_sends_deltas_and_a_changed_option_opens_a_new_channel(
    tmp_path: Path,
) -> None:
    """``streamsync.vllm.update_weights(..., delta=True)`` keeps its channel across calls and
    tells the workers to keep the copies a delta patches: the second call is a delta. A
    call with another channel option opens a new channel."""
    from streamsync.adapters import cast
    from streamsync.engine.kept import KEPT
    from streamsync.vllm import update_weights

    trainer = build_tiny_model(tmp_path, "dense", seed=0)
    llm = make_llm(str(tmp_path), dtype="bfloat16")
    endpoint = f"shm://delta-update-{os.getpid()}"

    def step(**options: Any) -> ss.SyncReport:
        async def main() -> ss.SyncReport:
            return await update_weights(
                llm,
                ss.named_tensors(trainer),
                endpoint=endpoint,
                pipeline=cast(torch.bfloat16),
                bucket_bytes=256 << 10,
                delta=True,
                **options,
            )

        report: ss.SyncReport = TRAINER.run(main, timeout=600)
        return report

    try:
        first = step()
        kept = KEPT
        channel = kept.get(endpoint)
        assert channel is not None
        sparse_step(trainer, seed=0)
        second = step()
        assert kept.get(endpoint) is channel
        sparse_step(trainer, seed=1)
        third = step(checksum=True)
        assert kept.get(endpoint) is not channel
    finally:
        shutdown(llm)
    assert first.complete and first.delta is not None and first.delta.base is None
    assert second.complete and second.delta is not None
    assert second.delta.full_reason is None and second.delta.base == first.sync_id, second.delta
    assert second.delta.sparse > 0 and second.wire_bytes < first.wire_bytes / 4
    # A new channel: its workers hold the version, but the sender has no baseline yet.
    assert third.complete and third.delta is not None and third.delta.base is None
