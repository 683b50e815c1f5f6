"""``streamsync bench`` on a small model: the JSON's schema and every transport's bytes; and
the lab's scripts in ``benchmarks/`` (targets, verl's path, micro-benchmarks) beside it."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
import torch
from conftest import extra

import streamsync as ss
from streamsync.adapters import expand_moe
from streamsync.cli import main
from streamsync.cli.bench.models import parse_size, synthetic_model
from streamsync.cli.bench.scenarios import SCENARIOS, TRANSPORTS
from streamsync.cli.bench.stamped import StampedReceiver, StampedSender
from streamsync.testing import FakeConfig, fake_state_dict
from streamsync.testing.shapes import qwen3_shapes

#: The lab: scripts run by hand from the repository root, apart from the package.
LAB = Path(__file__).resolve().parent.parent / "benchmarks"


def _lab(name: str) -> ModuleType:
    """A script of ``benchmarks/``, imported as its command line finds its siblings."""
    if str(LAB) not in sys.path:
        sys.path.insert(0, str(LAB))
    return importlib.import_module(name)


def test_parse_size() -> None:
    assert parse_size("16MiB") == 16 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("512m") == 512 << 20
    assert parse_size("4096") == 4096


def test_synthetic_model_is_qwen_shaped_and_fits() -> None:
    for moe in (False, True):
        model = synthetic_model(16 << 20, moe=moe)
        assert 12 << 20 < model.nbytes <= 16 << 20
        layers = {n.split(".")[2] for n in model.shapes if n.startswith("model.layers.")}
        assert len(layers) >= 4
    moe_model = synthetic_model(16 << 20, moe=True)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in moe_model.shapes)
    assert moe_model.buffers  # the router's e_score_correction_bias
    expanded = moe_model.zeros(expanded=True)
    assert any(".experts.3.up_proj.weight" in n for n in expanded)
    assert sum(t.nbytes for t in expanded.values()) == moe_model.nbytes


async def test_expanded_layout_is_what_expand_moe_makes() -> None:
    """The bench's receiving layout for ``moe-chain`` (from the shape table) is exactly
    what the real ``expand_moe`` adapter makes of the packed model, tensor for tensor."""
    model = synthetic_model(4 << 20, moe=True)

    async def packed() -> Any:
        for item in model.weights().items():
            yield item

    made = [(n, t.clone()) async for n, t in expand_moe(when="always")(packed())]
    want = list(model.expected(expanded=True))
    assert [n for n, _ in made] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(made, want, strict=True))
    layout = model.layout(expanded=True)
    assert list(layout) == [n for n, _ in want]
    assert all(layout[n][0] == tuple(t.shape) for n, t in want)


def test_fakes_follow_the_shape_table() -> None:
    for cfg in (FakeConfig(), FakeConfig(num_experts=4), FakeConfig(tie_word_embeddings=True)):
        heads, kv_heads, head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        table = qwen3_shapes(
            vocab=cfg.vocab_size,
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            q_dim=heads * head_dim,
            kv_dim=kv_heads * head_dim,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            experts=cfg.num_experts,
            moe_intermediate=cfg.moe_intermediate_size,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
        made = fake_state_dict(cfg)
        assert [(n, tuple(t.shape)) for n, t in made.items()] == list(table)
    assert "lm_head.weight" not in fake_state_dict(FakeConfig(tie_word_embeddings=True))


async def test_stamped_wrappers_time_every_bucket_and_pass_the_rest_through() -> None:
    weights = {f"w{i}": torch.full((1024,), float(i)) for i in range(6)}
    targets = {n: torch.zeros_like(t) for n, t in weights.items()}
    url = "memory://bench-stamped"
    async with (
        ss.open_sender(url, slots=2, slot_bytes=8192) as opened_tx,
        ss.open_receiver(url) as opened_rx,
    ):
        tx, rx = StampedSender(opened_tx), StampedReceiver(opened_rx)
        assert (tx.receivers, tx.slot_bytes) == (opened_tx.receivers, opened_tx.slot_bytes)
        assert rx.index == opened_rx.index  # forwarded: not one of the wrapped methods
        got: dict[str, ss.SyncReport] = {}

        async def receive() -> None:
            got["rx"] = await ss.receive(rx, ss.ModuleSink(_module(targets)), timeout=30)

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            sent = await ss.send(weights, tx, bucket_bytes=8192, timeout=30)
    assert sent.buckets == 3 and not got["rx"].missing
    assert len(tx.published) == len(rx.arrived) == len(rx.released) == sent.buckets
    assert all(torch.equal(targets[n], t) for n, t in weights.items())


def _module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, tensor in tensors.items():
        module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    return module


def _result(transport: str, scenario: str, gbps: float, vs_bound: float, extra: int) -> Any:
    side = {"extra_bytes": extra}
    memory = {"budget_bytes": 100, "sender": side, "receiver": side}
    return {
        "transport": transport,
        "scenario": scenario,
        "ok": True,
        "gbps": gbps,
        "vs_bound": vs_bound,
        "memory": memory,
    }


def test_targets_are_one_table_evaluated_in_order() -> None:
    results = [
        {**_result("shm", "dense", 2.0, 0.9, 50), "vs_verl": 3.5},
        _result("shm", "dense-fp32-cast", 1.0, 0.5, 60),
        _result("shm", "moe", 2.0, 0.9, 50),
        _result("shm", "moe-chain", 1.9, 0.9, 120),
        _result("zmq+tcp", "dense", 1.0, 0.8, 10),
        _result("zmq+tcp", "dense-fp32-cast", 0.95, 0.8, 10),
        {"transport": "zmq+tcp", "scenario": "moe", "ok": False, "error": "boom"},
        _result("zmq+tcp", "moe-chain", 1.0, 0.8, 10),
        {
            **_result("shm", "small-tensors", 1.0, 0.3, 10),
            **{"seconds": 0.1, "bytes": 10**8, "tensors": 7512},
        },
        {
            **_result("shm", "large-tensors", 4.0, 0.9, 10),
            **{"seconds": 0.025, "bytes": 10**8, "tensors": 12},
        },
    ]
    lab = _lab("targets")
    got = lab.evaluate_targets(results)
    assert [(t["target"], t["value"], t["want"], t["met"]) for t in got] == [
        ("shm vs two memcpys at once", 0.9, ">= 0.8", True),
        ("shm vs verl's shared-memory path", 3.5, ">= 3.0", True),
        ("zmq+tcp vs raw pyzmq tcp", 0.8, ">= 0.9", False),
        ("shm: 16 KiB tensors vs 8 MiB tensors", 0.25, ">= 0.5", False),
        ("shm: fixed cost per tensor, both sides (us)", pytest.approx(10.0), "<= 5.0", False),
        ("shm: fp32 cast vs bf16", 0.5, ">= 0.9", False),
        ("shm: adapter chain vs none", 0.95, ">= 0.9", True),
        ("zmq+tcp: fp32 cast vs bf16", 0.95, ">= 0.9", True),
        # zmq+tcp's adapter chain has no baseline (its moe run failed): left out.
        ("peak extra memory vs ring + largest tensor", 1.2, "<= 1.0", False),
    ]
    assert got[5]["detail"] == "dense-fp32-cast / dense"
    assert lab.evaluate_targets([]) == []
    assert {t.metric for t in lab.TARGETS} == {
        "vs_bound",
        "vs_verl",
        "gbps_ratio",
        "per_tensor_us",
        "extra_memory",
    }


def test_a_negative_fixed_cost_per_tensor_is_noise_not_met() -> None:
    """Small tensors faster per byte than large ones fit a negative cost per tensor: not a
    figure that meets its target but one the runs cannot resolve, and the table says so."""
    lab = _lab("targets")
    results = [
        {
            **_result("shm", "small-tensors", 4.2, 0.9, 10),
            **{"seconds": 0.020, "bytes": 10**8, "tensors": 7512},
        },
        {
            **_result("shm", "large-tensors", 4.0, 0.9, 10),
            **{"seconds": 0.025, "bytes": 10**8, "tensors": 12},
        },
    ]
    (cost,) = [t for t in lab.evaluate_targets(results) if "fixed cost" in t["target"]]
    assert cost["value"] < 0
    assert cost["met"] is None and cost["verdict"] == "noise"
    row = next(r for r in lab.format_targets([cost]).splitlines() if "fixed cost" in r)
    assert "| noise: below what these runs resolve" in row and "| yes |" not in row


def test_every_target_says_what_it_means_for_a_user() -> None:
    lab = _lab("targets")
    assert all(len(t.meaning.split()) >= 10 for t in lab.TARGETS)
    results = [
        {**_result("shm", "dense", 2.0, 0.9, 50), "vs_verl": 3.5},
        _result("zmq+tcp", "dense", 1.0, 0.8, 10),
    ]
    got = lab.evaluate_targets(results)
    table = lab.format_targets(got).splitlines()
    assert table[0] == "| target | value | want | met | what it means |"
    assert [row.split(" | ")[-1] for row in table[2:]] == [f"{t['meaning']} |" for t in got]
    assert [row.split(" | ")[3] for row in table[2:]] == ["yes", "yes", "NO", "yes"]


def test_bench_refuses_options_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--runs", "0", "--transport", "memory"]) == 2
    assert "--runs must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)  # seven scenarios x four transports and the bounds
def test_bench_writes_json_and_every_transport_moves_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    here = [name for name, spec in TRANSPORTS.items() if spec.unavailable() is None]
    args = ["bench", "--size", "16MiB", "--runs", "1", "--json", str(out), "--plot", str(png)]
    for name in here:
        args += ["--transport", name]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| transport | scenario |" in printed
    data = json.loads(out.read_text())
    assert data["schema"] == "streamsync.cli.bench/1"
    assert {
        "date",
        "machine",
        "config",
        "models",
        "bounds",
        "results",
        "command",
    } <= set(data)
    assert {"memcpy", "two_copy_parallel"} <= set(data["bounds"])
    pair = data["bounds"]["two_copy_parallel"]  # both copies measured, the faster kept
    assert set(pair["by_copy"]) == {"memmove", "stream"}
    assert pair["gbps"] == max(g for samples in pair["by_copy"].values() for g in samples)
    assert "targets" not in data and "| target |" not in printed  # the lab's, not the user's
    lab = _lab("targets")
    targets = lab.evaluate_targets(data["results"])
    if "shm" in here:
        row = next(
            r for r in data["results"] if (r["transport"], r["scenario"]) == ("shm", "dense")
        )
        assert row["slots"] == 2  # shm's own default, what users get
        # The fused cast against its own bound, and what that bound allows of its target.
        cast = next(
            r
            for r in data["results"]
            if (r["transport"], r["scenario"]) == ("shm", "dense-fp32-cast")
        )
        assert cast["bound"] == "cast_split"
        assert "The fp32 cast's own bound (cast_split) is" in lab.format_targets(
            targets, data["bounds"]
        )
    assert all(b["gbps"] > 0 for b in data["bounds"].values())
    assert [(r["transport"], r["scenario"]) for r in data["results"]] == [
        (t, s) for t in here for s in SCENARIOS
    ]
    for r in data["results"]:
        assert r["ok"] and r["verified"], r
        model = data["models"][r["scenario"]]
        assert r["received_bytes"] == r["model_bytes"] == model["bytes"], r
        assert r["missing"] == 0
        # On the wire: the model, plus the buffer manifest where the chain declares one.
        assert r["bytes"] >= model["bytes"]
        if r["scenario"] in ("dense", "dense-fp32-cast", "moe"):
            assert r["bytes"] == model["bytes"]
        assert r["gbps"] > 0 and r["seconds"] > 0 and r["runs"] == 1
        assert set(r["phases_gbps"]) == {"pack", "transfer", "load"}
        assert {"sender.pack", "sender.wait", "receiver.load", "transfer"} <= set(r["phases_s"])
        assert r["bound_gbps"] == data["bounds"][r["bound"]]["gbps"]
        for side in ("sender", "receiver"):
            mem = r["memory"][side]
            assert mem["peak_rss"] >= mem["baseline_rss"] > 0
            # Shared libraries' pages come off the figure, never on: at most the whole RSS.
            assert mem["extra_bytes"] <= mem["extra_with_files_bytes"]
    assert data["models"]["dense-fp32-cast"]["source_bytes"] == 2 * data["models"]["dense"]["bytes"]
    assert {t["target"] for t in targets} >= {"peak extra memory vs ring + largest tensor"}
    assert png.stat().st_size > 0
    # The lab's command line on the JSON: the same targets, each with what it means.
    monkeypatch.setattr(sys, "argv", ["targets.py", str(out)])
    lab.main()
    printed = capsys.readouterr().out
    assert all(f"| {t['target']} ({t['detail']}) |" in printed for t in targets)
    assert all(f"| {t['meaning']} |" in printed for t in targets)


def test_bench_fan_out_refuses_options_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--transport", "torch+gloo"]) == 2
    assert "with --receivers N only" in capsys.readouterr().err
    assert main(["bench", "--receivers", "1", "--transport", "shm"]) == 2
    assert "runs over zmq+tcp, torch+gloo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--receivers", "0,2"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_fan_out_to_two_receivers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fanout.json"
    args = ["bench", "--receivers", "1,2", "--size", "4MiB", "--runs", "1"]
    assert main([*args, "--bucket-bytes", "1MiB", "--json", str(out)]) == 0
    assert "raw gloo s" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["schema"] == "streamsync.cli.bench.fanout/1"
    rows = {(r["receivers"], r["transport"]): r for r in data["rows"]}
    assert set(rows) == {(n, t) for n in (1, 2) for t in ("zmq+tcp", "torch+gloo")}
    for row in rows.values():
        assert row["ok"] and row["verified"], row
        assert row["sender_s_per_sync"] > 0 and row["raw_gloo_s"] > 0, row


def test_uniform_model_is_tensors_of_one_size() -> None:
    from streamsync.cli.bench.models import uniform_model

    model = uniform_model(1 << 20, 16 << 10)
    assert len(model.shapes) == 64
    assert {math.prod(s) * d.itemsize for s, d in model.shapes.values()} == {16 << 10}
    assert SCENARIOS["small-tensors"].model(1 << 20).nbytes == model.nbytes
    assert len(SCENARIOS["large-tensors"].model(64 << 20).shapes) == 8


def test_the_table_says_which_thread_setting_ran() -> None:
    from streamsync.cli.bench.report import format_table

    data: dict[str, Any] = {
        "config": {"size": 1 << 20, "bucket_bytes": 1 << 20, "slots": 2, "runs": 1},
        "machine": {"cpus": 2, "torch": "x", "torch_threads": 2},
        "results": [],
        "bounds": {},
        "targets": [],
    }
    data["config"]["threads"] = None
    assert "torch's default thread count (2) in every process" in format_table(data)
    data["config"]["threads"] = 1
    assert "torch.set_num_threads(1)" in format_table(data)


def test_the_table_says_which_slots_ran() -> None:
    from streamsync.cli.bench.report import _slots

    data: dict[str, Any] = {"config": {"slots": 4}, "results": []}
    assert _slots(data) == "4 slots"
    data["config"]["slots"] = None
    data["results"] = [{"transport": "shm", "slots": 3}, {"transport": "zmq+tcp", "slots": 2}]
    assert _slots(data) == "each transport's default slots (shm 3, zmq+tcp 2)"
    data["results"] = [{"transport": "shm", "slots": 3}]
    assert _slots(data) == "3 slots (the transports' default)"


def test_the_table_says_what_the_casts_own_bound_allows_of_its_target() -> None:
    cast_ceiling = _lab("targets").cast_ceiling

    assert cast_ceiling({"two_copy_parallel": {"gbps": 10.0}}) == []
    bounds = {"two_copy_parallel": {"gbps": 10.0}, "cast_split": {"gbps": 6.8}}
    (line,) = [x for x in cast_ceiling(bounds) if x]
    assert "is 0.68 of two memcpys at once" in line
    assert "at the 0.80 of them it is asked for" in line
    assert "at most 0.85 of bf16" in line and "(its target: 0.90)" in line


def test_the_bench_runs_each_transport_with_its_own_default_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dataclasses import replace

    from streamsync.cli.bench.scenarios import TRANSPORTS, TransportSpec
    from streamsync.transports import Transport, _registry
    from streamsync.transports.memory import TRANSPORT as MEMORY
    from streamsync.transports.options import SENDER_OPTIONS

    five = tuple(replace(o, default=5) if o.name == "slots" else o for o in SENDER_OPTIONS)
    # Registered for this test only (``register`` would keep it for the whole session).
    transport = Transport(MEMORY.sender, MEMORY.receiver, sender_options=five)
    monkeypatch.setitem(_registry._loaded, "bench-five", transport)
    spec = TransportSpec("bench-five", lambda tag: f"bench-five://{tag}", "memcpy")
    assert spec.slots(None) == 5 and spec.slots(3) == 3
    assert TRANSPORTS["shm"].slots(None) == 2 and TRANSPORTS["shm"].slots(4) == 4


def test_the_engine_table_gives_the_ratio_and_the_phases() -> None:
    from streamsync.cli.bench.engine import format_engine_table

    row = {
        "bucket_bytes": 64 << 20,
        "wire": "bf16",
        "buckets": 13,
        "reload_median_s": 0.5,
        "update_median_s": 0.6,
        "ratio": 1.2,
        "update_gbps": 1.4,
        "phases_s": {"wait": 0.1, "pack": 0.2, "publish": 0.01, "end": 0.05},
    }
    engine = {"model": "dense-400m", "engine_bytes": 800 << 20, "build_seconds": 3.0, "runs": 3}
    table = format_engine_table({**engine, "rows": [row]})
    assert (
        "| 64 MiB | bf16 | 13 | 0.500 | 0.600 | 1.20 | 1.40 | 0.100 | 0.200 | 0.010 | 0.050 |"
        in table
    )


def test_the_recorded_command_line_names_the_vllm_and_thread_options() -> None:
    import argparse

    from streamsync.cli.bench.command import _command_line

    args = argparse.Namespace(
        size=1 << 30,
        transport=None,
        scenario=None,
        runs=3,
        bucket_bytes=64 << 20,
        slots=2,
        threads=None,
        receivers=None,
        delta=False,
        steps=5,
        vllm=True,
        vllm_only=False,
        vllm_bucket_bytes=[16 << 20],
        json=None,
        plot=None,
    )
    line = _command_line(args)
    assert "--vllm --vllm-bucket-bytes 16777216" in line and "--threads" not in line
    assert "--slots 2" in line
    args.slots = None
    assert "--slots" not in _command_line(args)
    args.sharded, args.engines = True, 2
    assert "--sharded --engines 2" in _command_line(args)
    args.sharded, args.staged = False, True
    assert "--staged --runs 3" in _command_line(args)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_delta_against_dense(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--delta``: a trained model, every receiver verified bit-exact, and deltas that
    move a fraction of the dense wire bytes."""
    out = tmp_path / "delta.json"
    args = ["bench", "--delta", "--size", "8MiB", "--steps", "2", "--receivers", "1"]
    assert (
        main([*args, "--bucket-bytes", "1MiB", "--transport", "zmq+tcp", "--json", str(out)]) == 0
    )
    table = capsys.readouterr().out
    assert "scan GB/s" in table and "  2/2 " in table
    data = json.loads(out.read_text())
    assert data["schema"] == "streamsync.cli.bench.delta/1"
    assert {(r["lr"], r["transport"]) for r in data["rows"]} == {
        (1e-6, "zmq+tcp"),
        (1e-5, "zmq+tcp"),
    }
    for row in data["rows"]:
        assert row["verified"], row
        first, *steady = row["steps"]
        assert first["full_reason"] is not None
        for step in steady:
            assert step["full_reason"] is None and step["base"] is not None
            assert 0 < step["changed_fraction"] < 0.5
            assert step["delta_wire_bytes"] < step["dense_wire_bytes"]


