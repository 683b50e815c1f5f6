"""Shared helpers for the real-vLLM tests: engines on tiny local models, and the reference
outputs of the trainer's Transformers model."""

from __future__ import annotations

import concurrent.futures
import gc
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio.from_thread
import torch

import streamsync as ss
from streamsync.testing.engine import (
    MAX_TOKENS,
    PROMPTS,
    Outputs,
    engine_outputs,
    make_llm,
    outputs_from,
    reference_outputs,
    sampling,
)

__all__ = [
    "MAX_TOKENS",
    "PROMPTS",
    "TOL",
    "TRAINER",
    "Outputs",
    "assert_matches",
    "engine_outputs",
    "make_llm",
    "outputs_from",
    "reference_outputs",
    "sampling",
    "shutdown",
    "sync",
]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines start fast
TOL = 1e-5


def shutdown(llm: Any) -> None:
    """Free an engine before the next one starts (2 cores, shared memory budget)."""
    import contextlib

    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    # In-process engines leave their parallel groups behind; the next engine (of another
    # kind) in this process needs them gone.
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


T = TypeVar("T")


class TrainerLoop:
    """The trainer's event loop, alive for the whole session as in a real training run (the
    channels ``update_weights`` opens are reused by every later sync), in a daemon thread
    behind an anyio blocking portal."""

    def __init__(self) -> None:
        # Keep the context manager: collecting it would stop the portal.
        self._portal_cm = anyio.from_thread.start_blocking_portal(name="trainer")
        self._portal = self._portal_cm.__enter__()

    def run(self, fn: Callable[[], Awaitable[T]], *, timeout: float) -> T:
        """Run ``fn()`` on the loop; at most ``timeout`` seconds."""
        future = self._portal.start_task_soon(fn)
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:
            future.cancel()
            raise TimeoutError(f"the trainer's step did not finish within {timeout:g} s")
        return future.result()


TRAINER = TrainerLoop()


def sync(llm: Any, trainer: torch.nn.Module, endpoint: str, **kwargs: Any) -> ss.SyncReport:
    """One ``update_weights`` from the trainer's loop, 256 KiB buckets."""
    from streamsync.vllm import update_weights

    async def main() -> ss.SyncReport:
        return await update_weights(
            llm, ss.named_tensors(trainer), endpoint=endpoint, bucket_bytes=256 << 10, **kwargs
        )

    return TRAINER.run(main, timeout=300)


def assert_matches(got: Outputs, want: Outputs) -> None:
    """Greedy tokens equal, prompt logprobs within TOL."""
    assert got.tokens == want.tokens
    diff = got.max_logprob_diff(want)
    assert diff <= TOL, f"max |logprob difference| {diff:.3g} > {TOL}"
