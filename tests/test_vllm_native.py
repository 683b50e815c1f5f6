"""streamsync as vLLM's own weight-transfer backend: the real OpenAI-compatible server in a
subprocess, driven by vLLM's ``HTTPVLLMWeightSyncClient`` through
``WeightTransferTrainerFactory`` exactly as vLLM documents it.

The server's processes register the backend through a ``vllm.general_plugins`` entry point
(a throwaway ``.dist-info`` on their ``PYTHONPATH``, the same metadata an install of
streamsync writes), so the plugin path is the real one; this process registers it by
importing :mod:`streamsync.vllm.native`.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from server_harness import ROOT, Server, plugin_dir, start_server, stop_server, trainer_engine
from vllm_harness import LONG_PROMPT, PROMPTS, reference_outputs

from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


def three_steps(
    server: Server, trainer: torch.nn.Module, engine: Any, *, seed: int, **kwargs: Any
) -> None:
    """pause(keep) -> send_weights -> resume, three times; each followed by greedy
    completions that equal the trainer's, and the weight version in /weight_info."""
    before = server.greedy_tokens()
    changed = False
    for step in range(3):
        perturb(trainer, seed=seed + step)
        want = reference_outputs(trainer).tokens
        changed |= want != before
        server.post("pause", params={"mode": "keep"})
        engine.send_weights(weight_version=f"step-{seed + step}", **kwargs)
        server.post("resume")
        before = server.greedy_tokens()
        assert before == want, f"step {step}"
        assert server.get("weight_info") == {"weight_version": f"step-{seed + step}"}
    assert changed, "the perturbations did not change the greedy tokens: nothing was shown"


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, torch.nn.Module]]:
    tmp = tmp_path_factory.mktemp("native-dense")
    trainer = build_tiny_model(tmp / "model", "dense", seed=0)
    server = start_server(tmp / "model", tmp)
    yield server, trainer
    stop_server(server)


def test_dense_server_three_updates(dense: tuple[Server, torch.nn.Module]) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    server, trainer = dense
    assert server.greedy_tokens() == reference_outputs(trainer).tokens  # as loaded
    engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10)
    try:
        three_steps(server, trainer, engine, seed=10)
    finally:
        engine.shutdown()


def test_dense_server_delta_syncs(dense: tuple[Server, torch.nn.Module]) -> None:
    """``StreamsyncInitInfo(delta=True)``: after the first (full) sync, each send_weights
    moves patches of what changed, and the server serves the trainer's weights."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    server, trainer = dense
    engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10, delta=True)
    try:
        wires, seen = [], [server.greedy_tokens()]
        for step in range(4):
            gen = torch.Generator().manual_seed(70 + step)
            with torch.no_grad():
                for param in trainer.parameters():
                    chosen = torch.rand(param.shape, generator=gen) < 0.03
                    param.add_(torch.where(chosen, torch.randn(param.shape, generator=gen), 0.0))
            want = reference_outputs(trainer).tokens
            server.post("pause", params={"mode": "keep"})
            engine.send_weights()
            server.post("resume")
            assert server.greedy_tokens() == want, f"step {step}"
            seen.append(want)
            report = engine.last_report
            assert report is not None and report.delta is not None
            assert (report.delta.base is None) == (step == 0), report.delta
            wires.append(report.wire_bytes)
        assert max(wires[1:]) < wires[0] / 4, wires
        assert all(a != b for a, b in itertools.pairwise(seen)), "a step changed no tokens"
    finally:
        engine.shutdown()


DYING_TRAINER = """
import os, sys
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from streamsync.vllm.native import StreamsyncInitInfo

url, path = sys.argv[1:3]
model = AutoModelForCausalLM.from_pretrained(path)

def dying():
    for i, (name, param) in enumerate(model.named_parameters()):
        if i == 12:
            os._exit(3)  # mid-update, after several buckets went out
        yield name, param.detach()

