"""``VllmSink``: the three-phase lifecycle on every model instance of a vLLM worker.

A worker serves a main model and, with speculative decoding, a drafter. Every bucket goes to
every instance; each loads the names it knows. The phases are carried out by a
:class:`Lifecycle` strategy chosen by what the installed vLLM offers:

- :class:`LayerwiseReload` (vLLM with ``model_executor/model_loader/reload``): restore each
  layer's checkpoint layout, buffer its weights as they stream in, re-run
  ``process_weights_after_loading`` per layer and copy the result into the *same storage*
  (captured graphs stay valid).
- :class:`DirectLoad` (older vLLM): ``load_weights`` straight into the live parameters, then
  ``process_weights_after_loading`` once at the end.

Backend quirks are small named fix-ups (:mod:`streamsync.vllm.quirks`) applied around the
phases. Buffer updates (names the instances register as buffers, or that the sender declared
with :func:`~streamsync.adapters.split_buffers`) bypass ``load_weights``: they are kept until
the lifecycle has finished (reloading re-materialises layers and would overwrite them) and
then copied in place into every instance by the
:class:`~streamsync.adapters.split_buffers.BufferRouter`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from streamsync._log import log
from streamsync.adapter import NamedTensor
from streamsync.adapters.split_buffers import MANIFEST_NAME, BufferRouter
from streamsync.errors import ConfigError
from streamsync.report import LoadResult

__all__ = [
    "DirectLoad",
    "LayerwiseReload",
    "Lifecycle",
    "ModelInstance",
    "VllmSink",
    "choose_lifecycle",
    "model_instances",
]


@dataclass
class ModelInstance:
    """One model a worker serves: ``"main"`` or ``"drafter"``."""

    name: str
    model: torch.nn.Module
    model_config: Any = None
    #: Names this instance takes; ``None`` means it is offered every name.
    accepts: Callable[[str], bool] | None = None
    loaded: set[str] = field(default_factory=set)
    offered: set[str] = field(default_factory=set)


def model_instances(worker: Any) -> list[ModelInstance]:
    """The main model and, if speculative decoding has one, the drafter of a vLLM worker."""
    runner = worker.model_runner
    instances = [ModelInstance("main", runner.get_model(), worker.vllm_config.model_config)]
    drafter = getattr(runner, "drafter", None)
    draft_model = getattr(drafter, "model", None)
    if isinstance(draft_model, torch.nn.Module):
        spec = worker.vllm_config.speculative_config
        config = getattr(spec, "draft_model_config", None) or worker.vllm_config.model_config
        instances.append(ModelInstance("drafter", draft_model, config))
    return instances


class Lifecycle(Protocol):
    """How one instance is prepared, loaded and finalized."""

    name: str

    def prepare(self, inst: ModelInstance) -> None: ...

    def load(self, inst: ModelInstance, tensors: Sequence[NamedTensor]) -> set[str]: ...

    def finalize(self, inst: ModelInstance) -> None: ...


class LayerwiseReload:
    """vLLM's layerwise reload: layers are re-materialised in checkpoint layout, loaded, and
    processed (repacked, quantized) into their original storage as soon as complete."""

    name = "layerwise-reload"

    def __init__(self) -> None:
        from vllm.model_executor.model_loader import reload

        self._reload = reload

    def prepare(self, inst: ModelInstance) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        # Metadata is recorded when vLLM loads the model; record it if it was not.
        if not any(m in LAYERWISE_INFO for m in inst.model.modules()):
            self._reload.record_metadata_for_reloading(inst.model)
        self._reload.initialize_layerwise_reload(inst.model)

    def load(self, inst: ModelInstance, tensors: Sequence[NamedTensor]) -> set[str]:
        loaded = set(inst.model.load_weights(tensors))  # type: ignore[operator]
        self._detach_pending(inst.model)
        return loaded

    @staticmethod
    def _detach_pending(model: torch.nn.Module) -> None:
        # A layer whose weights straddle buckets keeps the tensors it was given until it is
        # complete; those are views of a transport slot that is about to be reused. Copy
        # them now (only the pending layer's tensors, typically one layer's worth).
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for module in model.modules():
            info = LAYERWISE_INFO.get(module)
            if info is None or not info.loaded_weights:
                continue
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and key != "param"
                        and not getattr(value, "_streamsync_owned", False)
                    ):
                        owned = value.clone()
                        owned._streamsync_owned = True  # type: ignore[attr-defined]
                        bound.arguments[key] = owned

    def finalize(self, inst: ModelInstance) -> None:
        self._reload.finalize_layerwise_reload(inst.model, inst.model_config)


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


_LIFECYCLES: dict[str, Callable[[], Lifecycle]] = {
    LayerwiseReload.name: LayerwiseReload,
    DirectLoad.name: DirectLoad,
}


def choose_lifecycle(name: str | None = None) -> Lifecycle:
    """The named lifecycle, or the best one the installed vLLM offers."""
    if name is not None:
        try:
            return _LIFECYCLES[name]()
        except KeyError:
            raise ConfigError(
                f"unknown lifecycle {name!r}; valid: {', '.join(_LIFECYCLES)}"
            ) from None
    try:
        return LayerwiseReload()
    except ImportError:
        return DirectLoad()


class VllmSink:
    """A sink that applies each sync to every model instance of one vLLM worker."""

    def __init__(
        self,
        instances: Sequence[ModelInstance],
        *,
        lifecycle: Lifecycle | None = None,
        vllm_config: Any = None,
        quirks: Sequence[Any] | None = None,
    ) -> None:
        if not instances:
            raise ConfigError("VllmSink needs at least one model instance")
        from streamsync.vllm.quirks import active_quirks

        self.instances = list(instances)
        self.lifecycle = lifecycle or choose_lifecycle()
        self.vllm_config = vllm_config
        self.quirks = list(quirks) if quirks is not None else active_quirks()
        self._router = BufferRouter({inst.name: inst.model for inst in self.instances})
        self._buffers: list[NamedTensor] = []

    @classmethod
    def from_worker(
        cls,
        worker: Any,
        *,
        lifecycle: str | None = None,
        quirks: Sequence[str] | None = None,
        instances: Sequence[str] | None = None,
    ) -> VllmSink:
        """The sink for a vLLM worker (what ``WorkerExtension`` uses)."""
        from streamsync.vllm.quirks import quirks_by_name

        found = model_instances(worker)
        if instances is not None:
            found = [inst for inst in found if inst.name in instances]
        return cls(
            found,
            lifecycle=choose_lifecycle(lifecycle),
            vllm_config=worker.vllm_config,
            quirks=quirks_by_name(quirks) if quirks is not None else None,
        )

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        if self.vllm_config is None:
            yield
            return
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            yield

    def prepare(self) -> None:
        with self._context():
            self._router.begin()
            self._buffers = []
            for inst in self.instances:
                inst.loaded = set()
                inst.offered = set()
                for quirk in self.quirks:
                    quirk.before_prepare(inst)
                self.lifecycle.prepare(inst)

    def load(self, tensors: Sequence[NamedTensor]) -> None:
        with self._context():
            params: list[NamedTensor] = []
            for name, tensor in tensors:
                if name == MANIFEST_NAME:
                    self._router.split([(name, tensor)])  # records the declared buffers
                elif self._router.is_buffer(name):
                    self._buffers.append((name, tensor.clone()))  # a view: keep a copy
                else:
                    params.append((name, tensor))
            for inst in self.instances:
                offered = [(n, t) for n, t in params if inst.accepts is None or inst.accepts(n)]
                inst.offered.update(n for n, _ in offered)
                if offered:
                    inst.loaded |= self.lifecycle.load(inst, offered)

    def finalize(self) -> LoadResult:
        per_instance: dict[str, LoadResult] = {}
        with self._context():
            for inst in self.instances:
                self.lifecycle.finalize(inst)
                for quirk in self.quirks:
                    quirk.after_finalize(inst)
            self._router.refresh()
            _, applied = self._router.split(self._buffers)
            self._buffers = []
            for inst in self.instances:
                inst.loaded.update(applied[inst.name])
                inst.offered.update(applied[inst.name])
                params = {n for n, _ in inst.model.named_parameters()}
                per_instance[inst.name] = LoadResult(
                    loaded=tuple(sorted(inst.loaded)),
                    missing=tuple(sorted(params - inst.loaded)),
                )
        main = per_instance[self.instances[0].name]
        log(
            "vllm.finalize",
            lifecycle=self.lifecycle.name,
            instances={k: len(v.loaded) for k, v in per_instance.items()},
            quirks=[q.name for q in self.quirks],
        )
        return LoadResult(loaded=main.loaded, missing=main.missing, instances=per_instance)
