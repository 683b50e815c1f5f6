"""Fake state dicts in real Transformers naming, and a fake vLLM-style model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import torch

from streamsync.adapter import NamedTensor
from streamsync.errors import UnknownTensorError
from streamsync.moe_names import packed_name, router_name
from streamsync.report import LoadResult

__all__ = [
    "FakeConfig",
    "FakeVllmModel",
    "LoadWeightsSink",
    "fake_named_tensors",
    "fake_state_dict",
]


@dataclass(frozen=True)
class FakeConfig:
    """Shape of a tiny Qwen3-style model (``num_experts > 0`` makes it a Qwen3-MoE)."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 96
    num_experts: int = 0
    moe_intermediate_size: int = 48
    tie_word_embeddings: bool = False


def _shapes(cfg: FakeConfig) -> Iterable[tuple[str, tuple[int, ...]]]:
    h, hd = cfg.hidden_size, cfg.head_dim
    yield "model.embed_tokens.weight", (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.self_attn.q_proj.weight", (cfg.num_attention_heads * hd, h)
        yield f"{p}.self_attn.k_proj.weight", (cfg.num_key_value_heads * hd, h)
        yield f"{p}.self_attn.v_proj.weight", (cfg.num_key_value_heads * hd, h)
        yield f"{p}.self_attn.o_proj.weight", (h, cfg.num_attention_heads * hd)
        yield f"{p}.self_attn.q_norm.weight", (hd,)
        yield f"{p}.self_attn.k_norm.weight", (hd,)
        if cfg.num_experts:
            e, i_ = cfg.num_experts, cfg.moe_intermediate_size
            yield router_name(f"{p}.mlp"), (e, h)
            # Transformers >= 5 keeps experts packed, without a ".weight" suffix.
            yield packed_name(f"{p}.mlp", "gate_up_proj"), (e, 2 * i_, h)
            yield packed_name(f"{p}.mlp", "down_proj"), (e, h, i_)
        else:
            yield f"{p}.mlp.gate_proj.weight", (cfg.intermediate_size, h)
            yield f"{p}.mlp.up_proj.weight", (cfg.intermediate_size, h)
            yield f"{p}.mlp.down_proj.weight", (h, cfg.intermediate_size)
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, h)


def fake_state_dict(
    cfg: FakeConfig | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A random state dict named like Transformers' Qwen3 (or Qwen3-MoE) model."""
    cfg = cfg or FakeConfig()
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        for name, shape in _shapes(cfg)
    }


async def fake_named_tensors(
    cfg: FakeConfig | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> AsyncIterator[NamedTensor]:
    """The same tensors as :func:`fake_state_dict`, made one at a time."""
    cfg = cfg or FakeConfig()
    gen = torch.Generator().manual_seed(seed)
    for name, shape in _shapes(cfg):
        yield name, torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


# (fused parameter, checkpoint shard, shard id): the mapping vLLM's Qwen3 uses.
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class FakeVllmModel(torch.nn.Module):
    """A dense Qwen3-shaped model with vLLM's fused ``qkv_proj`` and ``gate_up_proj``
    parameters; :meth:`load_weights` takes checkpoint names, as vLLM models do."""

    def __init__(
        self, cfg: FakeConfig | None = None, *, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        cfg = cfg or FakeConfig()
        if cfg.num_experts:
            raise ValueError("FakeVllmModel is dense; use num_experts=0")
        self.cfg = cfg
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        self._shards = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in _shapes(cfg):
            for fused, shard, _ in _STACKED:
                if f".{shard}." in name:
                    name = name.replace(shard, fused)
                    rows = q + 2 * kv if fused == "qkv_proj" else 2 * cfg.intermediate_size
                    shape = (rows, shape[1])
            shapes[name] = shape
        self._params = torch.nn.ParameterDict()
        self._names = {}
        for name, shape in shapes.items():
            key = name.replace(".", "__")
            self._params[key] = torch.nn.Parameter(
                torch.zeros(shape, dtype=dtype), requires_grad=False
            )
            self._names[name] = key

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The fused parameters by their vLLM names."""
        return {name: self._params[key] for name, key in self._names.items()}

    def load_weights(self, weights: Iterable[NamedTensor]) -> set[str]:
        """Copy checkpoint-named tensors into the fused parameters; returns the names of
        the parameters written (as vLLM does)."""
        params = self.named_weights()
        loaded: set[str] = set()
        inter = self.cfg.intermediate_size
        with torch.no_grad():
            for name, tensor in weights:
                for fused, shard, shard_id in _STACKED:
                    if f".{shard}." not in name:
                        continue
                    target = name.replace(shard, fused)
                    param = self._param(params, target, name)
                    if isinstance(shard_id, str):
                        start, size = self._shards[shard_id]
                    else:
                        start, size = shard_id * inter, inter
                    param[start : start + size].copy_(tensor)
                    loaded.add(target)
                    break
                else:
                    self._param(params, name, name).copy_(tensor)
                    loaded.add(name)
        return loaded

    @staticmethod
    def _param(params: dict[str, torch.Tensor], target: str, name: str) -> torch.Tensor:
        try:
            return params[target]
        except KeyError:
            raise UnknownTensorError(
                f"tensor {name!r} has no parameter {target!r} in the model"
            ) from None


class LoadWeightsSink:
    """A sink that hands each bucket to ``model.load_weights`` (the vLLM model contract)."""

    def __init__(self, model: FakeVllmModel) -> None:
        self.model = model
        self._loaded: set[str] = set()

    def prepare(self) -> None:
        self._loaded = set()

    def load(self, tensors: Sequence[NamedTensor]) -> None:
        self._loaded |= self.model.load_weights(tensors)

    def finalize(self) -> LoadResult:
        names = self.model.named_weights()
        return LoadResult(
            loaded=tuple(sorted(self._loaded)),
            missing=tuple(sorted(set(names) - self._loaded)),
        )
