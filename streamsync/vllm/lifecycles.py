"""Lifecycles: how a vLLM model instance is prepared, loaded and finalized, registered by
name. Workers choose one by name (``worker_options={"lifecycle": ...}``), so register your
own in a module the worker process imports too.

A lifecycle may also have ``abort(inst)``: after a sync that failed between prepare and
finalize, leave the instance able to serve (:meth:`~streamsync.vllm.sink.VllmSink.abort`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from streamsync._copies import clone
from streamsync.boxes import BoxTensor
from streamsync.errors import ConfigError, ReceiverFailedError, UnsupportedVersionError
from streamsync.pipeline import NamedTensor

if TYPE_CHECKING:
    from streamsync.vllm.sink import ModelInstance


class Lifecycle(Protocol):
    """How one instance is prepared, loaded and finalized."""

    name: str

    def prepare(self, inst: ModelInstance) -> None: ...

    def load(self, inst: ModelInstance, tensors: Sequence[NamedTensor]) -> set[str]: ...

    def finalize(self, inst: ModelInstance) -> None: ...


#: Every known lifecycle class, by name, in order of preference.
LIFECYCLES: dict[str, type[Lifecycle]] = {}

L = TypeVar("L", bound=type[Lifecycle])


def register_lifecycle(cls: L) -> L:
    """Add a lifecycle class (a ``name`` and a constructor without arguments that raises
    :class:`ImportError` where the installed vLLM lacks what it needs); a class decorator.
    Registration order is the order :func:`choose_lifecycle` tries them in."""
    LIFECYCLES[cls.name] = cls
    return cls


@register_lifecycle
class LayerwiseReload:
    """vLLM's layerwise reload: layers are re-materialised in checkpoint layout, loaded, and
    processed (repacked, quantized) into their original storage as soon as complete, so
    captured graphs stay valid."""

    name = "layerwise-reload"

    def __init__(self) -> None:
        from vllm.model_executor.model_loader import reload

        from streamsync.vllm import _compat

        self._reload = reload
        self._compat = _compat
        # The copies this lifecycle made of pending tensors, by id (each kept alive here, so
        # no id is reused while it is listed).
        self._owned: dict[int, torch.Tensor] = {}

    def prepare(self, inst: ModelInstance) -> None:
        # Metadata is recorded when vLLM loads the model; record it if it was not.
        if not self._compat.is_recorded(inst.model):
            self._reload.record_metadata_for_reloading(inst.model)
        self._reload.initialize_layerwise_reload(inst.model)
        self._owned = {}

    def load(self, inst: ModelInstance, tensors: Sequence[NamedTensor]) -> set[str]:
        loaded = set(inst.model.load_weights(tensors))  # type: ignore[operator]
        # A layer whose weights straddle buckets keeps the tensors it was given until it is
        # complete: views of a transport slot about to be reused, so copied now. vLLM's
        # records find them at a tenth of the cost of walking the model's modules.
        self._compat.replace_pending(self._own)
        return loaded

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` if this lifecycle copied it already, else its copy (of a received box,
        a BoxTensor around a copy of the box)."""
        if id(tensor) in self._owned:
            return tensor
        owned = tensor.clone() if isinstance(tensor, BoxTensor) else clone(tensor)
        self._owned[id(owned)] = owned
        return owned

    def finalize(self, inst: ModelInstance) -> None:
        _require_whole_layers(inst)
        self._reload.finalize_layerwise_reload(inst.model, inst.model_config)
        self._owned = {}

    def abort(self, inst: ModelInstance) -> None:
        """Put every layer still waiting for weights back on its processed tensors (the
        old weights; layers that completed keep the new ones). Finalizing instead would
        process the incomplete layers from uninitialised memory, and leaving them would
        leave meta tensors in the model, which kills the engine at its next step."""
        self._compat.put_back(inst.model)
        self._owned = {}


def _require_whole_layers(inst: ModelInstance) -> None:
    """Refuse to finalize a layer that was given part of its weights: vLLM would process it
    from fresh, uninitialised memory for the rest. Raised before anything is processed, so
    :meth:`LayerwiseReload.abort` puts every waiting layer back on its old weights."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    from streamsync.vllm import _compat

    # Layers given none of their weights are not listed: they keep their old ones.
    for prefix, layer, info in _compat.layers_waiting(inst.model):
        if is_deferred_attention_layer(layer) or info.load_numel >= info.load_numel_total:
            continue
        shards: dict[str, set[object]] = {}
        for name, bound in info.loaded_weights:
            shards.setdefault(name, set()).add(bound.arguments.get("loaded_shard_id"))
        gaps = [
            f"{prefix}.{name}"
            for name, _ in layer.named_parameters(recurse=False)
            if name not in SKIP_LOAD_TENSORS and name not in shards
        ]
        expected = _stacked_shards(layer)
        if expected is not None:
            for name, got in shards.items():
                missing = [s for s in expected if s not in got]
                if missing and None not in got:
                    gaps.append(f"{prefix}.{name} (shards {', '.join(map(str, missing))})")
        if gaps:
            raise ReceiverFailedError(
                f"model instance {inst.name!r}: layer {prefix!r} got part of its weights "
                f"({info.load_numel} of {info.load_numel_total} elements); nothing was sent "
                f"for {', '.join(gaps)}. Send every tensor of a layer in the same sync. Layers "
                "completed before this one keep the new weights, the others their previous ones"
            )


def _stacked_shards(layer: torch.nn.Module) -> list[object] | None:
    """The shard ids a fused linear's weight is loaded in (q/k/v, gate/up), or ``None``."""
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )

    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return None


@register_lifecycle
class DirectLoad:
    """``load_weights`` into the live parameters, then ``process_weights_after_loading``.
    Only correct where processing is idempotent on the checkpoint layout (older vLLM on GPU,
    unquantized); on the CPU build of vLLM 0.32 it corrupts repacked linears."""

    name = "direct-load"

    def prepare(self, inst: ModelInstance) -> None:
        pass

    def load(self, inst: ModelInstance, tensors: Sequence[NamedTensor]) -> set[str]:
        return set(inst.model.load_weights(tensors))  # type: ignore[operator]

    def finalize(self, inst: ModelInstance) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        device = next(inst.model.parameters()).device
        process_weights_after_loading(inst.model, inst.model_config, device)

    def abort(self, inst: ModelInstance) -> None:
        """What was loaded is in place: process it, as finalize does."""
        self.finalize(inst)


def choose_lifecycle(name: str | None = None) -> Lifecycle:
    """The named lifecycle, or the first registered one the installed vLLM offers."""
    if name is not None:
        try:
            cls = LIFECYCLES[name]
        except KeyError:
            raise ConfigError(
                f"unknown lifecycle {name!r}; valid: {', '.join(LIFECYCLES)}"
            ) from None
        return cls()
    for cls in LIFECYCLES.values():
        try:
            return cls()
        except UnsupportedVersionError:
            raise  # a vLLM whose internals were not tested: no quiet fallback
        except ImportError:
            continue
    raise ConfigError(
        f"no registered lifecycle works with this vLLM; tried {', '.join(LIFECYCLES)}"
    )
