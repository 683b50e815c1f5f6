"""The Qwen3 shape table: which tensors a Qwen3 or Qwen3-MoE decoder holds, named as
Transformers names them, with their shapes, and how vLLM fuses and unpacks them.

The one home of these facts for the public fakes (:mod:`streamsync.testing.fakes`), the fake
demo and the benchmark's synthetic models (:mod:`streamsync.cli.bench.models`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from streamsync._moe_names import packed_name, router_name

Shape = tuple[int, ...]

#: (fused vLLM parameter, checkpoint tensor, shard id): how vLLM's Qwen3 stacks q/k/v and
#: gate/up checkpoint tensors into one parameter each, in this order along dim 0.
VLLM_STACKED: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def qwen3_layer(
    *,
    hidden: int,
    q_dim: int,
    kv_dim: int,
    head_dim: int,
    intermediate: int = 0,
    experts: int = 0,
    moe_intermediate: int = 0,
    router_bias: bool = False,
) -> list[tuple[str, Shape]]:
    """One decoder layer's tensors, named below ``model.layers.N.``, in the order
    Transformers registers them.

    ``q_dim`` and ``kv_dim`` are the widths of the q and k/v projections (heads times
    ``head_dim``). ``experts > 0`` makes it a Qwen3-MoE layer with the experts packed as
    Transformers >= 5 holds them (no ``.weight`` suffix); ``router_bias`` adds a
    DeepSeek-V3-style ``mlp.gate.e_score_correction_bias`` (an fp32 buffer in those models).
    """
    layer: list[tuple[str, Shape]] = [
        ("self_attn.q_proj.weight", (q_dim, hidden)),
        ("self_attn.k_proj.weight", (kv_dim, hidden)),
        ("self_attn.v_proj.weight", (kv_dim, hidden)),
        ("self_attn.o_proj.weight", (hidden, q_dim)),
        ("self_attn.q_norm.weight", (head_dim,)),
        ("self_attn.k_norm.weight", (head_dim,)),
    ]
    if experts:
        layer.append((router_name("mlp"), (experts, hidden)))
        if router_bias:
            layer.append(("mlp.gate.e_score_correction_bias", (experts,)))
        layer += [
            (packed_name("mlp", "gate_up_proj"), (experts, 2 * moe_intermediate, hidden)),
            (packed_name("mlp", "down_proj"), (experts, hidden, moe_intermediate)),
        ]
    else:
        layer += [
            ("mlp.gate_proj.weight", (intermediate, hidden)),
            ("mlp.up_proj.weight", (intermediate, hidden)),
            ("mlp.down_proj.weight", (hidden, intermediate)),
        ]
    layer += [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    return layer


def qwen3_shapes(
    *, vocab: int, layers: int, hidden: int, tie_word_embeddings: bool = False, **layer: Any
) -> Iterator[tuple[str, Shape]]:
    """Every tensor of a Qwen3 (or, with ``experts``, Qwen3-MoE) causal LM: the embedding,
    ``layers`` decoder layers (:func:`qwen3_layer`, given ``hidden`` and the other keyword
    arguments), the final norm and the LM head."""
    yield "model.embed_tokens.weight", (vocab, hidden)
    table = qwen3_layer(hidden=hidden, **layer)
    for index in range(layers):
        for name, shape in table:
            yield f"model.layers.{index}.{name}", shape
    yield "model.norm.weight", (hidden,)
    if not tie_word_embeddings:
        yield "lm_head.weight", (vocab, hidden)


def checkpoint_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """The per-expert checkpoint tensors (views of ``tensor``) of a packed Qwen3-MoE expert
    tensor, as vLLM < 0.25 loads them: ``mlp.experts.gate_up_proj [E, 2I, H]`` gives
    ``mlp.experts.{e}.gate_proj.weight`` (rows ``:I``) and ``up_proj.weight`` (rows ``I:``),
    ``mlp.experts.down_proj [E, H, I]`` gives ``mlp.experts.{e}.down_proj.weight``.
    ``None`` for every other tensor.

    Written out here, apart from ``expand_moe``, so that tests check that adapter against
    the layout rather than against itself.
    """
    prefix, _, packed = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or tensor.dim() != 3:
        return None
    if packed == "gate_up_proj":
        inter = tensor.shape[1] // 2
        return [
            part
            for e in range(tensor.shape[0])
            for part in (
                (f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter]),
                (f"{prefix}.{e}.up_proj.weight", tensor[e, inter:]),
            )
        ]
    if packed == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    return None
