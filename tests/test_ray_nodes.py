"""Engines on other Ray nodes: a cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``), the engine actor scheduled on the node that has the
``engine`` resource, the trainer (Ray's driver) on the head. The trainer's endpoint binds on
its node's address as Ray reports it; the engine's worker connects to it from its node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import extra
from ray_harness import ENGINE, ENGINE_ENV, worker_path

import streamsync as ss
from streamsync.cli.verify import PROMPTS, reference_outputs
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm

ray = extra("ray", "ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:
    from ray.cluster_utils import Cluster
    from vllm import LLM

    worker_path()
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"trainer": 1}, "include_dashboard": False},
    )
    engine_node = nodes.add_node(num_cpus=1, resources={"engine": 1})
    ray.init(address=nodes.address)
    path = tmp_path_factory.mktemp("ray-nodes")
    trainer = build_tiny_model(path, "dense", seed=0)
    options = {"num_cpus": 0, "resources": {"engine": 1}, "runtime_env": {"env_vars": ENGINE_ENV}}
    actor = ray.remote(LLM).options(**options).remote(model=str(path), **ENGINE)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=600)
        yield actor, trainer, engine_node
    finally:
        ray.kill(actor)
        ray.shutdown()
        nodes.shutdown()


def test_the_engine_on_another_node_syncs_from_this_nodes_address(
    cluster: tuple[Any, torch.nn.Module, Any],
) -> None:
    from streamsync.vllm import WeightSync
    from streamsync.vllm.ray import node_address

    actor, trainer, engine_node = cluster
    here = ray.get_runtime_context().get_node_id()
    there = ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
    assert there == engine_node.node_id != here  # the engine runs on the other node
    with WeightSync(actor, f"zmq+tcp://{node_address()}:0") as sync:
        for step in range(2):
            perturb(trainer, seed=70 + step)
            report = sync.update(ss.named_tensors(trainer))
            assert report.complete and report.receivers == 1
            tokens = [
                list(o.outputs[0].token_ids)
                for o in ray.get(
                    actor.generate.remote(
                        [{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False
                    )
                )
            ]
            assert tokens == reference_outputs(trainer).tokens


def _greedy() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("scheme", ["zmq+tcp", "torch+gloo"])
def test_an_address_not_of_the_trainers_node_is_refused_by_name(
    cluster: tuple[Any, torch.nn.Module, Any], scheme: str
) -> None:
    """An endpoint on an address this node does not have (a TEST-NET-2 address) is refused
    as the channel opens, naming it, before any engine waits on it."""
    from streamsync.vllm import WeightSync

    actor, _, _ = cluster
    with (
        pytest.raises(ss.ConfigError, match=r"198\.51\.100\.1.*cannot (bind|listen)"),
        WeightSync(actor, f"{scheme}://198.51.100.1:0"),
    ):
        pass
