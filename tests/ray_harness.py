"""What the Ray tests share: a Ray runtime on this machine (one node, or a cluster of several
on it), and an actor that holds an ``AsyncLLM`` as RL frameworks host one (OpenRLHF's
rollout actor, NeMo-RL's generation worker): it builds the engine in the actor and exposes
the engine's methods. This module is imported by Ray's worker processes too (the tests put
its folder on their ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

#: What every engine actor runs with: its engine core in the actor's process, a small KV
#: cache (two cores, 24 GiB shared by everything here).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "enforce_eager": True,
    "max_num_seqs": 4,
    "seed": 0,
    "worker_extension_cls": "streamsync.vllm.WorkerExtension",
}


def worker_path() -> None:
    """Let Ray's workers import this module (they start with this process's environment)."""
    here = str(Path(__file__).parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])


class AsyncEngine:
    """An ``AsyncLLM`` in a Ray actor (``ray.remote(AsyncEngine)``), exposing what
    streamsync calls (``collective_rpc``, ``pause_generation``, ``resume_generation``,
    ``reset_prefix_cache``, ``update_weight_version``) and a greedy ``generate``."""

    def __init__(self, model: str, *, weight_transfer: str | None = None, **engine: Any) -> None:
        from vllm import AsyncEngineArgs
        from vllm.config import WeightTransferConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        if weight_transfer is not None:  # vLLM's weight-transfer API, on this backend
            engine["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **engine))
        self.tokens = 0  # generated so far by the request running now

    # vLLM's weight-transfer calls, as vLLM's RayVLLMWeightSyncClient makes them.
    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self.llm.init_weight_transfer_engine(request)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.llm.shutdown_weight_transfer_engine()

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, request: Any) -> None:
        await self.llm.update_weights(request=request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.llm.finish_weight_update(weight_version)

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return list(await self.llm.collective_rpc(method, args=args))

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await self.llm.resume_generation()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self.llm.reset_prefix_cache(reset_running_requests))

    async def update_weight_version(self, version: str) -> None:
        await self.llm.update_weight_version(version)

    async def generate(
        self, prompts: list[list[int]], max_tokens: int = 8
    ) -> list[tuple[list[int], list[tuple[str, int, int]]]]:
        """Greedy tokens of each prompt, with the weight versions that produced them."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = []
        for prompt in prompts:
            final = None
            self.tokens = 0
            async for part in self.llm.generate(
                {"prompt_token_ids": prompt}, params, str(uuid.uuid4())
            ):
                final = part
                self.tokens = len(part.outputs[0].token_ids)
            assert final is not None
            spans = [(s.version, s.start, s.end) for s in final.outputs[0].weight_versions]
            out.append((list(final.outputs[0].token_ids), spans))
        return out

    async def generated(self) -> int:
        """Tokens of the running request so far."""
        return self.tokens
