"""``streamsync bench`` on a small model: the JSON's schema and every transport's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamsync.bench import SCENARIOS, TRANSPORTS, parse_size, synthetic_model
from streamsync.cli import main


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_writes_json_and_every_transport_moves_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    here = [name for name, spec in TRANSPORTS.items() if spec.unavailable() is None]
    args = ["bench", "--size", "16MiB", "--runs", "1", "--json", str(out), "--plot", str(png)]
    for name in here:
        args += ["--transport", name]
    assert main(args) == 0
    assert "| transport | scenario |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["schema"] == "streamsync.bench/1"
    assert {
        "date",
        "machine",
        "config",
        "models",
        "bounds",
        "results",
        "targets",
        "command",
    } <= set(data)
    assert {"memcpy", "two_copy_parallel"} <= set(data["bounds"])
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
    assert data["models"]["dense-fp32-cast"]["source_bytes"] == 2 * data["models"]["dense"]["bytes"]
    assert {t["target"] for t in data["targets"]} >= {"peak extra memory vs ring + largest tensor"}
    assert png.stat().st_size > 0
