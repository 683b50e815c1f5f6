"""vLLM engines hosted in Ray actors, on a real Ray runtime on this machine.

An actor made with ``ray.remote(LLM)`` holds a tiny dense Qwen3; the trainer (this process,
Ray's driver) syncs into it through its handle with ``WeightSync(handle, endpoint)``, bound
on the node's address as Ray reports it. After every sync the actor's greedy tokens equal
the trainer's and its prompt logprobs match within 1e-5 (fp32).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import extra
from ray_harness import ENGINE, ENGINE_ENV, AsyncEngine, pausing_ray_client, worker_path
from vllm_harness import assert_matches

import streamsync as ss
from streamsync.cli.verify import PROMPTS, outputs_from, reference_outputs, sampling
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm

ray = extra("ray", "ray")


@pytest.fixture(scope="module")
def runtime() -> Iterator[None]:
    worker_path()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def llm_actor(
    runtime: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, torch.nn.Module]]:
    from vllm import LLM

    path = tmp_path_factory.mktemp("ray-dense")
    trainer = build_tiny_model(path, "dense", seed=0)
    actor = (
        ray.remote(LLM)
        .options(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})
        .remote(model=str(path), **ENGINE)
    )
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=600)  # its engine is up
        yield actor, trainer
    finally:
        ray.kill(actor)


def generated(actor: Any) -> Any:
    """The actor's greedy outputs of the fixed prompts (vLLM's ``LLM.generate`` in it)."""

    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    return outputs_from(ray.get(actor.generate.remote(requests, sampling(), use_tqdm=False)))


def test_weight_sync_into_an_llm_actor(llm_actor: tuple[Any, torch.nn.Module]) -> None:
    """Three syncs, blocking, through the actor's handle: the actor is named by class, id
    and node in the report's engine; each sync reaches its one worker; a bad tensor fails
    by name and leaves the actor serving the last version."""
    from streamsync.vllm import WeightSync
    from streamsync.vllm.ray import node_address

    actor, trainer = llm_actor
    endpoint = f"zmq+tcp://{node_address()}:0"
    with WeightSync(actor, endpoint) as sync:
        host = sync.channel.clients[0].host  # type: ignore[attr-defined]
        assert host.name.startswith("LLM actor ") and host.node == node_address()
        for step in range(3):
            perturb(trainer, seed=40 + step)
            want = reference_outputs(trainer)
            report = sync.update(ss.named_tensors(trainer))
            assert report.complete and report.receivers == 1
            assert report.instances["worker0.main"].missing == ()
            assert_matches(generated(actor), want)
        bad = {**trainer.state_dict(), "model.no_such.weight": torch.zeros(2)}
        with pytest.raises(ss.UnknownTensorError, match=r"model\.no_such\.weight"):
            sync.update(bad)
        assert_matches(generated(actor), want)


def test_an_async_llm_actor_generates_while_a_version_stages(runtime: None, tmp_path: Path) -> None:
    """An actor holding an ``AsyncLLM`` (as RL frameworks host one): a request generates
    through the whole staging (half-way through the stream it must produce more tokens: were
    the engine paused, this would wait out its limit), the commit pauses it only to apply,
    and its tokens after the commit carry the new version, which then serves the trainer's
    weights."""
    from streamsync.vllm import WeightSync
    from streamsync.vllm.ray import node_address

    trainer = build_tiny_model(tmp_path, "dense", seed=0)
    options = {"num_cpus": 0, "runtime_env": {"env_vars": ENGINE_ENV}}
    actor = ray.remote(AsyncEngine).options(**options).remote(str(tmp_path), **ENGINE)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=600)

        def tokens_after(count: int) -> int:
            deadline = time.monotonic() + 120
            while (now := ray.get(actor.generated.remote())) < count:
                assert time.monotonic() < deadline, f"{now} of {count} tokens within 120 s"
                time.sleep(0.01)
            return now

        with WeightSync(actor, f"zmq+tcp://{node_address()}:0", staged=False) as sync:
            sync.update(ss.named_tensors(trainer))
            old = str(sync.versions[0])
            perturb(trainer, seed=3)
            running = actor.generate.remote([[1, 2, 3, 4]], 400)
            started = tokens_after(1)

            def weights() -> Iterator[tuple[str, torch.Tensor]]:
                items = list(trainer.state_dict().items())
                for i, item in enumerate(items):
                    if i == len(items) // 2:
                        tokens_after(started + 3)
                    yield item

            staged = sync.stage(weights())
            at_commit = ray.get(actor.generated.remote())
            sync.commit(mode="keep")
            ((_, spans),) = ray.get(running, timeout=300)
        assert spans[0][0] == old and spans[-1][0] == str(staged.sync_id), spans
        assert at_commit < 400 and spans[-1][1] >= at_commit, (at_commit, spans)
        after = [tokens for tokens, _ in ray.get(actor.generate.remote(PROMPTS, 8))]
        assert after == reference_outputs(trainer).tokens
    finally:
        ray.kill(actor)


def test_vllms_ray_client_on_the_server_backend(runtime: None, tmp_path: Path) -> None:
    """``StreamsyncInitInfo`` with vLLM's own ``RayVLLMWeightSyncClient`` and no
    ``receivers``: the worker says how many it is and which vLLM it runs as it connects;
    plain syncs between the trainer's pause and resume, then staged ones through the client
    with ``pause``, ``reset_prefix_cache`` and ``resume`` added, each serving the trainer's
    weights under the version it names."""
    import vllm
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from streamsync.facts import EngineFacts
    from streamsync.vllm.native import StreamsyncInitInfo
    from streamsync.vllm.ray import node_address

    trainer = build_tiny_model(tmp_path, "dense", seed=0)
    options = {"num_cpus": 0, "runtime_env": {"env_vars": ENGINE_ENV}}
    actor = (
        ray.remote(AsyncEngine)
        .options(**options)
        .remote(str(tmp_path), weight_transfer="streamsync", **ENGINE)
    )
    endpoint = f"zmq+tcp://{node_address()}:0"
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=600)
        for client, staged in (
            (RayVLLMWeightSyncClient(actor), False),
            (pausing_ray_client(actor), True),
        ):
            engine = WeightTransferTrainerFactory.trainer_init(
                StreamsyncInitInfo(rank=0, endpoint=endpoint, staged=staged),
                client=client,
                source=ModuleSource(trainer),
            )
            try:
                assert engine.receivers == 1
                assert engine.channel.facts == (EngineFacts.of_vllm(vllm.__version__),)
                for step in range(2):
                    perturb(trainer, seed=80 + step + 10 * staged)
                    if not staged:
                        ray.get(actor.pause_generation.remote(mode="keep"))
                    engine.send_weights(weight_version=f"ray-{staged}-{step}")
                    if not staged:
                        ray.get(actor.resume_generation.remote())
                    ((tokens, spans),) = ray.get(actor.generate.remote([PROMPTS[0]], 8))
                    assert tokens == reference_outputs(trainer, [PROMPTS[0]]).tokens[0]
                    assert spans[-1][0] == f"ray-{staged}-{step}", spans
            finally:
                engine.shutdown()
    finally:
        ray.kill(actor)


def test_an_actor_killed_mid_sync_fails_it_by_name_and_rejoins_after_its_restart(
    runtime: None, tmp_path: Path
) -> None:
    """``ray.kill`` of the engine's actor half-way through the stream fails the sync within
    the channel's timeout, naming the actor; once Ray restarted it (``max_restarts``), on
    the weights it started with, the next sync reaches it and it serves the trainer's."""
    from vllm import LLM

    from streamsync.vllm import WeightSync
    from streamsync.vllm.ray import node_address

    trainer = build_tiny_model(tmp_path, "dense", seed=0)
    options = {"num_cpus": 0, "max_restarts": 1, "runtime_env": {"env_vars": ENGINE_ENV}}
    actor = ray.remote(LLM).options(**options).remote(model=str(tmp_path), **ENGINE)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=600)
        with WeightSync(actor, f"zmq+tcp://{node_address()}:0", timeout=30) as sync:
            name = sync.channel.clients[0].host.name  # type: ignore[attr-defined]
            sync.update(ss.named_tensors(trainer))
            perturb(trainer, seed=5)

            def killed_half_way() -> Iterator[tuple[str, torch.Tensor]]:
                items = list(trainer.state_dict().items())
                for i, item in enumerate(items):
                    if i == len(items) // 2:
                        ray.kill(actor, no_restart=False)
                    yield item

            started = time.monotonic()
            with pytest.raises(ss.StreamsyncError) as info:
                sync.update(killed_half_way())
            assert time.monotonic() - started < 30 + 10
            assert name in str(info.value), info.value
            restarted(actor)  # on the weights it started with
            report = sync.update(ss.named_tensors(trainer))
            assert report.complete and report.receivers == 1
            assert_matches(generated(actor), reference_outputs(trainer))
    finally:
        ray.kill(actor)


