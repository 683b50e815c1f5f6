"""What the Ray tests share: a Ray runtime on this machine (one node, or a cluster of several
on it), and an actor that holds an ``AsyncLLM`` as RL frameworks host one (OpenRLHF's
rollout actor, NeMo-RL's generation worker): it builds the engine in the actor and exposes
the engine's methods. This module is imported by Ray's worker processes too (the tests put
its folder on their ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
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

    async def add_lora(self, request: Any) -> bool:
        return bool(await self.llm.add_lora(request))

    async def remove_lora(self, lora_id: int) -> bool:
        return bool(await self.llm.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return set(await self.llm.list_loras())

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

    async def outputs(self, lora_request: Any = None) -> Any:
        """Greedy tokens and prompt logprobs of the fixed prompts
        (:class:`streamsync.cli.verify.Outputs`), with a LoRA adapter if asked."""
        from streamsync.cli.verify import PROMPTS, outputs_from, sampling

        finals = []
        for prompt in PROMPTS:
            async for part in self.llm.generate(
                {"prompt_token_ids": prompt},
                sampling(),
                str(uuid.uuid4()),
                lora_request=lora_request,
            ):
                final = part
            finals.append(final)
        return outputs_from(finals)


class TrainerRank:
    """One rank of an FSDP2 trainer in a Ray actor (``ray.remote(TrainerRank)``), in a gloo
    group with the other ranks' actors, as verl and OpenRLHF run their trainer ranks. Rank 0
    drives the engine actors; every rank sends its own shards. :meth:`open` holds the lines
    a rank actor writes (``docs/ray.md``)."""

    def __init__(self, path: str, rank: int, world: int) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        from streamsync.vllm.ray import node_address

        self.path, self.rank, self.world = path, rank, world
        self.store: Any = None
        if rank == 0:  # the group's store, on a free port it binds itself (no race for one)
            self.store = TCPStore(
                node_address(),
                0,
                world,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=120),
            )
        self.stack = contextlib.AsyncExitStack()
        self.sync: Any = None

    def master(self) -> tuple[str, int]:
        """Rank 0: where the group's store listens."""
        return self.store.host, self.store.port

    def join(self, master: tuple[str, int]) -> None:
        """Join the gloo group (every rank at once) and shard the model over it."""
        from datetime import timedelta

        import torch.distributed as dist
        from rank_harness import fsdp2_model
        from torch.distributed import TCPStore

        if self.store is None:
            self.store = TCPStore(
                *master, self.world, is_master=False, timeout=timedelta(seconds=120)
            )
        dist.init_process_group("gloo", store=self.store, rank=self.rank, world_size=self.world)
        self.model, self.full = fsdp2_model(self.path)

    async def open(self, engines: Any, **options: Any) -> None:
        from streamsync.vllm import RankPeer, Ranks, WeightSync
        from streamsync.vllm.ray import node_address

        self.ranks = Ranks(timeout=options.get("timeout", 60))
        endpoint = f"zmq+tcp://{node_address()}:0"  # this rank's node, where engines reach it
        if self.rank == 0:
            sync = WeightSync(engines, endpoint, sharded=True, ranks=self.ranks, **options)
        else:
            sync = RankPeer(self.ranks, endpoint, **options)
        self.sync = await self.stack.enter_async_context(sync)

    async def close(self) -> dict[str, int]:
        """Close the sync; what this rank assembled of each tensor, at most, at once."""
        await self.stack.aclose()
        return dict(self.ranks.assembled)

    def _step(self, step: int, half_way: Callable[[], object] | None) -> Any:
        from rank_harness import new_weights, set_shards

        set_shards(self.model, new_weights(self.full, step))
        return self.model if half_way is None else _Held(self.model, half_way)

    async def update(self, step: int, half_way: Callable[[], object] | None = None) -> Any:
        """This rank's part of the sync of step ``step``'s weights; ``half_way`` runs half-way
        through this rank's tensors (it blocks this rank meanwhile)."""
        return await self.sync.update(self._step(step, half_way))

    async def stage(self, step: int, half_way: Callable[[], object] | None = None) -> Any:
        """Rank 0: stage step ``step``'s weights (the other ranks :meth:`update`)."""
        return await self.sync.stage(self._step(step, half_way))

    async def commit(self) -> Any:
        return await self.sync.commit()

    async def needs(self) -> dict[str, Any]:
        """Rank 0: what each model instance of the engines reads."""
        return dict(self.sync.needs)

    async def versions(self) -> list[str]:
        return [str(v) for v in self.sync.versions.values()]

    async def plain(self, engines: Any, step: int) -> Any:
        """Rank 0: a plain full sync of step ``step``'s whole weights (no ranks, not sharded)."""
        from rank_harness import new_weights

        from streamsync.vllm import WeightSync
        from streamsync.vllm.ray import node_address

        async with WeightSync(engines, f"zmq+tcp://{node_address()}:0") as plain:
            return await plain.update(new_weights(self.full, step))

    def leave(self) -> None:
        """Tear down the gloo group (the actor is then killed)."""
        import torch.distributed as dist

        dist.destroy_process_group()


class _Held(dict[str, Any]):
    """A rank's weights whose iteration runs ``half_way`` half-way through."""

    def __init__(self, model: Any, half_way: Callable[[], object]) -> None:
        super().__init__(model.state_dict(keep_vars=True))
        self.half_way = half_way

    def items(self) -> Any:  # type: ignore[override]
        items = list(super().items())
        for i, item in enumerate(items):
            if i == len(items) // 2:
                self.half_way()
            yield item


def pausing_ray_client(handles: Any) -> Any:
    """vLLM's ``RayVLLMWeightSyncClient`` with the few lines of ``docs/ray.md`` that let a
    staged sync pause the engine for its commit."""
    import ray
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    class PausingRayClient(RayVLLMWeightSyncClient):  # type: ignore[misc]
        def pause(self, mode: str = "keep") -> None:
            ray.get([h.pause_generation.remote(mode=mode, clear_cache=False) for h in self.handles])

        def reset_prefix_cache(self) -> None:
            ray.get([h.reset_prefix_cache.remote(True) for h in self.handles])

        def resume(self) -> None:
            ray.get([h.resume_generation.remote() for h in self.handles])

    return PausingRayClient(handles)


def tokens_reach(engine: Any, count: int, within: float = 120) -> int:
    """Wait until the engine actor's running request has produced ``count`` tokens."""
    import ray

    deadline = time.monotonic() + within
    while (now := ray.get(engine.generated.remote())) < count:
        assert time.monotonic() < deadline, f"{now} of {count} tokens within {within:g} s"
        time.sleep(0.01)
    return int(now)


def die() -> None:
    """Kill this process at once (SIGKILL: no cleanup, as the OOM killer does)."""
    os.kill(os.getpid(), signal.SIGKILL)


def worker_pids(_: Any = None) -> list[int]:
    """Inside an engine actor (``__ray_call__``): the process ids of its engine's
    tensor-parallel workers (vLLM names them ``Worker_TP<rank>``), by rank."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        title = " ".join(child.cmdline())
        if "Worker_TP" in title:
            found[title.split("Worker_TP")[1][:1]] = child.pid
    return [found[rank] for rank in sorted(found)]
