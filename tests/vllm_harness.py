"""Shared helpers for the real-vLLM tests: engines on tiny local models, and the reference
outputs of the trainer's Transformers model."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

import torch

import streamsync as ss
from streamsync.cli.verify import (
    LONG_PROMPT,
    MAX_TOKENS,
    PROMPTS,
    Outputs,
    engine_outputs,
    outputs_from,
    reference_outputs,
    sampling,
)
from streamsync.cli.verify import make_llm as _make_llm
from streamsync.engine.loops import EventLoopThread
from streamsync.testing.peers import held_elsewhere

__all__ = [
    "LONG_PROMPT",
    "MAX_TOKENS",
    "PROMPTS",
    "TOL",
    "TRAINER",
    "Outputs",
    "assert_matches",
    "async_engine_args",
    "async_outputs",
    "cached_greedy",
    "engine_outputs",
    "make_llm",
    "outputs_from",
    "reference_outputs",
    "remove_vllm_segments",
    "sampling",
    "shutdown",
    "sync",
    "vllm_segments",
]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines start fast
#: How far vLLM's prompt logprobs may be from Transformers' own, both fp32: rounding apart.
#: The two disagree by up to 1.14e-5 on an AVX2 machine (a few float32 ulps of logprobs
#: near -16), while one tensor left stale by a sync moves them by 0.045 or more
#: (`perturb`'s step, the tiny tied model, each of its 25 tensors in turn).
TOL = 1e-4


def vllm_segments() -> frozenset[str]:
    """vLLM's CPU tensor-parallel shared-memory segments in /dev/shm now."""
    return frozenset(n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_"))


def remove_vllm_segments(before: frozenset[str]) -> None:
    """Remove the segments vLLM's CPU tensor-parallel workers left behind (4 MiB each: its
    communicator does not unlink them when its engine or server stops): those that appeared
    since ``before`` and that no live process holds."""
    new = {f"/dev/shm/{n}" for n in vllm_segments() - before}
    for path in new - held_elsewhere(new):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


_SEGMENTS_BEFORE: dict[int, frozenset[str]] = {}


def make_llm(*args: Any, **kwargs: Any) -> Any:
    """:func:`streamsync.cli.verify.make_llm`; :func:`shutdown` cleans up after it."""
    before = vllm_segments()
    llm = _make_llm(*args, **kwargs)
    _SEGMENTS_BEFORE[id(llm)] = before
    return llm


def shutdown(llm: Any) -> None:
    """Free an engine before the next one starts (2 cores, shared memory budget)."""
    before = _SEGMENTS_BEFORE.pop(id(llm), None)
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
    if before is not None:
        remove_vllm_segments(before)


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


def async_engine_args(path: Any, **kwargs: Any) -> Any:
    """``AsyncEngineArgs`` of a small CPU engine on ``path`` with streamsync's worker
    extension; ``kwargs`` override them."""
    from vllm import AsyncEngineArgs

    options: dict[str, Any] = {
        "model": str(path),
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "max_num_seqs": 4,
        "seed": 0,
        "worker_extension_cls": "streamsync.vllm.WorkerExtension",
    }
    return AsyncEngineArgs(**{**options, **kwargs})


async def async_outputs(llm: Any, prompts: list[list[int]] = PROMPTS) -> Outputs:
    """What :func:`engine_outputs` gives, from an ``AsyncLLM`` (on its event loop)."""
    import uuid

    results = []
    for prompt in prompts:
        final = None
        async for out in llm.generate({"prompt_token_ids": prompt}, sampling(), str(uuid.uuid4())):
            final = out
        results.append(final)
    return outputs_from(results)


def cached_greedy(
    llm: Any, prompts: list[list[int]], *, lora_request: Any = None
) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``prompts`` through the prefix cache (no ``prompt_logprobs``, which
    would bypass it), and how many prompt tokens came from cached blocks."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs], sum(o.num_cached_tokens or 0 for o in outs)


def assert_matches(got: Outputs, want: Outputs) -> None:
    """Greedy tokens equal, prompt logprobs within TOL."""
    assert got.tokens == want.tokens
    diff = got.max_logprob_diff(want)
    assert diff <= TOL, f"max |logprob difference| {diff:.3g} > {TOL}"
