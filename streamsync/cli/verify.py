"""Check a vLLM engine against the trainer: greedy tokens and prompt logprobs of both.

Used by the real-engine tests and by ``streamsync demo``. vLLM is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [42, 7, 300, 9, 511, 3]]
#: A prompt longer than two KV blocks of 32 tokens: asked every round with prefix caching
#: on, it is served from cached blocks unless the cache was reset after a sync. No token 0:
#: the reference generation takes 0 for padding.
LONG_PROMPT = [(7 * i + 3) % 499 + 1 for i in range(80)]
MAX_TOKENS = 8


@dataclass
class Outputs:
    """Greedy tokens per prompt, and the logprob of each prompt token after the first."""

    tokens: list[list[int]]
    prompt_logprobs: list[list[float]]

    def max_logprob_diff(self, other: Outputs) -> float:
        """The largest absolute prompt-logprob difference to ``other``."""
        return max(
            abs(a - b)
            for mine, theirs in zip(self.prompt_logprobs, other.prompt_logprobs, strict=True)
            for a, b in zip(mine, theirs, strict=True)
        )


def llm_options(path: str, *, dtype: str = "float32", **kwargs: Any) -> dict[str, Any]:
    """The keywords of a small CPU ``LLM`` on ``path`` with streamsync's worker extension;
    ``kwargs`` override them (another ``worker_extension_cls`` among them)."""
    return {
        "model": path,
        "max_model_len": 256,
        "enforce_eager": True,
        "max_num_seqs": 4,
        "seed": 0,
        "dtype": dtype,
        "worker_extension_cls": "streamsync.vllm.WorkerExtension",
        **kwargs,
    }


def make_llm(path: str, *, dtype: str = "float32", **kwargs: Any) -> Any:
    """A small CPU engine (:func:`llm_options`), in-process when
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``."""
    from vllm import LLM

    return LLM(**llm_options(path, dtype=dtype, **kwargs))


def sampling() -> Any:
    """Greedy sampling with prompt logprobs, ignoring EOS (fixed-length outputs)."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True
    )


def outputs_from(results: list[Any]) -> Outputs:
    """Outputs from vLLM ``RequestOutput`` objects."""
    tokens = [list(r.outputs[0].token_ids) for r in results]
    logprobs = [[next(iter(d.values())).logprob for d in r.prompt_logprobs[1:]] for r in results]
    return Outputs(tokens, logprobs)


def engine_outputs(
    llm: Any, prompts: list[list[int]] = PROMPTS, *, lora_request: Any = None
) -> Outputs:
    """Greedy generation of ``prompts`` (the fixed ones by default) on an ``LLM``, with a
    LoRA adapter if ``lora_request`` names one."""
    requests = [{"prompt_token_ids": p} for p in prompts]
    return outputs_from(
        llm.generate(requests, sampling(), use_tqdm=False, lora_request=lora_request)
    )


@torch.no_grad()
def reference_outputs(model: torch.nn.Module, prompts: list[list[int]] = PROMPTS) -> Outputs:
    """Greedy tokens and prompt logprobs of the trainer's own Transformers model."""
    tokens, logprobs = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(  # type: ignore[operator]
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        tokens.append(out[0, len(prompt) :].tolist())
        logits = model(ids).logits[0].float().log_softmax(-1)
        logprobs.append([logits[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)])
    return Outputs(tokens, logprobs)
