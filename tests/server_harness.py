"""The real OpenAI-compatible vLLM server in a subprocess, with the ``streamsync`` backend, and
vLLM's own trainer-side usage against it (``WeightTransferTrainerFactory`` with an
``HTTPVLLMWeightSyncClient``).

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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from vllm_harness import PROMPTS, remove_vllm_segments, vllm_segments

from streamsync.cli.verify import MAX_TOKENS, Outputs
from streamsync.testing.peers import free_port

__all__ = [
    "ROOT",
    "Server",
    "Stream",
    "plugin_dir",
    "start_server",
    "stop_server",
    "trainer_engine",
]

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
    #: vLLM's CPU tensor-parallel segments in /dev/shm before the server started.
    segments_before: frozenset[str] = frozenset()

    def post(self, path: str, **kwargs: Any) -> Any:
        response = requests.post(f"{self.url}/{path}", timeout=300, **kwargs)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def get(self, path: str) -> Any:
        response = requests.get(f"{self.url}/{path}", timeout=60)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def greedy_tokens(
        self, prompts: list[list[int]] = PROMPTS, *, model: str | None = None
    ) -> list[list[int]]:
        """Greedy tokens for token-id prompts (the fixed ones by default), through
        /v1/completions (which goes through the prefix cache where it is on); ``model``: a
        LoRA adapter's name instead of the base model."""
        out = []
        for prompt in prompts:
            body = self.post(
                "v1/completions",
                json={
                    "model": model or self.model,
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            out.append(list(body["choices"][0]["token_ids"]))
        return out

    def outputs(self, prompts: list[list[int]] = PROMPTS) -> Outputs:
        """Greedy tokens and prompt logprobs of ``prompts``, as
        :func:`~streamsync.cli.verify.engine_outputs` gives them from an ``LLM``."""
        tokens, logprobs = [], []
        for prompt in prompts:
            body = self.post(
                "v1/completions",
                json={
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "prompt_logprobs": 0,
                },
            )
            choice = body["choices"][0]
            tokens.append(list(choice["token_ids"]))
            logprobs.append(
                [next(iter(d.values()))["logprob"] for d in choice["prompt_logprobs"][1:]]
            )
        return Outputs(tokens, logprobs)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@dataclass
class Stream:
    """A streamed greedy completion on ``server`` in a thread of its own, counting the chunks
    of tokens it has produced; :meth:`more` waits for more (events, no sleeps)."""

    server: Server
    max_tokens: int = 240
    chunks: int = 0
    done: bool = False
    error: BaseException | None = None
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Stream:
        self._thread = threading.Thread(target=self._run, name="stream", daemon=True)
        self._thread.start()
        self.more(1)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._thread is not None
        self._thread.join(timeout=300)

    def _run(self) -> None:
        body = {
            "model": self.server.model,
            "prompt": [1, 2, 3, 4],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with requests.post(
                f"{self.server.url}/v1/completions", json=body, stream=True, timeout=300
            ) as response:
                assert response.status_code == 200, response.text
                for line in response.iter_lines():
                    if line.startswith(b"data: {"):
                        with self._changed:
                            self.chunks += 1
                            self._changed.notify_all()
        except BaseException as exc:  # reported by more()
            self.error = exc
        finally:
            with self._changed:
                self.done = True
                self._changed.notify_all()

    def more(self, count: int, timeout: float = 120.0) -> tuple[int, int]:
        """Wait until ``count`` more chunks came; (chunks then, now). Fails if the stream
        ended or ``timeout`` passed first."""
        with self._changed:
            start = self.chunks
            reached = self._changed.wait_for(
                lambda: self.chunks >= start + count or self.done, timeout=timeout
            )
            assert reached and self.chunks >= start + count, (
                f"the stream produced {self.chunks - start} of {count} more chunks "
                f"(ended: {self.done}, error: {self.error!r})"
            )
            return start, self.chunks


def start_server(
    model: Path, tmp: Path, *extra: str, env_extra: dict[str, str] | None = None
) -> Server:
    port = free_port()
    log = tmp / "server.log"
    env = {
        **os.environ,
        **(env_extra or {}),
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
    before = vllm_segments()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", str(model), proc, log, before)
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
    """Stop the server as a deployment does (SIGTERM; SIGINT leaves the same), then remove
    the shared-memory segments its tensor-parallel workers left."""
    server.proc.terminate()
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(timeout=30)
    remove_vllm_segments(server.segments_before)


class ProtocolOnly:
    """A client with only the calls of vLLM's ``VLLMWeightSyncClient`` protocol (as vLLM's
    ``RayVLLMWeightSyncClient`` has): nothing to ask the engine's world size, version or
    needs with, and no server to post to."""

    def __init__(self, inner: Any) -> None:
        self.init_weight_transfer_engine = inner.init_weight_transfer_engine
        self.shutdown_weight_transfer_engine = inner.shutdown_weight_transfer_engine
        self.start_weight_update = inner.start_weight_update
        self.update_weights = inner.update_weights
        self.finish_weight_update = inner.finish_weight_update


def trainer_engine(
    server: Server, source: Any, *, protocol_only: bool = False, **options: Any
) -> Any:
    """Exactly vLLM's usage, with the streamsync init info (``protocol_only``: through a
    client that has only the calls of vLLM's protocol)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from streamsync.vllm.native import StreamsyncInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        StreamsyncInitInfo(endpoint="zmq+tcp://127.0.0.1:0", rank=0, **options),
        client=(ProtocolOnly if protocol_only else lambda c: c)(
            HTTPVLLMWeightSyncClient(server.url)
        ),
        source=source,
    )
