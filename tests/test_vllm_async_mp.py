"""Real syncs into vLLM's default multi-process engine, driven through ``AsyncLLM``.

The worker runs in its own process, so the weights cross a real process boundary over
``shm://`` (and ``zmq+ipc://``), and ``collective_rpc`` carries only the endpoint.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    TRAINER,
    Outputs,
    assert_matches,
    async_outputs,
    reference_outputs,
)

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_async_llm_multiprocess_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.vllm import update_weights

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0)
    args = AsyncEngineArgs(
        model=str(tmp_path / "model"),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        worker_extension_cls="streamsync.vllm.WorkerExtension",
    )

    async def start() -> Any:
        return AsyncLLM.from_engine_args(args)

    llm = TRAINER.run(start, timeout=300)
    try:
        endpoints = [f"shm://mp-{os.getpid()}", f"zmq+ipc://{tmp_path}/mp.sock"]
        for step in range(3):
            perturb(trainer, seed=700 + step)
            want = reference_outputs(trainer)
            endpoint = endpoints[step % 2]

            async def step_sync(endpoint: str = endpoint) -> tuple[ss.SyncReport, Outputs]:
                report = await update_weights(
                    llm, ss.named_tensors(trainer), endpoint=endpoint, bucket_bytes=256 << 10
                )
                return report, await async_outputs(llm)

            report, got = TRAINER.run(step_sync, timeout=300)
            assert report.complete and report.receivers == 1
            worker = report.instances["worker0.main"]
            assert worker.missing == () and worker.loaded
            assert_matches(got, want)
    finally:
        llm.shutdown()
        llm = None  # let its finalizer run now, not at interpreter exit
        gc.collect()