def test_an_engine_killed_while_staging_leaves_the_others_untouched(
    runtime: None, tmp_path: Path
) -> None:
    """Two engine actors, staged: one killed (``ray.kill``) half-way through the stream
    fails the stage within the channel's timeout, naming it; nothing is committed, and the
    other goes on serving the version before, untouched."""
    from vllm import LLM

    from streamsync.vllm import WeightSync
    from streamsync.vllm.ray import node_address

    trainer = build_tiny_model(tmp_path, "dense", seed=0)
    options = {"num_cpus": 0, "runtime_env": {"env_vars": ENGINE_ENV}}
    engines = [
        ray.remote(LLM).options(**options).remote(model=str(tmp_path), **ENGINE) for _ in range(2)
    ]
    doomed, survivor = engines
    try:
        ray.get([e.__ray_ready__.remote() for e in engines], timeout=600)
        endpoint = f"zmq+tcp://{node_address()}:0"
        with WeightSync(engines, endpoint, staged=True, timeout=30) as sync:
            name = sync.channel.clients[0].host.name  # type: ignore[attr-defined]
            perturb(trainer, seed=11)
            sync.update(ss.named_tensors(trainer))
            before = generated(survivor)
            perturb(trainer, seed=12)

            def killed_half_way() -> Iterator[tuple[str, torch.Tensor]]:
                items = list(trainer.state_dict().items())
                for i, item in enumerate(items):
                    if i == len(items) // 2:
                        ray.kill(doomed)
                    yield item

            started = time.monotonic()
            with pytest.raises(ss.StreamsyncError) as info:
                sync.update(killed_half_way())
            assert time.monotonic() - started < 30 + 10
            assert name in str(info.value), info.value
            after = generated(survivor)
        assert after.tokens == before.tokens and after.max_logprob_diff(before) == 0
    finally:
        for engine in engines:
            ray.kill(engine)


