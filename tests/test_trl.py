"""streamsync as the ``weight_transfer`` of TRL's ``AsyncGRPOTrainer``
(:mod:`streamsync.integrations.trl`).

TRL is the installed one (the ``trl`` extra): the protocol's methods and signatures are read
from it, and the calling order is the trainer's. The engine tests drive the real vLLM server
(``tests/server_harness.py``); the end-to-end ones run ``examples/trl_async_grpo.py``, which
trains with ``AsyncGRPOTrainer`` itself. The error tests talk to a stand-in HTTP server where
the condition needs a vLLM server configured otherwise (started without the backend, without
``VLLM_SERVER_DEV_MODE``, without LoRA): it answers ``/server_info`` as vLLM does, and the
engine tests check that a real server's answer is read the same way.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import extra

import streamsync as ss
from streamsync.integrations.trl import SERVER_FLAG, WeightTransfer
from streamsync.testing.models import build_tiny_model, perturb, tiny_config
from streamsync.testing.peers import free_port

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ("init_weight_transfer", "pause", "send_weights", "resume", "destroy")


@pytest.fixture(scope="module")
def trainer_module() -> Any:
    extra("trl", "trl")
    return extra("trl.experimental.async_grpo.async_grpo_trainer", "trl")


def test_weight_transfer_has_the_methods_of_trls_protocol(trainer_module: Any) -> None:
    """Every method of TRL's ``WeightTransferProtocol``, with its parameters and
    annotations, and every method ``AsyncGRPOTrainer`` calls on its ``weight_transfer``."""
    protocol = trainer_module.WeightTransferProtocol
    init = inspect.signature(trainer_module.AsyncGRPOTrainer.__init__)
    assert init.parameters["weight_transfer"].annotation == protocol | None
    methods = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    assert sorted(methods) == sorted(PROTOCOL), "TRL's protocol changed: review WeightTransfer"
    for name in methods:
        theirs = inspect.signature(getattr(protocol, name), eval_str=True)
        ours = inspect.signature(getattr(WeightTransfer, name), eval_str=True)
        assert [(p.name, p.kind, p.annotation) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.annotation) for p in theirs.parameters.values()
        ], name
        assert ours.return_annotation == theirs.return_annotation, name
    called = set(re.findall(r"weight_transfer\.(\w+)\(", inspect.getsource(trainer_module)))
    assert called and called <= set(PROTOCOL), called


class _StandIn(BaseHTTPRequestHandler):
    """Answers GET ``/health`` and ``/server_info`` from the server's ``routes``; everything
    else is a 404, as a route vLLM did not mount."""

    def do_GET(self) -> None:
        route = self.path.split("?")[0]
        status, body = self.server.routes.get(route, (404, {"detail": "Not Found"}))  # type: ignore[attr-defined]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[Any]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    server.routes = {"/health": (200, {})}  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def _server_info(transfer: Any = None, lora: Any = None) -> tuple[int, dict[str, Any]]:
    config = {"weight_transfer_config": transfer, "lora_config": lora}
    return 200, {"vllm_config": config, "vllm_env": {}, "system_env": {}}


def test_an_unreachable_server_is_named() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    transfer = WeightTransfer(url, server_timeout=0.5)
    with pytest.raises(ss.PeerBrokenError, match=re.escape(f"vLLM server at {url} cannot be")):
        transfer.init_weight_transfer()
    with pytest.raises(ss.PeerBrokenError, match=re.escape(f"{url} cannot be reached")):
        transfer.pause()


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (_server_info(None), "runs no weight-transfer backend, not 'streamsync'"),
        (_server_info({"backend": "nccl"}), "runs backend 'nccl', not 'streamsync'"),
        ((404, {"detail": "Not Found"}), "no GET /server_info route: start it with VLLM_SERVER"),
    ],
    ids=["no-backend", "nccl", "no-dev-mode"],
)
def test_a_server_without_the_backend_names_the_flag(
    stand_in: Any, answer: tuple[int, Any], says: str
) -> None:
    stand_in.routes["/server_info"] = answer
    url = f"http://127.0.0.1:{stand_in.server_port}"
    transfer = WeightTransfer(url)
    with pytest.raises(ss.ConfigError) as info:
        transfer.init_weight_transfer()
    assert says in str(info.value) and SERVER_FLAG in str(info.value)
    assert url in str(info.value)
    if answer[0] == 404:
        with pytest.raises(ss.ConfigError, match="has no POST /pause route"):
            transfer.pause()


def test_bad_use_is_a_config_error() -> None:
    with pytest.raises(ss.ConfigError, match="http://HOST:PORT"):
        WeightTransfer("localhost:8000")
    transfer = WeightTransfer("http://127.0.0.1:1")
    with pytest.raises(ss.ConfigError, match=r"init_weight_transfer\(\) first"):
        transfer.send_weights(iter([]))
    transfer.destroy()  # nothing to release: TRL calls it in a finally


def _trainer(
    path: Path, transfer: Any, monkeypatch: pytest.MonkeyPatch, *, lora: bool = True
) -> Any:
    """An ``AsyncGRPOTrainer`` on the tiny model at ``path`` (built, not trained: with a
    ``weight_transfer`` given, its constructor does not contact the server)."""
    from peft import LoraConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as module

    # Its constructor asks CUDA for the device's name (MFU metrics), as examples/ does.
    monkeypatch.setattr(module, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    config = AsyncGRPOConfig(
        output_dir=str(path / "out"),
        vllm_server_base_url=getattr(transfer, "server_url", "http://127.0.0.1:1"),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_staleness=2,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    data = [[{"role": "user", "content": "w1 w2"}]] * 4
    return AsyncGRPOTrainer(
        model=str(path / "model"),
        reward_funcs=_example().toy_reward,
        args=config,
        train_dataset=extra("datasets", "trl").Dataset.from_dict({"prompt": data}),
        peft_config=LoraConfig(r=8, target_modules=["q_proj"]) if lora else None,
        weight_transfer=transfer,
    )


def test_adapter_only_checks_the_trainer_and_the_server(
    trainer_module: Any, stand_in: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``adapter_only`` on TRL's own trainer: it refuses a model without an adapter and a
    trainer built with another weight transfer, sets the name TRL's rollout worker asks
    for, and its init refuses a server without LoRA or with too few adapter slots."""
    extra("peft", "lora")
    _example().build_model(tmp_path / "model")
    transfer = WeightTransfer(f"http://127.0.0.1:{stand_in.server_port}")
    with pytest.raises(ss.ConfigError, match="not a peft model; pass peft_config="):
        transfer.adapter_only(_trainer(tmp_path, transfer, monkeypatch, lora=False))
    other = _trainer(tmp_path, WeightTransfer(transfer.server_url), monkeypatch)
    with pytest.raises(ss.ConfigError, match="weight_transfer is not this WeightTransfer"):
        transfer.adapter_only(other)
    trainer = _trainer(tmp_path, transfer, monkeypatch)
    assert trainer.rollout_worker._loop_kwargs["lora_name"] is None  # TRL's: the base model
    with pytest.raises(ss.ConfigError, match="LoRA adapter name"):
        transfer.adapter_only(trainer, name="no spaces")
    transfer.adapter_only(trainer)
    assert trainer.rollout_worker._loop_kwargs["lora_name"] == "trl-policy"

    streamsync = {"backend": "streamsync"}
    stand_in.routes["/server_info"] = _server_info(streamsync, None)
    with pytest.raises(ss.ConfigError, match="runs without LoRA: start it with --enable-lora"):
        transfer.init_weight_transfer()
    stand_in.routes["/server_info"] = _server_info(streamsync, {"max_loras": 3})
    with pytest.raises(ss.ConfigError, match="max_staleness=2 needs 4: restart it with"):
        transfer.init_weight_transfer()


