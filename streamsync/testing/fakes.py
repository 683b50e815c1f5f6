"""Fake state dicts in real Transformers naming, and a fake vLLM-style model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from streamsync.errors import UnknownTensorError
from streamsync.pipeline import NamedTensor
from streamsync.report import LoadResult
from streamsync.testing.shapes import VLLM_STACKED, qwen3_shapes


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


def _random(cfg: FakeConfig | None, dtype: torch.dtype, seed: int) -> Iterator[NamedTensor]:
    gen = torch.Generator().manual_seed(seed)
    for name, shape in _shapes(cfg or FakeConfig()):
        yield name, torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _shapes(cfg: FakeConfig) -> Iterable[tuple[str, tuple[int, ...]]]:
    return qwen3_shapes(
        vocab=cfg.vocab_size,
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        q_dim=cfg.num_attention_heads * cfg.head_dim,
        kv_dim=cfg.num_key_value_heads * cfg.head_dim,
        head_dim=cfg.head_dim,
        intermediate=cfg.intermediate_size,
        experts=cfg.num_experts,
        moe_intermediate=cfg.moe_intermediate_size,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


def fake_state_dict(
    cfg: FakeConfig | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A random state dict named like Transformers' Qwen3 (or Qwen3-MoE) model."""
    return dict(_random(cfg, dtype, seed))


async def fake_named_tensors(
    cfg: FakeConfig | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> AsyncIterator[NamedTensor]:
    """The same tensors as :func:`fake_state_dict`, made one at a time."""
    for item in _random(cfg, dtype, seed):
        yield item


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
        self._params = torch.nn.ParameterDict()
        for name, shape in _shapes(cfg):
            for fused, shard, _ in VLLM_STACKED:
                if f".{shard}." in name:
                    name = name.replace(shard, fused)
                    rows = q + 2 * kv if fused == "qkv_proj" else 2 * cfg.intermediate_size
                    shape = (rows, shape[1])
            zeros = torch.zeros(shape, dtype=dtype)
            self._params[name.replace(".", "__")] = torch.nn.Parameter(zeros, requires_grad=False)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The fused parameters by their vLLM names."""
        return {key.replace("__", "."): param for key, param in self._params.items()}

    def load_weights(self, weights: Iterable[NamedTensor]) -> set[str]:
        """Copy checkpoint-named tensors into the fused parameters; returns the names of
        the parameters written (as vLLM does)."""
        params = self.named_weights()
        loaded: set[str] = set()
        inter = self.cfg.intermediate_size
        with torch.no_grad():
            for name, tensor in weights:
                for fused, shard, shard_id in VLLM_STACKED:
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