def test_the_fp8_stack_is_float8_weights_each_with_its_fp32_scales() -> None:
    from streamsync.cli.bench.models import fp8_model

    model = SCENARIOS["fp8-layers"].model(8 << 20)
    assert model.nbytes <= 8 << 20 and model == fp8_model(8 << 20)
    weights = {n: v for n, v in model.shapes.items() if n.endswith(".weight")}
    scales = {n: v for n, v in model.shapes.items() if n.endswith(".weight_scale_inv")}
    assert len(weights) == len(scales) >= 30
    for name, (shape, dtype) in weights.items():
        assert dtype == torch.float8_e4m3fn
        scale_shape, scale_dtype = scales[f"{name}_scale_inv"]
        assert scale_dtype == torch.float32 and model.buffers >= {f"{name}_scale_inv"}
        assert scale_shape == tuple(-(-d // 128) for d in shape)
    made = model.weights(SCENARIOS["fp8-layers"].source_dtype)
    assert {t.dtype for t in made.values()} == {torch.float8_e4m3fn, torch.float32}


def test_the_lora_table_gives_both_ratios_against_their_targets() -> None:
    from streamsync.cli.bench.lora import format_lora_table

    data = {
        "model": "dense-400m",
        "rank": 8,
        "runs": 3,
        "full_bytes": 800 << 20,
        "adapter_bytes": 10 << 20,
        "adapter_tensors": 224,
        "full_median_s": 1.0,
        "adapter_median_s": 0.2,
        "bytes_ratio": 10 / 800,
        "seconds_ratio": 0.2,
        "targets": {"bytes": 1 / 20, "seconds": 1 / 10},
    }
    table = format_lora_table(data)
    assert "bytes adapter/full: 0.0125 (target <= 0.05: met)" in table
    assert "seconds adapter/full: 0.2000 (target <= 0.10: MISSED)" in table
    # Each in words: what the ratio means for a user.
    assert "met): the adapter's sync moves 1.2% of a full sync's bytes" in table
    assert "MISSED): the adapter's sync takes 20.0% of a full sync's time" in table


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_lora_bench_syncs_an_adapter_and_the_full_model_into_vllm() -> None:
    from streamsync.cli.bench.lora import run_lora_bench

    data = run_lora_bench(rank=8, runs=1, timeout=120, kind="dense")
    assert data["adapter_tensors"] == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    # fp32 on the wire: rank 8 over hidden 128 / MLP 256 / kv 64 in both layers.
    per_layer = 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 256) * 3)
    assert data["adapter_bytes"] == 2 * per_layer * 4
    assert data["full_bytes"] > 10 * data["adapter_bytes"]
    assert len(data["full_s"]) == len(data["adapter_s"]) == 1