engine = WeightTransferTrainerFactory.trainer_init(
    StreamsyncInitInfo(rank=0, bucket_bytes=64 << 10, timeout=30),
    client=HTTPVLLMWeightSyncClient(url),
)
engine.send_weights(dying())
"""


def test_dense_server_bad_input_leaves_it_serving(
    dense: tuple[Server, torch.nn.Module], tmp_path: Path
) -> None:
    """A wrong secret, wrong shapes, wrong names, a second start while one runs and a
    trainer that dies mid-update: each fails with a named error, and the server serves and
    takes the next update."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    import streamsync as ss

    server, trainer = dense
    with pytest.MonkeyPatch.context() as mp:  # a secret only the trainer knows
        mp.setenv("STREAMSYNC_SECRET", "only-the-trainer-knows-it")
        with pytest.raises(ss.AuthenticationError):
            trainer_engine(server, ModuleSource(trainer), timeout=30)
    engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10, timeout=30)
    try:
        server.post("pause", params={"mode": "keep"})
        name = "model.layers.1.mlp.down_proj.weight"
        bad_shape = {**trainer.state_dict(), name: torch.zeros(3, 5)}
        shapes = r"received shape \[3, 5\], the engine's is \[128, 256\]"
        with pytest.raises(ss.ShapeMismatchError, match=rf"{name}.*{shapes}"):
            engine.send_weights(bad_shape)
        bad_name = {**trainer.state_dict(), "model.no_such.weight": torch.zeros(2)}
        with pytest.raises(
            ss.UnknownTensorError, match=r"'model\.no_such\.weight' is not a parameter or buffer"
        ):
            engine.send_weights(bad_name)
        server.post("start_weight_update")
        with pytest.raises(ss.ReceiverFailedError, match="start_weight_update"):
            engine.send_weights()
        server.post("finish_weight_update")
        server.post("resume")
        assert len(server.greedy_tokens()) == len(PROMPTS)  # still serving
        three_steps(server, trainer, engine, seed=40)
    finally:
        engine.shutdown()

    script = tmp_path / "dying_trainer.py"
    script.write_text(DYING_TRAINER)
    server.post("pause", params={"mode": "keep"})
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    dead = subprocess.run(
        [sys.executable, str(script), server.url, server.model], env=env, timeout=600
    )
    assert dead.returncode == 3
    server.post("resume")
    assert len(server.greedy_tokens()) == len(PROMPTS)  # still serving
    engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10, timeout=30)
    try:
        three_steps(server, trainer, engine, seed=50)
    finally:
        engine.shutdown()


def test_moe_server_three_updates_with_the_expander(tmp_path: Path) -> None:
    """A MoE model through a client with only vLLM's protocol calls and no ``receivers``:
    ``expand_moe("auto")`` decides from the vLLM the worker said it runs (not this
    process's), and ``always`` expands; both serve the trainer's weights."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from streamsync.adapters import expand_moe
    from streamsync.facts import EngineFacts

    # Smaller weights than dense: the CPU MoE kernel sums experts in another order.
    trainer = build_tiny_model(tmp_path / "model", "moe", seed=0, init_std=0.12)
    server = start_server(tmp_path / "model", tmp_path)
    try:
        pipeline = expand_moe(when="auto", model_type="qwen3_moe")
        engine = trainer_engine(
            server, ModuleSource(trainer), pipeline=pipeline, protocol_only=True
        )
        try:
            running = EngineFacts.of_vllm(server.get("version")["version"])
            assert engine.channel.facts == (running,) and engine.receivers == 1
            three_steps(server, trainer, engine, seed=60)
        finally:
            engine.shutdown()
        pipeline = expand_moe(when="always", model_type="qwen3_moe")
        engine = trainer_engine(server, ModuleSource(trainer), pipeline=pipeline)
        try:
            three_steps(server, trainer, engine, seed=70)
        finally:
            engine.shutdown()
    finally:
        stop_server(server)


def test_sharded_init_learns_what_the_servers_worker_reads(tmp_path: Path) -> None:
    """``StreamsyncInitInfo(sharded=True)`` on a TP=1 server without the worker extension
    (no ``/collective_rpc`` answers our calls): its one worker says, as it connects, that
    it reads every checkpoint tensor it loads whole, learned from its loaders, and the syncs
    that follow serve the trainer's weights."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from streamsync.vllm.slices import checkpoint_manifest

    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0)
    server = start_server(tmp_path / "model", tmp_path)
    try:
        engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10, sharded=True)
        try:
            assert list(engine.needs) == ["worker0.main"]
            needs = {need.name: need for need in engine.needs["worker0.main"].needs}
            manifest = checkpoint_manifest(str(tmp_path / "model"))
            assert "model.embed_tokens.weight" in needs
            assert "model.layers.0.self_attn.q_proj.weight" in needs
            assert set(needs) == set(manifest) == set(trainer.state_dict())
            for name, need in needs.items():
                assert (need.dtype, need.shape) == manifest[name], name
                assert need.box is None and need.why_whole == "", need
            three_steps(server, trainer, engine, seed=90)
        finally:
            engine.shutdown()
    finally:
        stop_server(server)


