"""Stream a training MoE model into an FP8 rollout engine:
``expand_moe | split_buffers | quantize_fp8 | cast``.

A tiny DeepSeek-V3 (built locally with Transformers, random weights) takes a training step
that also moves its routers' ``e_score_correction_bias`` buffers, then syncs:

- ``expand_moe`` turns the packed experts into the per-expert keys older vLLM loads;
- ``split_buffers`` tells the receiver which names are buffers, so its ``BufferSink`` copies
  them in place into every model instance (main and drafter) instead of ``load_weights``;
- ``quantize_fp8`` sends linear weights as block-FP8 plus ``float32`` ``*_scale_inv``;
- ``cast`` sends the rest in bf16.

Run: .venv/bin/python examples/moe_pipeline.py
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import torch
import transformers

import streamsync as ss
from streamsync.adapters import BufferSink, cast, expand_moe, quantize_fp8, split_buffers

EXPERTS = 4


def tiny_deepseek_v3() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=192,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
    )
    return transformers.DeepseekV3ForCausalLM(config)


def train_step(model: torch.nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    # Aux-loss-free balancing: nudge each router's bias against its experts' load.
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                load = torch.bincount(torch.randint(0, EXPERTS, (64,)), minlength=EXPERTS)
                module.e_score_correction_bias += 1e-2 * torch.sign(load.float().mean() - load)


class EngineLoader:
    """Stands in for vLLM's ``load_weights``: records what it is given."""

    def __init__(self) -> None:
        self.seen: dict[str, torch.Tensor] = {}

    def prepare(self) -> None:
        self.seen = {}

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.seen.update((name, t.clone()) for name, t in tensors)

    def finalize(self) -> ss.LoadResult:
        return ss.LoadResult(loaded=tuple(self.seen))


async def main() -> None:
    trainer = tiny_deepseek_v3()
    train_step(trainer)
    main_model, drafter = tiny_deepseek_v3().bfloat16(), tiny_deepseek_v3().bfloat16()

    pipeline = (
        expand_moe(when="always", model_type=trainer.config.model_type)
        | split_buffers(trainer)
        | quantize_fp8()
        | cast(torch.bfloat16)
    )
    loader = EngineLoader()
    sink = BufferSink(loader, {"main": main_model, "drafter": drafter})
    url = "memory://moe-pipeline"
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: ss.receive(url, sink))
        report = await ss.send(trainer, url, pipeline=pipeline, bucket_bytes=1 << 20)
    print(report.summary())

    seen = loader.seen
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert "model.layers.1.mlp.experts.gate_up_proj" not in seen
    assert seen[expert].dtype == torch.float8_e4m3fn and seen[expert].shape == (192, 256)
    assert seen[expert + "_scale_inv"].dtype == torch.float32
    assert seen[expert + "_scale_inv"].shape == (2, 2)
    assert seen["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # router: not fp8
    assert seen["model.norm.weight"].dtype == torch.bfloat16
    assert not any("e_score_correction_bias" in name for name in seen)
    for name, model in (("main", main_model), ("drafter", drafter)):
        have = model.model.layers[1].mlp.gate.e_score_correction_bias
        want = trainer.model.layers[1].mlp.gate.e_score_correction_bias
        assert torch.equal(have, want.to(have.dtype)), name
    fp8 = sum(t.dtype == torch.float8_e4m3fn for t in seen.values())
    print(
        f"{len(seen)} tensors to load_weights ({fp8} in fp8), buffers applied to main and drafter"
    )
    print("[ok]")


if __name__ == "__main__":
    anyio.run(main)