def test_lora_adapters_into_an_async_llm_actor(runtime: None, tmp_path: Path) -> None:
    """An ``AsyncLLM`` actor started with ``enable_lora=True`` that exposes its engine's
    ``add_lora``/``remove_lora``: an adapter synced from memory twice serves the peft
    model's outputs each time, under its name; removed, the engine no longer knows it."""
    peft = extra("peft", "lora")
    import copy

    from streamsync.vllm import WeightSync
    from streamsync.vllm.ray import node_address

    base = build_tiny_model(tmp_path, "dense", seed=0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    options = {"num_cpus": 0, "runtime_env": {"env_vars": ENGINE_ENV}}
    actor = (
        ray.remote(AsyncEngine)
        .options(**options)
        .remote(str(tmp_path), enable_lora=True, max_lora_rank=8, **ENGINE)
    )
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=600)
        with WeightSync(actor, f"zmq+tcp://{node_address()}:0") as sync:
            for step in range(2):
                with torch.no_grad():
                    gen = torch.Generator().manual_seed(20 + step)
                    for name, param in model.named_parameters():
                        if "lora_" in name:
                            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
                report = sync.update_lora("policy", model)
                assert report.complete and report.lora is not None and report.lora.rank == 8
                got = ray.get(actor.outputs.remote(sync.lora_request("policy")))
                want = reference_outputs(model)
                assert got.tokens == want.tokens and got.max_logprob_diff(want) <= 1e-4
            sync.remove_lora("policy")
            assert ray.get(actor.list_loras.remote()) == set()
    finally:
        ray.kill(actor)


def restarted(actor: Any, within: float = 600) -> None:
    """Wait until Ray has restarted ``actor`` (it answers as unavailable until then)."""
    deadline = time.monotonic() + within
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=within)
            return
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, f"not restarted within {within:g} s"
            time.sleep(0.5)


def test_importing_streamsync_never_imports_ray() -> None:
    code = (
        "import sys, streamsync, streamsync.vllm, streamsync.vllm.client; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
