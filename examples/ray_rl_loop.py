"""An RL loop on Ray, on CPU: the trainer (this process, Ray's driver) and two vLLM engines
in actors on two other nodes. Each step the engines generate while the trainer trains and
streams the new version into them (staged: they keep generating on the old one), then it is
committed on both in one short pause. A three-node Ray cluster runs on this machine.

    python ray_rl_loop.py [--steps 3]

Needs ``pip install "streamsync[ray,vllm,zmq]"`` (vLLM's CPU build).
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from typing import Any

import ray
from ray.cluster_utils import Cluster

import streamsync as ss
from streamsync.cli.verify import PROMPTS, reference_outputs
from streamsync.testing.models import build_tiny_model, perturb
from streamsync.vllm import WeightSync
from streamsync.vllm.ray import node_address

#: The engine core in the actor's process, and a small KV cache: this is a laptop-sized demo.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


class Rollout:
    """A rollout worker: an ``AsyncLLM`` in a Ray actor, exposing what streamsync calls."""

    def __init__(self, model: str) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=model,
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            seed=0,
            worker_extension_cls="streamsync.vllm.WorkerExtension",
        )
        self.llm = AsyncLLM.from_engine_args(args)

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

    async def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[str]]:
        """Greedy tokens of ``prompt``, and the weight versions that made them."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        final = None
        async for part in self.llm.generate(
            {"prompt_token_ids": prompt}, params, str(uuid.uuid4())
        ):
            final = part
        assert final is not None
        output = final.outputs[0]
        return list(output.token_ids), [span.version for span in output.weight_versions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    steps = parser.parse_args().steps

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    for i in range(2):
        cluster.add_node(num_cpus=1, resources={f"engine{i}": 1})
    ray.init(address=cluster.address)
    try:
        with tempfile.TemporaryDirectory() as model:
            policy = build_tiny_model(model, "dense", seed=0)
            engines = [
                ray.remote(Rollout)
                .options(
                    num_cpus=0, resources={f"engine{i}": 1}, runtime_env={"env_vars": ENGINE_ENV}
                )
                .remote(model)
                for i in range(2)
            ]
            ray.get([engine.__ray_ready__.remote() for engine in engines])
            # The trainer binds on its node's address; each engine's worker connects to it.
            endpoint = f"zmq+tcp://{node_address()}:0"
            with WeightSync(engines, endpoint, staged=True) as sync:
                sync.update(ss.named_tensors(policy))  # the engines start on the policy
                for step in range(steps):
                    rollouts = [engine.generate.remote(PROMPTS[0], 200) for engine in engines]
                    perturb(policy, seed=step)  # (a training step)
                    report = sync.update(ss.named_tensors(policy))  # stage, then commit
                    versions = [spans for _, spans in ray.get(rollouts)]
                    print(f"step {step}: {report.summary()}")
                    print(f"  rollouts generated with versions {versions}")
            checks = ray.get([engine.generate.remote(p, 8) for engine in engines for p in PROMPTS])
            want = reference_outputs(policy).tokens * len(engines)
            print(f"engines match the policy: {[tokens for tokens, _ in checks] == want}")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
