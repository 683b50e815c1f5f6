"""``quantize_fp8``: round trip, layout, eligibility, and agreement with vLLM's block-FP8
reference."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from streamsync import ConfigError, named_tensors
from streamsync.adapters import cast, expand_moe, quantize_fp8
from streamsync.adapters.quantize_fp8 import FP8_MAX, Block, quantize_block_fp8
from streamsync.testing import FakeConfig, fake_state_dict


async def collect(stream: Any) -> list[tuple[str, torch.Tensor]]:
    return [item async for item in stream]


def dequantize_block_fp8(
    fp8: torch.Tensor, scale_inv: torch.Tensor, block: Block = (128, 128)
) -> torch.Tensor:
    """The inverse of ``quantize_block_fp8``: ``fp8 * scale_inv``, block by block, in fp32."""
    bn, bk = block
    *_, n, k = fp8.shape
    scale = scale_inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return fp8.float() * scale[..., :n, :k].float()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double()))


# --- the pure functions ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(256, 384), (300, 200), (1, 1), (127, 129), (3, 130, 70), (2, 256, 128)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_and_layout(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    fp8, scale = quantize_block_fp8(w)
    *lead, n, k = shape
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == w.shape and fp8.is_contiguous()
    assert scale.dtype == torch.float32
    assert scale.shape == (*lead, math.ceil(n / 128), math.ceil(k / 128))
    back = dequantize_block_fp8(fp8, scale)
    assert rel_error(back, w.float()) <= 0.03


def test_each_block_has_its_own_scale_and_reaches_fp8_max() -> None:
    w = torch.zeros(256, 256)
    w[:128, :128] = 1.0
    w[:128, 128:] = 100.0
    w[128:, :128] = -0.001
    fp8, scale = quantize_block_fp8(w)
    assert torch.allclose(scale, torch.tensor([[1.0, 100.0], [0.001, 1e-4]]) / FP8_MAX)
    # Each block's largest magnitude lands on the largest fp8 value.
    assert fp8.float().abs().amax() == FP8_MAX
    assert torch.equal(fp8[:128, :128].float(), torch.full((128, 128), FP8_MAX))
    assert torch.equal(fp8[128:, :128].float(), torch.full((128, 128), -FP8_MAX))


def test_zeros_stay_zero_and_zero_blocks_do_not_divide_by_zero() -> None:
    w = torch.randn(256, 300)
    w[:128, :128] = 0.0  # an all-zero block
    w[200, 5] = 0.0  # an exact zero in a normal block
    w[130:, 256:] = 0.0  # an all-zero partial block
    fp8, scale = quantize_block_fp8(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert not torch.isnan(fp8.float()).any()
    back = dequantize_block_fp8(fp8, scale)
    assert torch.equal(back[w == 0], torch.zeros(int((w == 0).sum())))
    assert rel_error(back, w) <= 0.03


def test_experts_are_quantized_independently() -> None:
    # Expert 1 is 1000x larger than expert 0: a block shared across experts would crush
    # expert 0 to zero.
    w = torch.randn(2, 128, 128)
    w[1] *= 1000
    fp8, scale = quantize_block_fp8(w)
    assert scale.shape == (2, 1, 1)
    back = dequantize_block_fp8(fp8, scale)
    for e in range(2):
        assert rel_error(back[e], w[e]) <= 0.03
        single_fp8, single_scale = quantize_block_fp8(w[e])
        assert torch.equal(single_fp8.view(torch.uint8), fp8[e].view(torch.uint8))
        assert torch.equal(single_scale, scale[e])


def test_non_contiguous_input_is_not_modified() -> None:
    base = torch.randn(256, 384)
    w = base.t()
    before = w.clone()
    fp8, scale = quantize_block_fp8(w)
    assert torch.equal(w, before)
    assert rel_error(dequantize_block_fp8(fp8, scale), w) <= 0.03
    # A contiguous fp32 input (used as is, no copy) is left alone too.
    c = torch.randn(130, 70)
    c_before = c.clone()
    quantize_block_fp8(torch.randn(256, 256))
    quantize_block_fp8(c)
    assert torch.equal(c, c_before)


def test_other_block_sizes() -> None:
    w = torch.randn(100, 60)
    fp8, scale = quantize_block_fp8(w, (64, 32))
    assert scale.shape == (2, 2)
    assert rel_error(dequantize_block_fp8(fp8, scale, (64, 32)), w) <= 0.03


@pytest.mark.parametrize("block", [(128,), (0, 128), (128.0, 128), "128x128"])
def test_bad_block_is_refused(block: Any) -> None:
    with pytest.raises(ConfigError, match="pair of positive ints"):
        quantize_fp8(block=block)


# --- the adapter -------------------------------------------------------------------------


async def test_adapter_emits_scale_right_after_each_eligible_weight() -> None:
    sd = fake_state_dict(FakeConfig(num_experts=4, hidden_size=64, moe_intermediate_size=48))
    sd["model.layers.0.self_attn.o_proj.bias"] = torch.randn(64)
    out = await collect(quantize_fp8()(named_tensors(sd)))
    names = [n for n, _ in out]
    got = dict(out)
    quantized = {n for n, t in out if t.dtype == torch.float8_e4m3fn}
    assert quantized == {
        n
        for n in sd
        if any(p in n for p in ("q_proj", "k_proj", "v_proj", "o_proj.weight", "experts."))
    }
    for name in quantized:
        scale = name + "_scale_inv"
        assert names[names.index(name) + 1] == scale
        assert got[scale].dtype == torch.float32
        assert rel_error(dequantize_block_fp8(got[name], got[scale]), sd[name]) <= 0.03
    # Packed experts: per-expert scales, named after the packed tensor.
    assert got["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 1, 1)
    assert got["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    # Skipped ones pass through as the same tensors.
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.o_proj.bias",
        "model.norm.weight",
    ):
        assert got[name] is sd[name], name
    assert len(names) == len(sd) + len(quantized)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.mlp.router.weight",
        "transformer.wte.weight",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.0.self_attn.q_proj.lora_A",  # 2-D but not a *.weight
    ],
)
async def test_default_skips(name: str) -> None:
    t = torch.randn(8, 16)
    out = await collect(quantize_fp8()(named_tensors({name: t})))
    assert out == [(name, t)]


async def test_skip_option_and_non_float_inputs() -> None:
    sd = {
        "a.q_proj.weight": torch.randn(8, 8),
        "a.k_proj.weight": torch.randn(8, 8),
        "b.idx.weight": torch.arange(64).view(8, 8),
        "c.f8.weight": torch.zeros(8, 8).to(torch.float8_e4m3fn),
    }
    for skip in (r"q_proj", [r"^a\.q_"], lambda n: n.startswith("a.q")):
        names = [n for n, _ in await collect(quantize_fp8(skip=skip)(named_tensors(sd)))]
        assert names == [
            "a.q_proj.weight",
            "a.k_proj.weight",
            "a.k_proj.weight_scale_inv",
            "b.idx.weight",
            "c.f8.weight",
        ]
    with pytest.raises(ConfigError, match="skip="):
        quantize_fp8(skip=[3])  # type: ignore[list-item]


async def test_after_expand_moe_each_expert_is_quantized() -> None:
    sd = fake_state_dict(FakeConfig(num_experts=2, hidden_size=64, moe_intermediate_size=48))
    out = dict(await collect((expand_moe(when="always") | quantize_fp8())(named_tensors(sd))))
    w = "model.layers.1.mlp.experts.1.up_proj.weight"
    assert out[w].dtype == torch.float8_e4m3fn and out[w].shape == (48, 64)
    assert out[w + "_scale_inv"].shape == (1, 1)
    packed = sd["model.layers.1.mlp.experts.gate_up_proj"][1, 48:]
    assert rel_error(dequantize_block_fp8(out[w], out[w + "_scale_inv"]), packed) <= 0.03


async def test_a_following_cast_leaves_fp8_weights_and_their_scales_alone() -> None:
    sd = {"a.q_proj.weight": torch.randn(8, 8), "a.norm.weight": torch.randn(8)}
    out = dict(await collect((quantize_fp8() | cast(torch.bfloat16))(named_tensors(sd))))
    assert out["a.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["a.q_proj.weight_scale_inv"].dtype == torch.float32
    assert out["a.norm.weight"].dtype == torch.bfloat16


# --- agreement with vLLM ------------------------------------------------------------------


def _vllm_reference() -> Any:
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except Exception as exc:  # pragma: no cover - depends on the installed vLLM
        pytest.skip(f"this vLLM offers no importable per_block_cast_to_fp8 ({exc!r})")
    # The function is wrapped in torch.compile; its plain body runs the same on CPU without
    # a compiler.
    return getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_vllm_block_fp8_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    reference = _vllm_reference()
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    w[:128, :128] = 0  # a zero block: both clamp its amax the same way
    want_fp8, want_scale = reference(w, [128, 128])
    fp8, scale = quantize_block_fp8(w, (128, 128))
    assert want_fp8.dtype == fp8.dtype and want_fp8.shape == fp8.shape
    assert torch.equal(fp8.view(torch.uint8), want_fp8.view(torch.uint8))
    assert torch.equal(scale, want_scale)