def test_the_ray_table_gives_the_ratio_against_its_target() -> None:
    from streamsync.cli.bench.ray import format_ray_table

    data = {
        "model": "dense-400m",
        "runs": 3,
        "bytes": 800 << 20,
        "in_process_s": [1.0, 1.2, 1.1],
        "actor_s": [1.3, 1.2, 1.25],
        "in_process_median_s": 1.1,
        "actor_median_s": 1.25,
        "ratio": 1.25 / 1.1,
        "target": 1.1,
        "verified": True,
    }
    table = format_ray_table(data)
    assert "| in a Ray actor | 1.250 | 1.200-1.300 |" in table
    assert (
        "actor / in-process: 1.14 (target <= 1.1: MISSED); both engines answer alike: yes" in table
    )


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ray_bench_syncs_an_actor_and_an_engine_here_alike() -> None:
    extra("ray", "ray")
    from streamsync.cli.bench.ray import run_ray_bench

    data = run_ray_bench(runs=1, timeout=120, kind="dense")
    assert data["verified"], "the actor's engine and this process's answer alike"
    assert len(data["in_process_s"]) == len(data["actor_s"]) == 1
    assert data["ratio"] == data["actor_median_s"] / data["in_process_median_s"] > 0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_vllm_bench_runs_both_wires_against_the_reload_in_an_engine_of_its_own(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "streamsync", "bench", "--vllm-only", "--runs", "1"]
    done = subprocess.run(
        [*command, "--vllm-bucket-bytes", "64MiB", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    engine = json.loads(out.read_text())["engine"]
    # vLLM's default: the engine core, and the worker with it, in a process of its own.
    assert engine["engine_core"] == "own process"
    rows = {row["wire"]: row for row in engine["rows"]}
    assert list(rows) == ["fp32", "bf16"]
    for row in rows.values():
        assert len(row["reload_s"]) == len(row["update_s"]) == 1
        assert row["ratio"] == row["update_s"][0] / row["reload_s"][0]
    # The cast doubles the bytes on the wire: twice the buckets of 64 MiB.
    assert rows["fp32"]["wire_bytes"] == 2 * rows["bf16"]["wire_bytes"]
    assert "| 64 MiB | bf16 | 7 |" in done.stdout and "engine core in own process" in done.stdout


def test_the_per_tensor_bench_times_every_step_of_both_sides() -> None:
    per_tensor = _lab("per_tensor")
    format_per_tensor, run_per_tensor = per_tensor.format_per_tensor, per_tensor.run_per_tensor

    data = run_per_tensor(count=200, tensor_bytes=4 << 10, runs=2)
    steps = data["steps_us"]
    assert list(steps) == [
        "source + bucketer",
        "pack into the slot",
        "header encode",
        "header decode",
        "unpack",
        "ModuleSink",
    ]
    assert all(us > 0 for us in steps.values())
    assert data["send_us"] == pytest.approx(sum(list(steps.values())[:3]))
    assert data["receive_us"] == pytest.approx(sum(list(steps.values())[3:]))
    table = format_per_tensor(data)
    assert "| **sending side** |" in table and "200 bf16 tensors of 4096 bytes" in table


def test_the_cast_bound_measures_both_copies_in_every_round(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cast_bound = _lab("cast_bound")

    got = cast_bound.measure(1 << 20, 1)
    assert all(0 < value < float("inf") for value in got.values()), got
    monkeypatch.setattr(sys, "argv", ["cast_bound", "--mib", "1", "--rounds", "2", "--repeat", "1"])
    cast_bound.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["1", "2"]


def test_the_copy_placement_times_both_copies_at_every_distance(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    copy_placement = _lab("copy_placement")

    got = copy_placement.measure(1 << 20)
    assert set(got) == {"glibc", "library"}
    for by_distance in got.values():
        assert list(by_distance) == list(copy_placement.DISTANCES)
        assert all(0 < gbps < float("inf") for gbps in by_distance.values()), by_distance
    monkeypatch.setattr(sys, "argv", ["copy_placement", "--mib", "1", "--rounds", "2"])
    copy_placement.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    cells = [(row.split("|")[1].strip(), row.split("|")[2].strip()) for row in rows[1:]]
    assert cells == [("1", "glibc"), ("1", "library"), ("2", "glibc"), ("2", "library")]


@pytest.mark.slow
def test_the_source_forms_time_each_form_in_every_round(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source_forms = _lab("source_forms")

    got = source_forms.measure(64, 4096, 2)  # raises if the receiver's model differs
    assert list(got) == list(source_forms.FORMS)
    assert all(len(taken) == 2 and all(s > 0 for s in taken) for taken in got.values()), got
    monkeypatch.setattr(sys, "argv", ["source_forms", "--count", "16", "--rounds", "1"])
    source_forms.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(source_forms.FORMS)
    # Past five rounds (a tiny model's fixed cost per sync), each form is a range.
    monkeypatch.setattr(sys, "argv", ["source_forms", "--count", "1", "--rounds", "6"])
    source_forms.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(source_forms.FORMS)
    for row in rows:
        low, mid, high = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert 0 < low <= mid <= high, row


def test_capacity_model_takes_the_busiest_nic(capsys: pytest.CaptureFixture[str]) -> None:
    """``python benchmarks/capacity.py``: today every worker takes the whole model, sharded
    sends one copy per engine over M NICs, a delta w of it; a sync takes the busiest NIC's
    bytes, sender or engine side."""
    capacity = _lab("capacity")
    llama, kimi = capacity.MODELS
    rate = 45e9
    modes = {m.name: m for m in capacity.modes((8, 64), 0.065, 8)}
    today, sharded = modes["full fan-out, 1 NIC (today)"], modes["sharded, M = 64"]
    assert capacity.seconds(today, llama, 8, rate) == pytest.approx(8 * 8 * 140e9 / rate)
    assert sharded.sender(llama.nbytes, 512) == pytest.approx(512 * 140e9 / 64)
    assert capacity.seconds(sharded, llama, 8, rate) == pytest.approx(140e9 / 8 / rate)
    delta, dense = modes["sharded + delta, M = 8"], modes["sharded, M = 8"]
    assert capacity.seconds(delta, kimi, 64, rate) == pytest.approx(
        0.065 * capacity.seconds(dense, kimi, 64, rate)
    )
    # One NIC per engine node: it takes the whole model, more than a sender NIC sends.
    one_nic = {m.name: m for m in capacity.modes((64,), 0.065, 1)}["sharded, M = 64"]
    assert capacity.seconds(one_nic, llama, 8, rate) == pytest.approx(140e9 / rate)
    capacity.main([])
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("| 70B bf16 → ", "| 1T FP8 → "))]
    assert len(rows) == len(capacity.MODELS) * len(capacity.ENGINES)
    assert all(row.count(" | ") == len(modes) for row in rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shm_against_verls_path_in_one_run(tmp_path: Path) -> None:
    """``python benchmarks/baseline_verl.py``: verl's path ran, moved the model and checked it,
    among the bench's bounds, with shm's ratio to it and the targets on it."""
    out = tmp_path / "verl.json"
    command = [sys.executable, str(LAB / "baseline_verl.py"), "--size", "16MiB", "--runs", "1"]
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text())
    verl = data["bounds"]["verl_shm"]
    assert verl["gbps"] > 0 and verl["bucket_bytes"] == 64 << 20
    (row,) = data["results"]
    assert (row["transport"], row["scenario"]) == ("shm", "dense") and row["verified"]
    assert row["vs_verl"] == row["gbps"] / verl["gbps"]
    assert "| verl_shm |" in done.stdout and "| shm vs verl's shared-memory path" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in LAB.glob("*.py")))
def test_every_lab_script_runs_from_the_repository_root(script: str) -> None:
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"],
        cwd=LAB.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-4000:]


