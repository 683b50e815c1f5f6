"""streamsync as vLLM's own weight-transfer backend: the real OpenAI-compatible server in a
subprocess, driven by vLLM's ``HTTPVLLMWeightSyncClient`` through
``WeightTransferTrainerFactory`` exactly as vLLM documents it.

The server's processes register the backend through a ``vllm.general_plugins`` entry point
(a throwaway ``.dist-info`` on their ``PYTHONPATH``, the same metadata an install of
streamsync writes), so the plugin path is the real one; this process registers it by
importing :mod:`streamsync.vllm.native`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import PROMPTS, reference_outputs

from streamsync.testing.models import build_tiny_model, perturb
from streamsync.testing.peers import free_port

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
requests = pytest.importorskip("requests")

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 900.0  # two shared cores: the server takes minutes to come up


def plugin_dir(tmp: Path) -> Path:
    """A directory whose ``.dist-info`` declares the entry point pyproject.toml declares."""
    info = tmp / "streamsync_native_plugin-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: streamsync-native-plugin\nVersion: 0.0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nstreamsync = streamsync.vllm.native:register\n"
    )
    return tmp


@dataclass
class Server:
    url: str
    model: str
    proc: subprocess.Popen[bytes]
    log: Path

    def post(self, path: str, **kwargs: Any) -> Any:
        response = requests.post(f"{self.url}/{path}", timeout=300, **kwargs)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def get(self, path: str) -> Any:
        response = requests.get(f"{self.url}/{path}", timeout=60)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def greedy_tokens(self) -> list[list[int]]:
        """Greedy tokens for the fixed token-id prompts, through /v1/completions."""
        out = []
        for prompt in PROMPTS:
            body = self.post(
                "v1/completions",
                json={
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            out.append(list(body["choices"][0]["token_ids"]))
        return out

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def start_server(model: Path, tmp: Path, *extra: str) -> Server:
    port = free_port()
    log = tmp / "server.log"
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(plugin_dir(tmp / "plugin")), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: an engine process
    # `vllm serve` of vllm-cpu fails (it looks up a distribution named "vllm"): run the module.
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--seed",
        "0",
        "--weight-transfer-config",
        json.dumps({"backend": "streamsync"}),
        *extra,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", str(model), proc, log)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{server.tail()}")
        try:
            if requests.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(2)
    stop_server(server)
    pytest.fail(f"the vLLM server did not come up within {START_TIMEOUT:g} s:\n{server.tail()}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(timeout=30)


def trainer_engine(server: Server, source: Any, **options: Any) -> Any:
    """Exactly vLLM's usage, with the streamsync init info."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from streamsync.vllm.native import StreamsyncInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        StreamsyncInitInfo(endpoint="zmq+tcp://127.0.0.1:0", rank=0, **options),
        client=HTTPVLLMWeightSyncClient(server.url),
        source=source,
    )


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


def test_dense_server_bad_input_leaves_it_serving(dense: tuple[Server, torch.nn.Module]) -> None:
    """A wrong shape fails with the worker's own error class on the trainer; a trainer that
    goes away mid-update fails the worker's receive; either way the next update works."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    import streamsync as ss

    server, trainer = dense
    engine = trainer_engine(server, ModuleSource(trainer), bucket_bytes=256 << 10, timeout=30)
    try:
        bad = dict(trainer.state_dict())
        name = "model.layers.0.mlp.down_proj.weight"
        bad[name] = torch.zeros(3, 5)
        server.post("pause", params={"mode": "keep"})
        with pytest.raises(ss.StreamsyncError) as info:
            engine.send_weights(bad)
        assert isinstance(info.value, ss.ShapeMismatchError | ss.ReceiverFailedError), info.value
        server.post("resume")
        three_steps(server, trainer, engine, seed=40)
    finally:
        engine.shutdown()


def test_moe_server_three_updates_with_the_expander(tmp_path: Path) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    from streamsync.adapters import expand_moe

    # Smaller weights than dense: the CPU MoE kernel sums experts in another order.
    trainer = build_tiny_model(tmp_path / "model", "moe", seed=0, init_std=0.12)
    server = start_server(tmp_path / "model", tmp_path)
    try:
        pipeline = expand_moe(when="always", model_type="qwen3_moe")
        engine = trainer_engine(server, ModuleSource(trainer), pipeline=pipeline)
        try:
            three_steps(server, trainer, engine, seed=70)
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
