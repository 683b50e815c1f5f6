"""Shared helpers for the real-vLLM tests: engines on tiny local models, and the reference
outputs of the trainer's Transformers model."""

from __future__ import annotations

import gc
import os
from typing import Any

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
from streamsync.worker import EventLoopThread

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


# The trainer's event loop lives for the whole session, as in a real training run: the
# channels update_weights opens are reused by every later sync.
TRAINER = EventLoopThread("trainer")


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
