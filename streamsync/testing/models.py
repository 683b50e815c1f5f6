"""Tiny random-weight Transformers models built locally (no hub), for engine tests and the
demo: a dense Qwen3 and a Qwen3-MoE, with a word-level tokenizer.

CPU attention in vLLM needs ``head_dim`` in {32, 64, 80, 96, 112, 128, ...}; these use 64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["build_tiny_model", "perturb"]

VOCAB_SIZE = 512


#: Layers of each kind unless told otherwise.
_LAYERS = {"dense": 2, "dense-fp8": 2, "moe": 2, "dense-400m": 16}


def tiny_config(
    kind: str = "dense",
    *,
    dtype: torch.dtype = torch.float32,
    layers: int | None = None,
    tied: bool = False,
) -> Any:
    """A Transformers config for a tiny ``"dense"`` Qwen3, a ``"dense-fp8"`` one shaped for
    128x128 block FP8, a ``"moe"`` Qwen3-MoE, or ``"dense-400m"``: a Qwen3 of about 400 MiB
    in bf16 (hidden 1024, MLP 3072, 16 layers; 200M parameters), large enough that a sync's
    GB/s means something, small enough to build in seconds. ``tied=True`` ties the output
    head to the input embedding (``tie_word_embeddings``, as Qwen3-0.6B, Llama-3.2-1B and
    Gemma ship)."""
    if kind not in _LAYERS:
        raise ValueError(f"kind={kind!r}; valid: {', '.join(map(repr, _LAYERS))}")
    layers = _LAYERS[kind] if layers is None else layers
    from transformers import Qwen3Config, Qwen3MoeConfig

    eos = VOCAB_SIZE - 1
    common: dict[str, Any] = dict(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_hidden_layers=layers,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=eos,
        dtype=dtype,
    )
    if kind == "dense-fp8":
        # Block-FP8 (128x128) needs q, k and gate partitions divisible by 128.
        common.update(hidden_size=256, head_dim=128)
    if kind == "dense-400m":
        common.update(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128)
        return Qwen3Config(intermediate_size=3072, **common)
    if kind in ("dense", "dense-fp8"):
        return Qwen3Config(intermediate_size=256, **common)
    if kind == "moe":
        return Qwen3MoeConfig(
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **common,
        )
    raise AssertionError(kind)  # every kind in _LAYERS is handled above


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB_SIZE - 2)}
    vocab["<unk>"] = VOCAB_SIZE - 2
    vocab["<eos>"] = VOCAB_SIZE - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>"
    )


def build_tiny_model(
    path: str | Path,
    kind: str = "dense",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layers: int | None = None,
    quantization_config: dict[str, Any] | None = None,
    init_std: float | None = None,
    tied: bool = False,
) -> Any:
    """Build a random tiny model, save it (weights, config, tokenizer) to ``path`` and
    return the Transformers model (in ``dtype``). ``init_std`` (default 0.2, 0.05 for
    ``dense-400m``, whose wider layers would otherwise give logits so large that fp32
    rounding differences between engines approach the demo's tolerance). ``tied``: see
    :func:`tiny_config`."""
    if init_std is None:
        init_std = 0.05 if kind == "dense-400m" else 0.2
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, dtype=dtype, layers=layers, tied=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            # Larger than the default init, so the logits of a tiny model are not flat.
            param.normal_(0.0, init_std if param.dim() > 1 else 0.05).add_(
                1.0 if param.dim() == 1 else 0
            )
    model.eval()
    path = Path(path)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    if quantization_config is not None:
        import json

        cfg_path = path / "config.json"
        data = json.loads(cfg_path.read_text())
        data["quantization_config"] = quantization_config
        cfg_path.write_text(json.dumps(data, indent=2))
    return model


@torch.no_grad()
def perturb(model: torch.nn.Module, *, seed: int, scale: float = 0.05) -> None:
    """A stand-in for a training step: add noise to every parameter, in place."""
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * scale
        param.add_(noise.to(param.dtype))
