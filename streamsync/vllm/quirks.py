"""Backend quirks: small named fix-ups after the lifecycle, registered per backend and
vLLM version. Each has a test that fails without it (``tests/test_vllm_moe.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from streamsync._log import log
from streamsync._versions import vllm_version
from streamsync.errors import ConfigError

if TYPE_CHECKING:
    from streamsync.vllm.sink import ModelInstance


class Quirk(Protocol):
    """A named fix-up: ``applies()`` says whether the installed vLLM and platform need it;
    ``after_finalize`` runs after the lifecycle's finalize, and after an aborted sync."""

    name: str

    def applies(self) -> bool: ...

    def after_finalize(self, inst: ModelInstance) -> None: ...


class CpuMoePrepack:
    """vLLM's unquantized MoE method skips the CPU experts' grouped-gemm prepack when it
    processes weights a second time (it takes that path as "a weight update: copy into the
    existing storage"), so a reloaded MoE layer computes with unpacked weights. After
    finalize, prepack each *reloaded* layer's ``w13_weight``/``w2_weight`` again, in place."""

    name = "cpu-moe-prepack"

    def applies(self) -> bool:
        from vllm.platforms import current_platform

        return (vllm_version() or (0, 0, 0)) >= (0, 25, 0) and bool(current_platform.is_cpu())

    def after_finalize(self, inst: ModelInstance) -> None:
        from streamsync.vllm._compat import cpu_prepack_moe_weight

        repacked = 0
        for prefix, layer, experts in _cpu_moe_layers(inst.model):
            if f"{prefix}.w13_weight" not in inst.loaded:
                continue  # not reloaded in this sync: still prepacked
            for name in ("w13_weight", "w2_weight"):
                param = getattr(layer, name)
                param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
            repacked += 1
        if repacked:
            log("vllm.quirk", quirk=self.name, instance=inst.name, layers=repacked)


def _cpu_moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return
    from streamsync.vllm._compat import uses_zentorch

    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not uses_zentorch(experts):
            yield prefix, module, experts


#: Every known quirk, by name.
QUIRKS: dict[str, Quirk] = {}


def register_quirk(quirk: Quirk) -> Quirk:
    """Add a quirk to the registry (users may register their own)."""
    QUIRKS[quirk.name] = quirk
    return quirk


register_quirk(CpuMoePrepack())


def active_quirks() -> list[Quirk]:
    """The quirks the installed vLLM and platform need."""
    return [q for q in QUIRKS.values() if q.applies()]


def quirks_by_name(names: Sequence[str]) -> list[Quirk]:
    """Quirks chosen explicitly (``[]`` disables all: how the tests show each is needed)."""
    try:
        return [QUIRKS[name] for name in names]
    except KeyError as exc:
        raise ConfigError(f"unknown quirk {exc.args[0]!r}; known: {', '.join(QUIRKS)}") from None