def test_the_package_leaves_the_lab_out() -> None:
    """The bench a user runs imports nothing of ``benchmarks/``; its command has no lab
    options left."""
    package = Path(ss.__file__).parent / "cli" / "bench"
    lab = {p.stem for p in LAB.glob("*.py")}
    assert not lab & {p.stem for p in package.glob("*.py")}
    for source in package.glob("*.py"):
        text = source.read_text()
        assert not any(f"import {n}" in text or f"bench.{n}" in text for n in lab), source
    with pytest.raises(SystemExit):
        main(["bench", "--per-tensor"])


def _needs(instance: str, boxes: dict[str, Any]) -> Any:
    """One model instance's needs: per name, ``(shape, box or None)``."""
    from streamsync.facts import Box, Need, Needs

    return Needs(
        instance=instance,
        layout=instance,
        needs=tuple(
            Need(name, shape, "bfloat16", None if box is None else Box(*box))
            for name, (shape, box) in boxes.items()
        ),
    )


def test_the_sharded_bound_splits_what_each_worker_reads_in_part() -> None:
    """``bench --sharded``'s bound: replicated are the tensors every worker reads whole; a
    tensor one worker reads whole and another in part is split, and a drafter that reads a
    split tensor whole makes it whole for its worker."""
    from streamsync.cli.bench.sharded import bound_of

    q, norm, emb = ((8, 4), None), ((4,), None), ((16, 4), None)
    halves = [((0, 0), (4, 4)), ((4, 0), (8, 4))]
    needs = {
        f"worker{w}.main": _needs(
            f"w{w}",
            {
                "q": (q[0], halves[w]),
                "norm": norm,
                "emb": emb if w else ((16, 4), ((0, 0), (8, 4))),
            },
        )
        for w in (0, 1)
    }
    sizes = {"q": 64, "norm": 8, "emb": 128}
    bound = bound_of(needs, sizes, 2)
    assert (bound.model_bytes, bound.replicated_bytes) == (200, 8)
    assert bound.worker_bytes == (200 - 8) // 2 + 8
    # A drafter on worker 1 reading q whole: no longer split on worker 1, still not
    # replicated (worker 0 reads half of it).
    needs["worker1.drafter"] = _needs("d1", {"q": q})
    assert bound_of(needs, sizes, 2).replicated_bytes == 8
    needs["worker0.drafter"] = _needs("d0", {"q": q})
    assert bound_of(needs, sizes, 2).replicated_bytes == 8 + 64


