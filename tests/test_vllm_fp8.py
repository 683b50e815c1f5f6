"""Real syncs into a block-FP8 vLLM engine on CPU, streamed through ``quantize_fp8``.

The engine serves a 128x128 block-FP8 checkpoint; the trainer keeps bf16 weights and the
sender quantizes once. After three syncs the engine must match an engine freshly loaded
from the same quantized weights, and stay close to an engine that quantized the same bf16
weights itself with vLLM's online ``fp8_per_block`` (an independent check of the quantizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch
from vllm_harness import Outputs, engine_outputs, make_llm, shutdown, sync

import streamsync as ss
from streamsync.adapters import quantize_fp8
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm

QUANT_CONFIG = {
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
}


def _cpu_block_fp8_supported() -> bool:
    # vLLM's only CPU block-FP8 kernel without AMX-FP8 is W8A16 on AMX tiles.
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


if not _cpu_block_fp8_supported():
    pytest.skip(
        "this CPU has no AMX tiles: vLLM's CPU build has no block-FP8 kernel for it",
        allow_module_level=True,
    )


def save_quantized(model: torch.nn.Module, src: Path, dst: Path) -> None:
    """Write ``model`` quantized by ``quantize_fp8`` as a vLLM block-FP8 checkpoint."""
    from safetensors.torch import save_file

    async def collect() -> dict[str, torch.Tensor]:
        stream = quantize_fp8()(ss.named_tensors(model))
        return {name: t.contiguous().clone() async for name, t in stream}

    dst.mkdir(parents=True, exist_ok=True)
    save_file(anyio.run(collect), str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIG
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def save_bf16(model: torch.nn.Module, src: Path, dst: Path) -> None:
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def test_fp8_three_syncs_match_fresh_and_online_engines(tmp_path: Path) -> None:
    bf16 = tmp_path / "bf16"
    trainer = build_tiny_model(bf16, "dense-fp8", seed=0, dtype=torch.bfloat16)
    save_quantized(trainer, bf16, tmp_path / "fp8-a")
    llm = make_llm(str(tmp_path / "fp8-a"), dtype="bfloat16")
    try:
        previous = engine_outputs(llm)
        # Three consecutive syncs, over shm and over zmq.
        endpoints = ["shm://fp8-test", f"zmq+ipc://{tmp_path}/fp8.sock", "shm://fp8-test"]
        for step in range(3):
            perturb(trainer, seed=500 + step, scale=0.1)
            report = sync(llm, trainer, endpoints[step], pipeline=quantize_fp8())
            assert report.instances["worker0.main"].missing == ()
            synced = engine_outputs(llm)
            assert synced.tokens != previous.tokens  # every sync changes what it generates
            previous = synced
    finally:
        shutdown(llm)

    # The same quantized weights, loaded from disk by a fresh engine: identical outputs.
    save_quantized(trainer, bf16, tmp_path / "fp8-d")
    fresh = make_llm(str(tmp_path / "fp8-d"), dtype="bfloat16")
    try:
        reference = engine_outputs(fresh)
    finally:
        shutdown(fresh)
    assert synced.tokens == reference.tokens
    assert synced.max_logprob_diff(reference) <= 1e-5

    # vLLM quantizing the bf16 weights itself (online fp8_per_block): close.
    save_bf16(trainer, bf16, tmp_path / "bf16-d")
    online = make_llm(str(tmp_path / "bf16-d"), dtype="bfloat16", quantization="fp8_per_block")
    try:
        independent: Outputs = engine_outputs(online)
    finally:
        shutdown(online)
    assert synced.tokens == independent.tokens
    assert synced.max_logprob_diff(independent) <= 1e-3


def test_fp8_deltas_give_exactly_what_a_full_sync_gives(tmp_path: Path) -> None:
    """Delta syncs of the quantized wire (FP8 bytes and fp32 block scales diffed as bits)
    into the block-FP8 engine: after three deltas, the outputs one full sync gives."""
    from test_vllm_delta import deltas_then_full

    bf16 = tmp_path / "bf16"
    trainer = build_tiny_model(bf16, "dense-fp8", seed=0, dtype=torch.bfloat16)
    save_quantized(trainer, bf16, tmp_path / "fp8")
    llm = make_llm(str(tmp_path / "fp8"), dtype="bfloat16")
    try:
        deltas_then_full(llm, trainer, "shm://fp8-delta", quantize_fp8(), reference=False)
    finally:
        shutdown(llm)
