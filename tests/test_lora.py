"""The trainer side of LoRA adapter syncs, against the real peft: what an adapter sync carries,
a peft model's base and merged weights under the base checkpoint's names, and bad input
named before anything moves. (The engine side is in ``test_vllm_lora.py``.)"""

from __future__ import annotations

import copy
from typing import Any

import anyio
import pytest
import torch
from conftest import extra

import streamsync as ss
from streamsync._peft import base_name
from streamsync.engine.channel import EngineChannel
from streamsync.engine.messages import LoraTarget, WorkerOptions
from streamsync.lora import (
    LORA_PATH_PREFIX,
    lora_adapter,
    lora_id,
    path_version,
    version_path,
)
from streamsync.testing.models import build_tiny_model

peft = extra("peft", "lora")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return build_tiny_model(tmp_path_factory.mktemp("lora-base"), "dense", seed=0)


def make_peft(base: torch.nn.Module, r: int = 8) -> Any:
    config = peft.LoraConfig(r=r, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=gen)
    return model.eval()


def collect(obj: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    async def run() -> dict[str, torch.Tensor]:
        return {n: t.clone() async for n, t in ss.named_tensors(obj, **kwargs)}

    return anyio.run(run)


def test_a_peft_model_syncs_its_active_adapter_as_peft_saves_it(base: torch.nn.Module) -> None:
    model = make_peft(base)
    adapter = lora_adapter(model)
    saved = peft.get_peft_model_state_dict(model, save_embedding_layers=False)
    assert [n for n, _ in adapter.tensors] == list(saved)
    assert len(adapter.tensors) == 2 * len(TARGETS) * 2
    assert all(".default." not in n and n.startswith("base_model.model.") for n in saved)
    assert adapter.rank == 8 and adapter.config["lora_alpha"] == 16
    assert adapter.config["target_modules"] == sorted(TARGETS)  # a set in peft: JSON here
    assert adapter.config["peft_type"] == "LORA"
    assert adapter.nbytes == sum(t.numel() * t.element_size() for t in saved.values())
    # Named tensors with the config give the same adapter.
    again = lora_adapter(saved, model.peft_config["default"])
    assert [n for n, _ in again.tensors] == [n for n, _ in adapter.tensors]
    assert again.config == adapter.config


def test_named_tensors_of_a_peft_model_is_its_base(base: torch.nn.Module) -> None:
    model = make_peft(base)
    got = collect(model)
    want = base.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_named_tensors_merged_is_merge_and_unload_without_touching_the_model(
    base: torch.nn.Module,
) -> None:
    model = make_peft(base)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        before = model(ids).logits
    got = collect(model, merged=True)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(got) == list(want)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst < 1e-6
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"],
        base.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # still unmerged, adapter active


def test_merged_needs_a_peft_model_and_a_merged_one_says_so(base: torch.nn.Module) -> None:
    with pytest.raises(ss.ConfigError, match=r"merged=True\) merges a peft model"):
        ss.named_tensors(base, merged=True)
    model = make_peft(base)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    model.merge_adapter()
    with pytest.raises(ss.ConfigError, match="merged into the base weights: unmerge_adapter"):
        collect(model)
    merged = collect(model, merged=True)  # as it stands: base plus adapter, once
    assert max((merged[n] - want[n]).abs().max().item() for n in want) < 1e-5


def test_base_names() -> None:
    assert (
        base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert (
        base_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    )
    assert base_name("base_model.model.lm_head.modules_to_save.default.weight") is None
    assert base_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert base_name("base_model.model.model.norm.weight") == "model.norm.weight"


@pytest.mark.parametrize(
    ("adapter", "config", "match"),
    [
        (
            {"m.q_proj.lora_A.default.weight": torch.zeros(8, 4)},
            {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]},
            r"'m.q_proj.lora_A.default.weight' is not a LoRA tensor .* carries the adapter's name",
        ),
        (
            {"m.q_proj.weight": torch.zeros(8, 4)},
            {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]},
            r"'m.q_proj.weight' is not a LoRA tensor",
        ),
        (
            {"m.q_proj.lora_A.weight": torch.zeros(8, 4)},
            {"lora_alpha": 8, "target_modules": ["q_proj"]},
            "LoRA config lacks r",
        ),
        (
            {"m.q_proj.lora_A.weight": torch.zeros(8, 4)},
            None,
            "needs config=",
        ),
        (
            {"m.q_proj.lora_A.weight": torch.zeros(8, 4, dtype=torch.int32)},
            {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]},
            r"'m.q_proj.lora_A.weight' is torch.int32",
        ),
        ({}, {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}, "has no tensors"),
        (
            {"m.q_proj.lora_A.weight": torch.zeros(8, 4)},
            {"r": 0, "lora_alpha": 8, "target_modules": ["q_proj"]},
            "r=0",
        ),
        (
            {"m.q_proj.lora_A.weight": torch.zeros(8, 4)},
            {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "IA3"},
            "only LORA adapters",
        ),
        (torch.zeros(3), {"r": 8, "lora_alpha": 8, "target_modules": ["q"]}, "is a Tensor"),
    ],
)
def test_bad_adapters_are_named(adapter: Any, config: Any, match: str) -> None:
    with pytest.raises(ss.ConfigError, match=match):
        lora_adapter(adapter, config)


def test_ids_and_paths_are_stable_per_name() -> None:
    assert lora_id("policy") == lora_id("policy") >= 1 << 20
    assert lora_id("policy") != lora_id("reference")
    assert version_path("policy", 7) == f"{LORA_PATH_PREFIX}policy/v7"
    assert version_path("policy", 7).startswith("/")  # absolute: vLLM never asks the Hub


def test_a_version_is_read_back_from_its_path_only() -> None:
    assert path_version("policy", version_path("policy", 7)) == 7
    assert path_version("policy", version_path("policy", 0)) == 0
    assert path_version("policy", version_path("reference", 7)) is None  # another adapter's
    assert path_version("policy", "/adapters/policy/v7") is None  # the user's, on disk
    assert path_version("policy", f"{LORA_PATH_PREFIX}policy/v7x") is None
    assert path_version("policy", f"{LORA_PATH_PREFIX}policy/v") is None


def test_the_lora_target_crosses_the_rpc_as_plain_values() -> None:
    target = LoraTarget(name="p", version=1, config={"r": 8}, keep=(0,))
    options = WorkerOptions(lora=target)
    wire = options.to_wire()
    assert wire["lora"]["version"] == 1
    assert list(wire["lora"]["keep"]) == [0]
    assert WorkerOptions.from_wire(wire) == options


class _NoLora:
    receivers = 1

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[Any]:
        raise AssertionError("not reached")

    async def after_sync(self) -> None:
        pass

    async def close_receivers(self, endpoint: str) -> int:
        return 0


def test_a_channel_whose_engine_cannot_serve_lora_says_so(base: torch.nn.Module) -> None:
    async def run() -> None:
        sync = EngineChannel(_NoLora(), "memory://lora-none")
        with pytest.raises(ss.ConfigError, match="_NoLora cannot install LoRA adapters"):
            await sync.update_lora("p", make_peft(base))
        with pytest.raises(ss.ConfigError, match="no LoRA adapter 'p' on this channel"):
            sync.lora("p")

    anyio.run(run)


@pytest.mark.parametrize("name", ["", "a b", "../x", "x" * 129, 3])
def test_adapter_names_are_checked(name: Any) -> None:
    from streamsync.lora import check_lora_name

    with pytest.raises(ss.ConfigError, match="LoRA adapter name"):
        check_lora_name(name)
