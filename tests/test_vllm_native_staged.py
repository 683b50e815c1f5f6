"""Staged syncs through vLLM's own API: ``StreamsyncInitInfo(staged=True)`` against the real
OpenAI-compatible server, driven over HTTP by vLLM's ``HTTPVLLMWeightSyncClient``. The
server keeps generating while a version is staged; the commit pauses it only for the apply
and sets its weight version; a staging that fails leaves it serving bit-identical
outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_harness import ROOT, Server, Stream, start_server, stop_server, trainer_engine
from test_vllm_native import DYING_TRAINER
from vllm_harness import assert_matches, reference_outputs

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, torch.nn.Module]]:
    tmp = tmp_path_factory.mktemp("native-staged")
    trainer = build_tiny_model(tmp / "model", "dense", seed=0)
    server = start_server(tmp / "model", tmp)
    yield server, trainer
    stop_server(server)


def waiting(
    trainer: torch.nn.Module, stream: Stream, seen: list[tuple[int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's tensors; half-way through, with half of the version staged, the stream
    must produce 3 more chunks (a server paused for the sync would fail this)."""
    items = list(trainer.state_dict().items())
    for i, item in enumerate(items):
        if i == len(items) // 2:
            seen.append(stream.more(3))
        yield item


def test_server_generates_while_staging_and_commits_the_trainers_weights(
    dense: tuple[Server, torch.nn.Module],
) -> None:
    server, trainer = dense
    engine = trainer_engine(server, None, bucket_bytes=256 << 10, staged=True)
    try:
        for step in range(3):
            perturb(trainer, seed=300 + step)
            seen: list[tuple[int, int]] = []
            with Stream(server) as stream:
                engine.send_weights(waiting(trainer, stream, seen), weight_version=f"s{step}")
                at_commit = stream.chunks
                assert not stream.done  # committed while the request was generating
            assert stream.error is None and stream.chunks >= at_commit
            before, during = seen[0]
            assert during >= before + 3
            assert server.get("is_paused") == {"is_paused": False}
            assert server.get("weight_info") == {"weight_version": f"s{step}"}
            assert_matches(server.outputs(), reference_outputs(trainer))
            report = engine.last_report
            assert report is not None and report.complete
        perturb(trainer, seed=310)
        engine.send_weights(dict(trainer.state_dict()))  # the version: the sync's id
        assert engine.last_report is not None
        version = str(engine.last_report.sync_id)
        assert server.get("weight_info") == {"weight_version": version}
        assert_matches(server.outputs(), reference_outputs(trainer))
    finally:
        engine.shutdown()


def test_a_failed_staging_leaves_the_server_serving_bit_identical(
    dense: tuple[Server, torch.nn.Module], tmp_path: Path
) -> None:
    """A bad tensor name, then a trainer process that dies half-way through the staging:
    each leaves the server's outputs bit-identical and its weight version as it was; then
    a staged sync from a new trainer brings it to the trainer's weights."""
    server, trainer = dense
    engine = trainer_engine(server, None, bucket_bytes=256 << 10, staged=True, timeout=30)
    try:
        perturb(trainer, seed=320)
        engine.send_weights(dict(trainer.state_dict()), weight_version="good")
        before = server.outputs()
        perturb(trainer, seed=321)
        bad = {**trainer.state_dict(), "model.no_such.weight": torch.zeros(2)}
        with pytest.raises(ss.UnknownTensorError, match=r"'model\.no_such\.weight'"):
            engine.send_weights(bad, weight_version="bad")
        assert server.outputs() == before  # bit-identical tokens and logprobs
        assert server.get("weight_info") == {"weight_version": "good"}
        assert server.get("is_paused") == {"is_paused": False}
    finally:
        engine.shutdown()

    script = tmp_path / "dying_trainer.py"
    staged = DYING_TRAINER.replace("timeout=30)", "timeout=30, staged=True)")
    assert staged != DYING_TRAINER
    script.write_text(staged)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    dead = subprocess.run(
        [sys.executable, str(script), server.url, server.model], env=env, timeout=600
    )
    assert dead.returncode == 3
    assert server.outputs() == before
    assert server.get("weight_info") == {"weight_version": "good"}

    engine = trainer_engine(server, None, bucket_bytes=256 << 10, staged=True, timeout=30)
    try:
        engine.send_weights(dict(trainer.state_dict()), weight_version="next")
        assert server.get("weight_info") == {"weight_version": "next"}
        assert_matches(server.outputs(), reference_outputs(trainer))
    finally:
        engine.shutdown()


def test_two_call_form_stages_then_commits_at_the_callers_step(
    dense: tuple[Server, torch.nn.Module],
) -> None:
    """``stage_weights`` returns with the server still serving the old weights;
    ``commit_weights`` applies them; ``drop_weights`` frees a version never served."""
    server, trainer = dense
    engine = trainer_engine(server, None, bucket_bytes=256 << 10)
    try:
        perturb(trainer, seed=330)
        engine.send_weights(dict(trainer.state_dict()), weight_version="plain")
        before = server.outputs()
        perturb(trainer, seed=331)
        engine.stage_weights(dict(trainer.state_dict()))
        assert server.outputs() == before  # staged, not served
        engine.drop_weights()
        with pytest.raises(ss.ConfigError, match="nothing is staged"):
            engine.commit_weights("never")
        assert server.outputs() == before
        staged = engine.stage_weights(dict(trainer.state_dict()))
        assert staged is not None
        engine.commit_weights(mode="wait")
        assert server.get("weight_info") == {"weight_version": str(staged.sync_id)}
        assert_matches(server.outputs(), reference_outputs(trainer))
    finally:
        engine.shutdown()