def _sharded_rows() -> list[dict[str, Any]]:
    mib = 1 << 20
    row = {
        "transport": "zmq+tcp",
        "bound_bytes": 193 * mib,
        "replicated_bytes": 74 << 10,
        "phases_s": {"end": 0.25},
    }
    return [
        {
            **row,
            "mode": "full",
            "seconds": [1.2, 1.0, 1.1],
            "max_worker_bytes": 386 * mib,
            "all_workers_bytes": 772 * mib,
            "rank_bytes": 386 * mib,
            "verified": None,
        },
        {
            **row,
            "mode": "sharded",
            "seconds": [0.5, 0.6, 0.55],
            "max_worker_bytes": 193 * mib,
            "all_workers_bytes": 386 * mib,
            "rank_bytes": 386 * mib,
            "verified": True,
        },
        {
            **row,
            "mode": "sharded+delta",
            "seconds": [0.3, 0.3, 0.3],
            "max_worker_bytes": 19 * mib + mib // 2,
            "all_workers_bytes": 39 * mib,
            "rank_bytes": 39 * mib,
            "verified": False,
            "changed_fraction": [0.05, 0.0625],
        },
    ]


def test_the_sharded_table_gives_ranges_bytes_and_both_verdicts() -> None:
    from streamsync.cli.bench.sharded import format_sharded

    data = {
        "model": "dense-400m",
        "model_bytes": 386 << 20,
        "engines": 2,
        "tp": 2,
        "runs": 3,
        "lr": 1e-5,
        "targets": {"bytes": 1.05, "seconds": 0.6},
        "rows": _sharded_rows(),
    }
    table = format_sharded(data)
    assert "into 2 TP=2 CPU vLLM engines: dense-400m" in table and "(74 KiB replicated)" in table
    assert (
        "| zmq+tcp | full | 1.000-1.200 | 0.250 | 386.0 | 772.0 | 386.0 | 193.0 | 2.000 "
        "| reference |" in table
    )
    assert (
        "| zmq+tcp | sharded | 0.500-0.600 | 0.250 | 193.0 | 386.0 | 386.0 | 193.0 | 1.000 | yes |"
        in table
    )
    assert (
        "| zmq+tcp | sharded+delta | 0.300 | 0.250 | 19.5 | 39.0 | 39.0 | 193.0 | 0.101 | NO |"
        in table
    )
    assert "changed: 5.00%-6.25%" in table
    assert (
        "zmq+tcp: bytes per worker / bound 1.000 (target <= 1.05: met); seconds sharded / "
        "full 0.50 (medians; target <= 0.60: met)" in table
    )
    data["rows"][1]["seconds"] = [0.9]
    assert "full 0.82 (medians; target <= 0.60: MISSED)" in format_sharded(data)