def spec_counts(server: Server) -> tuple[float, float]:
    """(drafted, accepted) tokens so far, from the server's Prometheus metrics."""
    text = requests.get(f"{server.url}/metrics", timeout=60).text
    counts = {"num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    for line in text.splitlines():
        for key in counts:
            if line.startswith(f"vllm:spec_decode_{key}_total"):
                counts[key] += float(line.rsplit(" ", 1)[1])
    return counts["num_draft_tokens"], counts["num_accepted_tokens"]


def test_drafter_through_the_draft_route(tmp_path: Path) -> None:
    """A draft-model server: the main model and, through /start_draft_weight_update, the
    drafter get the trainer's weights; then every drafted token is accepted."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    trainer = build_tiny_model(tmp_path / "main", "dense", seed=0)
    build_tiny_model(tmp_path / "draft", "dense", seed=1)  # a different drafter to start
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    server = start_server(tmp_path / "main", tmp_path, "--speculative-config", json.dumps(spec))
    try:
        drafted0, accepted0 = spec_counts(server)
        server.greedy_tokens()
        drafted1, accepted1 = spec_counts(server)
        assert accepted1 - accepted0 < drafted1 - drafted0  # the drafter differs
        engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10)
        try:
            for step in range(2):
                perturb(trainer, seed=300 + step)
                want = reference_outputs(trainer).tokens
                server.post("pause", params={"mode": "keep"})
                engine.send_weights(weight_version=f"main-{step}")
                engine.send_weights(weight_version=f"draft-{step}", draft=True)
                server.post("resume")
                drafted0, accepted0 = spec_counts(server)
                assert server.greedy_tokens() == want
                drafted1, accepted1 = spec_counts(server)
                assert drafted1 > drafted0 and accepted1 - accepted0 == drafted1 - drafted0
                assert server.get("weight_info") == {"weight_version": f"draft-{step}"}
        finally:
            engine.shutdown()
    finally:
        stop_server(server)


#: Prefix caching on, 32-token blocks: the long prompt asked every round would be served
#: from KV cached on the old weights unless the pause reset the cache.
PREFIX_CACHE = ("--enable-prefix-caching", "--block-size", "32")
ALL = [*PROMPTS, LONG_PROMPT]


def tied_steps(
    server: Server,
    trainer: torch.nn.Module,
    engine: Any,
    *,
    seed: int,
    steps: int = 3,
    drafter: bool = False,
) -> None:
    """Per step: the long prompt through the cache, a perturbation, pause(keep) ->
    send_weights (main, and the drafter through its route) -> resume, then greedy tokens of
    every prompt equal the trainer's (and every drafted token is accepted)."""
    for step in range(steps):
        server.greedy_tokens([LONG_PROMPT])
        perturb(trainer, seed=seed + step)
        want = reference_outputs(trainer, ALL).tokens
        server.post("pause", params={"mode": "keep"})
        engine.send_weights(weight_version=f"main-{seed + step}")
        if drafter:
            engine.send_weights(weight_version=f"draft-{seed + step}", draft=True)
        server.post("resume")
        drafted0, accepted0 = spec_counts(server)
        assert server.greedy_tokens(ALL) == want, f"step {step}"
        drafted1, accepted1 = spec_counts(server)
        if drafter:
            assert drafted1 > drafted0 and accepted1 - accepted0 == drafted1 - drafted0


def test_tied_model_and_tied_drafter_from_module_source_and_weight_source(
    tmp_path: Path,
) -> None:
    """A tied Qwen3 served with a tied drafter: vLLM's ``ModuleSource`` yields the tied
    parameter once (``named_parameters()``), ``weight_source(model)`` yields the state dict
    (both names); both leave main model and drafter on the trainer's weights."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from streamsync.vllm.native import weight_source

    trainer = build_tiny_model(tmp_path / "main", "dense", seed=0, tied=True)
    build_tiny_model(tmp_path / "draft", "dense", seed=1, tied=True)
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    server = start_server(
        tmp_path / "main", tmp_path, "--speculative-config", json.dumps(spec), *PREFIX_CACHE
    )
    try:
        assert server.greedy_tokens(ALL) == reference_outputs(trainer, ALL).tokens
        for source, seed in ((ModuleSource(trainer), 500), (weight_source(trainer), 600)):
            engine = trainer_engine(server, source, bucket_bytes=256 << 10)
            try:
                tied_steps(server, trainer, engine, seed=seed, drafter=True)
            finally:
                engine.shutdown()
    finally:
        stop_server(server)


def test_tensor_parallel_server_learns_its_workers(tmp_path: Path) -> None:
    """``--tensor-parallel-size 2`` (one core per worker), no worker extension: the workers
    say how many they are as they connect, a wrong explicit count is refused by name, each
    worker says it reads its half of a TP-split tensor and all of a replicated one
    (``sharded=True``), and three syncs of a tied model reach both workers, through vLLM's
    HTTP client and through a client with only vLLM's protocol calls."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    import streamsync as ss

    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0, tied=True)
    server = start_server(
        tmp_path / "model",
        tmp_path,
        "--tensor-parallel-size",
        "2",
        *PREFIX_CACHE,
        env_extra={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    try:
        assert server.get("get_world_size") == {"world_size": 2}
        with pytest.raises(ss.ConfigError, match=r"receivers=1\) but the engine's workers say"):
            trainer_engine(server, ModuleSource(trainer), receivers=1)
        engine = trainer_engine(
            server, ModuleSource(trainer), bucket_bytes=256 << 10, sharded=True, protocol_only=True
        )
        try:
            assert engine.receivers == 2
            tied_steps(server, trainer, engine, seed=650, steps=1)
            assert engine.last_report.receivers == 2
        finally:
            engine.shutdown()
        engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10, sharded=True)
        try:
            assert engine.receivers == 2
            assert sorted(engine.needs) == ["worker0.main", "worker1.main"]
            assert engine.needs["worker0.main"].layout != engine.needs["worker1.main"].layout
            split, replicated = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
            by_worker = [{n.name: n for n in engine.needs[f"worker{w}.main"].needs} for w in (0, 1)]
            boxes = [b[split].box for b in by_worker]
            assert None not in boxes and boxes[0] != boxes[1]
            half = prod(by_worker[0][split].shape) // 2
            assert [prod(b.shape) for b in boxes] == [half, half]  # type: ignore[union-attr]
            assert [b[replicated].box for b in by_worker] == [None, None]
            tied_steps(server, trainer, engine, seed=700)
            assert engine.last_report.receivers == 2
        finally:
            engine.shutdown()
    finally:
        stop_server(server)


def test_same_trainer_code_against_an_in_process_async_llm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer code of the server tests, on an ``AsyncLLM`` in this process through
    ``AsyncLLMWeightSyncClient`` (its engine core and worker are processes of their own),
    whose workers say what they read as they connect."""
    import uuid

    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm_harness import TRAINER

    from streamsync.vllm.native import AsyncLLMWeightSyncClient, StreamsyncInitInfo

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.syspath_prepend(str(plugin_dir(tmp_path / "plugin")))  # the entry point
    trainer = build_tiny_model(tmp_path / "model", "dense", seed=0)
    args = AsyncEngineArgs(
        model=str(tmp_path / "model"),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="streamsync"),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def start() -> tuple[Any, Any]:
        llm = AsyncLLM.from_engine_args(args)
        return llm, AsyncLLMWeightSyncClient(llm)

    async def tokens() -> list[list[int]]:
        out = []
        for prompt in PROMPTS:
            final = None
            async for o in llm.generate({"prompt_token_ids": prompt}, greedy, str(uuid.uuid4())):
                final = o
            assert final is not None
            out.append(list(final.outputs[0].token_ids))
        return out

    llm, client = TRAINER.run(start, timeout=600)
    try:
        # Trainer code: blocking, on this thread; the client runs the engine's calls on its
        # loop.
        engine = WeightTransferTrainerFactory.trainer_init(
            StreamsyncInitInfo(rank=0, bucket_bytes=256 << 10, sharded=True),
            client=client,
            source=ModuleSource(trainer),
        )
        try:
            assert list(engine.needs) == ["worker0.main"]  # told as the worker connected
            for step in range(3):
                perturb(trainer, seed=900 + step)
                want = reference_outputs(trainer).tokens
                TRAINER.run(lambda: llm.pause_generation(mode="keep"), timeout=60)
                engine.send_weights(weight_version=f"inproc-{step}")
                TRAINER.run(llm.resume_generation, timeout=60)
                assert TRAINER.run(tokens, timeout=300) == want
                assert TRAINER.run(llm.get_weight_version, timeout=60) == f"inproc-{step}"
        finally:
            engine.shutdown()
    finally:
        TRAINER.run(lambda: _shutdown(llm), timeout=120)
        llm = client = engine = None  # its finalizer runs now, not at interpreter exit
        gc.collect()


async def _shutdown(llm: Any) -> None:
    llm.shutdown()