def _example() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "trl_example", ROOT / "examples" / "trl_async_grpo.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def test_the_examples_cpu_tree_attention_is_trls_attention(trainer_module: Any) -> None:
    """The example's stand-in for the FlashAttention-3 kernel: TRL's packed prefix tree of
    three samples (two sharing a prefix) through it gives each sample's logits as a plain
    forward of that sample does."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import packing

    original = packing._flash_attn
    try:
        _example().cpu_tree_attention()
        packing.register_tree_attention()
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(tiny_config("dense")).eval()
        tree = AutoModelForCausalLM.from_config(
            tiny_config("dense"), attn_implementation=packing.TREE_ATTENTION
        ).eval()
        tree.load_state_dict(plain.state_dict())
        samples = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 20, 21], [30, 31, 32]]
        row = packing.TreeRow()
        for group, ids in zip([0, 0, 1], samples, strict=True):
            n = len(ids)
            row.add(
                {
                    "input_ids": torch.tensor(ids),
                    "completion_mask": torch.tensor([0, 0] + [1] * (n - 2)),
                    "old_log_probs": torch.zeros(n),
                    "advantage": 1.0,
                    "group_id": group,
                }
            )
        packed = row.pack()
        assert len(packed["input_ids"]) < sum(map(len, samples))  # the prefix is shared
        hidden = tree.model(
            input_ids=packed["input_ids"][None],
            position_ids=packed["position_ids"][None],
            use_cache=False,
            tree_kv_index=packed["tree_kv_index"],
            tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
        ).last_hidden_state
        logits = tree.lm_head(hidden)[0]
        tokens, paths = packed["input_ids"].tolist(), packed["tree_kv_index"].tolist()
        bounds = packed["tree_cu_seqlens_k"].tolist()
        by_tokens = {
            tuple(tokens[i] for i in paths[a:b]): paths[a:b] for a, b in itertools.pairwise(bounds)
        }
        for ids in samples:
            want = plain(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logits[by_tokens[tuple(ids)]], want, atol=1e-5, rtol=0)
    finally:
        packing._flash_attn = original
        packing.register_tree_attention()


# The real server.


def _trl_stream(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``AsyncGRPOTrainer._streaming_iter`` yields on one process: TRL's own walk of
    the parameters, each detached."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    for name, param in _iter_vllm_named_params(model):
        yield name, param.detach()


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, torch.nn.Module]]:
    from server_harness import start_server, stop_server

    tmp = tmp_path_factory.mktemp("trl-dense")
    trainer = build_tiny_model(tmp / "model", "dense", seed=0)
    server = start_server(tmp / "model", tmp)
    yield server, trainer
    stop_server(server)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_trainer_calling_order_against_the_server(
    trainer_module: Any, dense: tuple[Any, torch.nn.Module], delta: bool
) -> None:
    """``AsyncGRPOTrainer``'s order: ``init_weight_transfer``; per step ``pause`` →
    ``send_weights(generator)`` → ``resume``; ``destroy``. After each step the server's
    greedy tokens equal the trainer's, and with ``delta=True`` the steps after the first
    move patches."""
    from vllm_harness import reference_outputs

    server, trainer = dense
    info = server.get("server_info?config_format=json")["vllm_config"]
    assert info["weight_transfer_config"]["backend"] == "streamsync"  # as WeightTransfer reads it
    transfer = WeightTransfer(server.url, delta=delta, bucket_bytes=256 << 10)
    transfer.init_weight_transfer()
    transfer.init_weight_transfer()  # TRL's train-begin callback may fire again: a no-op
    try:
        seen = [server.greedy_tokens()]
        for step in range(3):
            if delta:  # a small-learning-rate step: a few percent of the elements change
                gen = torch.Generator().manual_seed(100 + step)
                with torch.no_grad():
                    for param in trainer.parameters():
                        chosen = torch.rand(param.shape, generator=gen) < 0.03
                        param.add_(torch.where(chosen, torch.randn(param.shape, generator=gen), 0))
            else:
                perturb(trainer, seed=200 + step)
            want = reference_outputs(trainer).tokens
            transfer.pause()
            assert server.get("is_paused") == {"is_paused": True}
            transfer.send_weights(_trl_stream(trainer))
            transfer.resume()
            assert server.get("is_paused") == {"is_paused": False}
            assert server.greedy_tokens() == want, f"step {step}"
            report = transfer.last_report
            assert report is not None and report.complete
            # Every sync labels what the server generates: the sync's id by default.
            assert server.get("weight_info") == {"weight_version": str(report.sync_id)}
            n = len(list(trainer.parameters()))
            if delta:
                d = report.delta
                assert d is not None and (d.base is None) == (step == 0)
                assert d.unchanged + d.sparse + d.dense == n, d
                if step:
                    assert report.wire_bytes < report.nbytes / 2, report.summary()
            else:
                assert report.tensors == n
            seen.append(want)
        assert len({json.dumps(s) for s in seen}) > 1, "no step changed the greedy tokens"
    finally:
        transfer.destroy()
    transfer.destroy()  # TRL's finally after a failure: a no-op
    with pytest.raises(ss.ConfigError, match="not initialised"):
        transfer.send_weights(_trl_stream(trainer))


@pytest.mark.vllm
def test_staged_transfer_keeps_the_server_generating_in_trainers_order(
    trainer_module: Any, dense: tuple[Any, torch.nn.Module]
) -> None:
    """``WeightTransfer(staged=True)`` in the trainer's order (``pause`` → ``send_weights`` →
    ``resume``): the server is never paused by ``pause``, a request produces tokens while
    half of the version is staged, and after each step the server's outputs are the
    trainer's and its weight version is the sync's id."""
    from server_harness import Stream
    from vllm_harness import assert_matches, reference_outputs

    server, trainer = dense
    transfer = WeightTransfer(server.url, staged=True, bucket_bytes=256 << 10)
    transfer.init_weight_transfer()
    try:
        for step in range(2):
            perturb(trainer, seed=400 + step)
            seen: list[tuple[int, int]] = []

            def stream_waiting(
                stream: Stream, seen: list[tuple[int, int]]
            ) -> Iterator[tuple[str, torch.Tensor]]:
                items = list(_trl_stream(trainer))
                for i, item in enumerate(items):
                    if i == len(items) // 2:  # half staged: the server must still generate
                        seen.append(stream.more(3))
                    yield item

            with Stream(server) as stream:
                transfer.pause()
                assert server.get("is_paused") == {"is_paused": False}
                transfer.send_weights(stream_waiting(stream, seen))
                transfer.resume()
                assert not stream.done  # committed while the request was generating
            assert stream.error is None and seen[0][1] >= seen[0][0] + 3
            report = transfer.last_report
            assert report is not None and report.complete
            assert server.get("weight_info") == {"weight_version": str(report.sync_id)}
            assert_matches(server.outputs(), reference_outputs(trainer))
    finally:
        transfer.destroy()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("adapter_only", [False, True], ids=["full", "adapter-only"])
def test_async_grpo_trainer_end_to_end(
    trainer_module: Any, tmp_path: Path, adapter_only: bool
) -> None:
    """``examples/trl_async_grpo.py``: ``AsyncGRPOTrainer`` itself trains three steps
    against the real server, with the rollout worker sampling from it; every sync (train
    begin and each step) is followed by a check that the server's greedy tokens equal the
    trainer's weights (with ``--adapter-only``: the base plus the adapter, served under the
    adapter's versioned name, while only the adapter travelled)."""
    out = tmp_path / "checks.json"
    cmd = [sys.executable, str(ROOT / "examples" / "trl_async_grpo.py"), "--json", str(out)]
    # Its own process group: a run past the time limit is ended with its server and its
    # rollout process (within pytest's 600 s, so that nothing outlives the test).
    proc = subprocess.Popen(
        [*cmd, *(["--adapter-only"] if adapter_only else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the example ran past 540 s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]
    checks = json.loads(out.read_text())
    assert len(checks) == 4, checks  # one at train begin, one per step
    assert all(c["tokens_equal"] for c in checks), checks
    # Training moved the policy: the served tokens (each equal to the trainer's) changed.
    assert len({json.dumps(c["tokens"]) for c in checks}) > 1, checks
    if adapter_only:
        assert [c["served"] for c in checks] == [f"trl-policy-v{n}" for n in range(1, 5)]
        # max_staleness=1: the version two behind the new one is removed at each sync.
        assert checks[-1]["adapters"] == ["trl-policy-v2", "trl-policy-v3", "trl-policy-v4"]
        # Only the adapter's tensors travelled: A and B of 7 modules in each of 2 layers.
        assert {c["tensors"] for c in checks} == {2 * 7 * 2}, checks
    else:
        assert {c["tensors"] for c in checks} == {len(tiny_params())}, checks


def tiny_params() -> list[str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("dense"))
    return [name for name, _ in model.named_parameters()]