def test_bench_sharded_refuses_options_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--sharded", "--transport", "shm"]) == 2
    assert main(["bench", "--sharded", "--runs", "0"]) == 2
    assert "runs over zmq+tcp, torch+gloo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--sharded", "--engines", "3"])


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_sharded_bench_sends_each_worker_half_into_a_tp2_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from streamsync.cli.bench.sharded import ShardedConfig, format_sharded, run_sharded_bench

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    config = ShardedConfig(kind="dense", runs=1, transports=("zmq+tcp",))
    data = run_sharded_bench(config)
    rows = {row["mode"]: row for row in data["rows"]}
    assert list(rows) == ["full", "sharded", "sharded+delta"]
    assert all(len(row["seconds"]) == 1 for row in rows.values()), rows
    full, sharded, delta = rows.values()
    assert full["verified"] is None and sharded["verified"] and delta["verified"]
    # The tiny model: k/v (one kv head) and the norms replicated, the rest split in two.
    assert sharded["max_worker_bytes"] == sharded["bound_bytes"] < full["max_worker_bytes"]
    assert full["max_worker_bytes"] == full["rank_bytes"] == data["model_bytes"]
    assert sharded["rank_bytes"] == data["model_bytes"] + sharded["replicated_bytes"] > 0
    assert 0 < delta["max_worker_bytes"] < sharded["max_worker_bytes"]
    assert not sharded["unsliced"]
    assert "| zmq+tcp | sharded |" in format_sharded(data)


