"""Shared helpers for the real-vLLM tests: engines on tiny local models, and the reference
outputs of the trainer's Transformers model."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch

import streamsync as ss
from streamsync.vllm._loop import LoopThread

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines start fast
TOL = 1e-5


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [42, 7, 300, 9, 511, 3]]
MAX_TOKENS = 8


@dataclass
class Outputs:
    tokens: list[list[int]]
    prompt_logprobs: list[list[float]]  # logprob of each prompt token after the first

    def max_logprob_diff(self, other: Outputs) -> float:
        return max(
            abs(a - b)
            for mine, theirs in zip(self.prompt_logprobs, other.prompt_logprobs, strict=True)
            for a, b in zip(mine, theirs, strict=True)
        )


def make_llm(path: str, *, dtype: str = "float32", **kwargs: Any) -> Any:
    """An in-process engine (unless the caller set multiprocessing) with our extension."""
    from vllm import LLM

    return LLM(
        model=path,
        dtype=dtype,
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        worker_extension_cls="streamsync.vllm.WorkerExtension",
        **kwargs,
    )


def sampling() -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True
    )


def outputs_from(results: list[Any]) -> Outputs:
    tokens = [list(r.outputs[0].token_ids) for r in results]
    logprobs = [[next(iter(d.values())).logprob for d in r.prompt_logprobs[1:]] for r in results]
    return Outputs(tokens, logprobs)


def engine_outputs(llm: Any) -> Outputs:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return outputs_from(llm.generate(prompts, sampling(), use_tqdm=False))


@torch.no_grad()
def reference_outputs(model: torch.nn.Module) -> Outputs:
    """Greedy tokens and prompt logprobs of the trainer's own Transformers model."""
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(  # type: ignore[operator]
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        tokens.append(out[0, len(prompt) :].tolist())
        logits = model(ids).logits[0].float().log_softmax(-1)
        logprobs.append([logits[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)])
    return Outputs(tokens, logprobs)


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
TRAINER = LoopThread("trainer")


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
    assert got.max_logprob_diff(want) <= TOL
