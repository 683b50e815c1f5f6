"""``expand_moe(when=..., model_type=...)``: packed MoE experts into per-expert checkpoint keys.

Transformers ≥ 5 keeps the experts of an MoE layer packed (:mod:`streamsync._moe_names`);
vLLM before 0.25 only loads the per-expert checkpoint keys. Which vLLM is the engine's fact,
told to the trainer when a channel opens (:class:`~streamsync.facts.EngineFacts`) and by the
channel to this adapter (its ``engines``, :meth:`~streamsync.pipeline.Adapter.for_engines`).
This adapter yields those keys expert by expert, as views of the packed tensor (no copy, no
dict of the layer).

The keys depend on the model family: :data:`RULES` by ``config.model_type`` (none: the
Qwen-style rule; an unknown one: nothing expanded, with a warning). Every other tensor passes
untouched, as do LoRA tensors (names containing ``lora_``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from streamsync._log import warn
from streamsync._moe_names import PACKED, ROUTER, block_kind, expert_name, router_name
from streamsync._versions import vllm_version
from streamsync.errors import ConfigError
from streamsync.facts import EngineFacts
from streamsync.pipeline import NamedTensor, adapter

#: Environment variable that forces ``when="auto"`` to ``always`` or ``never``.
ENV_VAR: Final = "STREAMSYNC_EXPAND_MOE"
_WHEN: Final = ("auto", "always", "never")
#: ``when="auto"`` expands iff the installed vLLM is at most this version (verl's rule).
LAST_VLLM_NEEDING_EXPANSION: Final = (0, 24, 0)

When = Literal["auto", "always", "never"]


def _resolve(when: str) -> str:
    """``when``, with ``"auto"`` resolved by the environment variable where it is set."""
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
    return when


def _auto(engines: tuple[EngineFacts, ...]) -> bool:
    """``"auto"``: from the engines' facts, or from the vLLM installed here without any."""
    versions = {f.vllm_version for f in engines} if engines else {vllm_version()}
    verdicts = {v is not None and v <= LAST_VLLM_NEEDING_EXPANSION for v in versions}
    if len(verdicts) > 1:
        shown = ", ".join(sorted(".".join(map(str, v)) if v else "unknown" for v in versions))
        raise ConfigError(
            f"expand_moe(when='auto'): the engines run vLLM {shown}, which load MoE experts "
            "differently; pass when='always' or when='never'"
        )
    return verdicts.pop()


def _packed_block(name: str, tensor: torch.Tensor, proj: str) -> str | None:
    """The ``mlp`` block path of a 3-D packed ``proj`` of the Qwen layout; ``None`` otherwise."""
    match = PACKED.match(name)
    if match is None or match["proj"] != proj or block_kind(match["block"]) != "mlp":
        return None
    return match["block"] if tensor.dim() == 3 else None


@dataclass(frozen=True)
class QwenStyleRule:
    """How one model family's live (Transformers ≥ 5) tensors map to checkpoint tensors:
    ``mlp.experts.gate_up_proj [E, 2I, H]`` → ``mlp.experts.{e}.gate_proj.weight`` (rows
    ``:I``) and ``up_proj.weight`` (rows ``I:``); ``down_proj [E, H, I]`` →
    ``mlp.experts.{e}.down_proj.weight``. What Transformers calls the ``qwen2_moe`` conversion."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def _experts(self, mlp: str) -> str:
        return mlp[: -len("mlp")] + self.block

    def expand(self, name: str, tensor: torch.Tensor) -> Iterator[NamedTensor] | None:
        """The checkpoint tensors for ``(name, tensor)``, or ``None`` to pass it untouched."""
        gate_up = _packed_block(name, tensor, "gate_up_proj")
        if gate_up is not None and tensor.shape[1] % 2 == 0:
            block, inter = self._experts(gate_up), tensor.shape[1] // 2
            halves = ((self.gate, slice(None, inter)), (self.up, slice(inter, None)))
            return (
                (expert_name(block, e, p), tensor[e, s])
                for e in range(len(tensor))
                for p, s in halves
            )
        down = _packed_block(name, tensor, "down_proj")
        if down is not None:
            block = self._experts(down)
            return ((expert_name(block, e, self.down), tensor[e]) for e in range(len(tensor)))
        return None


class MixtralRule(QwenStyleRule):
    """The Qwen-style rule that also moves the router ``mlp.gate.weight`` into the experts'
    block: Mixtral's ``block_sparse_moe.gate.weight``."""

    def expand(self, name: str, tensor: torch.Tensor) -> Iterator[NamedTensor] | None:
        router = ROUTER.match(name)
        if router is not None and block_kind(router["block"]) == "mlp" and tensor.dim() == 2:
            return iter([(router_name(self._experts(router["block"])), tensor)])
        return super().expand(name, tensor)


_QWEN = QwenStyleRule()
_MIXTRAL = MixtralRule(block="block_sparse_moe", gate="w1", up="w3", down="w2")

#: ``config.model_type`` → rule (``None``: nothing to expand). The Qwen-style and
#: Mixtral-style families are those Transformers 5.19 converts with its ``qwen2_moe`` and
#: ``mixtral`` patterns (``transformers/conversion_mapping.py``).
RULES: dict[str, QwenStyleRule | None] = {
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
    # Checkpoints store gate/up interleaved and packed with their biases, as the live model
    # does, and vLLM loads them packed: nothing to expand.
    "gpt_oss": None,
}


def _configure(when: When = "auto", model_type: str | None = None) -> dict[str, Any]:
    # The environment is read once, when the stage is made (it may change before it runs);
    # "auto" is decided when it runs, from the engines the sync feeds.
    resolved = _resolve(when)
    if resolved == "never":
        return {"rule": None, "auto": False}
    if model_type is not None and model_type not in RULES:
        warn(
            "expand_moe.unknown_model_type",
            model_type=model_type,
            action="passing every tensor through untouched",
            known=sorted(RULES),
        )
    rule = _QWEN if model_type is None else RULES.get(model_type)
    return {"rule": rule, "auto": resolved == "auto"}


@adapter(configure=_configure)
async def expand_moe(
    source: AsyncIterable[NamedTensor],
    *,
    rule: QwenStyleRule | None,
    auto: bool,
    engines: tuple[EngineFacts, ...] = (),
) -> AsyncIterator[NamedTensor]:
    """``expand_moe(when="auto", model_type=None)``: packed experts into per-expert keys
    (module docstring). ``model_type`` picks the family rule from :data:`RULES`.

    ``when="always"`` and ``"never"`` are obeyed. ``"auto"`` defers to the environment
    variable ``STREAMSYNC_EXPAND_MOE`` (``always``/``never``/``auto``) when it is set, and
    otherwise expands iff the engine's vLLM is ≤ 0.24.0: decided when the stream starts,
    from ``engines``, the facts of the engines the sync feeds (an engine's channel tells the
    stage them), or, with none (a plain :func:`~streamsync.send`), the vLLM installed here.
    An absent or unparsable vLLM version means "do not expand"; engines that disagree are a
    :class:`~streamsync.ConfigError`."""
    if auto and not _auto(engines):
        rule = None
    async for name, tensor in source:
        # LoRA tensors are adapters of a module, never a packed checkpoint layout.
        experts = None if rule is None or "lora_" in name else rule.expand(name, tensor)
        if experts is None:
            yield name, tensor
        else:
            for part, view in experts:
                yield part, view
                del view
        # Hold nothing of this tensor while the source makes the next one.
        del experts, tensor