def test_a_sync_window_gives_the_longest_gap_the_steady_gap_and_its_tokens() -> None:
    """``bench --staged``'s figures of one window: the longest gap between a request's
    consecutive outputs that overlaps it, the median gap before it (the later half), the
    tokens produced inside it, and whether every request outlasted it."""
    from streamsync.cli.bench.staged import window_figures

    steady = [(0.1 * i, i) for i in range(1, 11)]  # outputs every 0.1 s up to 1.0
    one = [*steady, (1.5, 11), (1.6, 12), (2.4, 13), (2.5, 14)]
    other = [*steady, (1.55, 12), (2.45, 14)]  # two tokens an output
    got = window_figures([one, other], 1.05, 2.3)
    assert got["pause_s"] == pytest.approx(0.9)  # 1.55 -> 2.45, across the window's end
    assert got["steady_gap_s"] == pytest.approx(0.1)
    assert got["tokens"] == (12 - 10) + (12 - 10)
    assert got["outlasted"]
    assert not window_figures([one, steady], 1.05, 2.3)["outlasted"]  # ended at 1.0


def _staged_data() -> dict[str, Any]:
    def run(mode: str, seconds: float, pause: float, tokens: int, **more: Any) -> dict[str, Any]:
        return {
            "mode": mode,
            "seconds": seconds,
            "pause_s": pause,
            "steady_gap_s": 0.05,
            "tokens": tokens,
            "outlasted": True,
            **more,
        }

    return {
        "schema": "streamsync.cli.bench.staged/1",
        "model": "dense-400m",
        "model_bytes": 400 << 20,
        "runs": 3,
        "requests": 2,
        "max_tokens": 500,
        "target": 0.25,
        "h2d_gbps": 25.0,
        "rows": {
            "plain": [run("plain", s, s, 2) for s in (1.0, 1.2, 1.1)],
            "staged": [
                run("staged", 1.5, 0.20, 40, commit_s=0.15, apply_s=0.12, stage_s=1.35),
                run("staged", 1.6, 0.25, 44, commit_s=0.16, apply_s=0.13, stage_s=1.44),
                run("staged", 1.4, 0.22, 38, commit_s=0.14, apply_s=0.11, stage_s=1.26),
            ],
        },
    }


def test_the_staged_table_gives_medians_ranges_the_verdict_and_the_projection() -> None:
    from streamsync.cli.bench.staged import SCHEMA, format_staged

    data = _staged_data()
    assert data["schema"] == SCHEMA
    json.loads(json.dumps(data))  # plain data
    table = format_staged(data)
    assert "into one CPU vLLM AsyncLLM" in table and "(400.0 MiB per sync)" in table
    assert (
        "| plain | 1.100 (1.000-1.200) | - | - | 1.100 (1.000-1.200) | 0.050 | 2 | yes |" in table
    )
    assert (
        "| staged | 1.500 (1.400-1.600) | 0.150 (0.140-0.160) | 0.120 (0.110-0.130) "
        "| 0.220 (0.200-0.250) | 0.050 | 40 (38-44) | yes |" in table
    )
    assert "pause staged / plain 0.20 (medians: 0.220 s / 1.100 s; target <= 0.25: met)" in table
    # 400 MiB / 25 GB/s = 0.017 s, + 0.220 - 0.120 s (the workers' apply) of overhead.
    assert "25 GB/s H2D (an assumption, not measured) = 0.017 s" in table
    assert "overhead measured here 0.100 s" in table
    assert "the workers' apply, 3.50 GB/s) = 0.117 s" in table
    assert "WARNING" not in table and "below zero" not in table
    # Without the workers' apply: the commit's seconds stand for the copy.
    for r in data["rows"]["staged"]:
        del r["apply_s"]
    table = format_staged(data)
    assert "| 0.150 (0.140-0.160) | - | 0.220" in table
    assert "overhead measured here 0.070 s" in table
    assert "the commit's seconds, 2.80 GB/s) = 0.087 s" in table
    for r in data["rows"]["staged"]:
        r["commit_s"] = 0.3
    table = format_staged(data)
    assert "overhead measured here -0.080 s" in table
    assert "below zero: 0 is projected) = 0.017 s" in table
    for r in data["rows"]["staged"]:
        r["pause_s"] = 0.5
    data["rows"]["plain"][0]["outlasted"] = False
    table = format_staged(data)
    assert "target <= 0.25: MISSED" in table and "| NO (1 runs) |" in table
    assert "WARNING: some requests ended before the sync did (plain)" in table


def test_bench_staged_refuses_runs_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--staged", "--runs", "0"]) == 2
    assert "--staged: runs with --runs 1 or more" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_staged_bench_keeps_requests_generating_while_a_version_stages() -> None:
    """One run of each on the tiny model: every figure there, requests that outlasted each
    sync, and tokens produced while the staged sync's version landed."""
    from streamsync.cli.bench.staged import StagedConfig, format_staged, run_staged_bench

    data = run_staged_bench(StagedConfig(kind="dense", runs=1))
    assert data["schema"] == "streamsync.cli.bench.staged/1"
    plain, staged = data["rows"]["plain"], data["rows"]["staged"]
    assert len(plain) == len(staged) == 1
    assert all(r["outlasted"] for r in plain + staged)
    assert 0 < staged[0]["apply_s"] < staged[0]["commit_s"] < staged[0]["seconds"]
    assert all(r["pause_s"] > 0 and r["steady_gap_s"] > 0 for r in plain + staged)
    assert staged[0]["tokens"] > 0
    json.loads(json.dumps(data))
    assert "| staged |" in format_staged(data)
