"""Every use of vLLM's private code, where it offers no public hook, in one place:

- LoRA adapters from memory: vLLM's worker reads an adapter only from disk
  (``WorkerLoRAManager._load_adapter``; a ``LoRARequest`` carries no tensors, and LoRA
  resolvers only map a name to a path), and checks it with three private validators.
- The layerwise reload's records (``LAYERWISE_INFO``): the tensors a half-loaded layer
  holds, and putting an aborted layer back (``_place_kernel_tensors``).
- The CPU build's MoE prepack kernel (``vllm._custom_ops``).
- The recording fakes of ``sharded_rdt`` and its engine's helpers that stamp each loader
  and restore the model after a dry run (``_install_recording_stamps``,
  ``_restore_after_dry_run``): what each worker's loaders read of each checkpoint tensor.

Importing it raises :class:`~streamsync.errors.UnsupportedVersionError` on a vLLM outside
:data:`TESTED`, the versions this code was read against and tested with.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from streamsync._versions import check_tested, vllm_version

#: The vLLM versions this module was tested with: from the first, up to but not the second.
TESTED: tuple[tuple[int, int, int], tuple[int, int, int]] = ((0, 32, 0), (0, 33, 0))
#: Raise :class:`~streamsync.errors.UnsupportedVersionError` unless a version is in
#: :data:`TESTED`.
check_version = functools.partial(check_tested, "vLLM", tested=TESTED)

check_version(vllm_version())


# LoRA -------------------------------------------------------------------------------------


def adapter_manager(worker_manager: Any) -> Any:
    """The ``LoRAModelManager`` (the LoRA layers) of vLLM's ``WorkerLoRAManager``."""
    return worker_manager._adapter_manager


def validate_lora(adapters: Any, lora: Any) -> None:
    """vLLM's own checks of a built ``LoRAModel`` against its ``LoRAModelManager``, as its
    loader runs them after reading an adapter from disk."""
    adapters._validate_moe_lora_format(lora)
    adapters._validate_modules_to_save(lora)
    adapters._validate_token_classification_lora(lora)


#: What answers an adapter load: called with vLLM's ``WorkerLoRAManager`` and the
#: ``LoRARequest``, the adapter built for it, or ``None`` to leave it to the next source,
#: then to vLLM (which reads the request's path from disk).
LoraSource = Callable[[Any, Any], Any]


class _AdapterLoads:
    """vLLM's adapter loader, wrapped once per process to ask the live sources first. It is
    handed nothing of ours, so the sources (one per worker that synced an adapter, answering
    for its own manager only) are held here, weakly, so they die with their worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: weakref.WeakSet[LoraSource] = weakref.WeakSet()
        self._wrapped: Any = None

    def add(self, source: LoraSource) -> None:
        from vllm.lora.worker_manager import WorkerLoRAManager

        with self._lock:
            self._sources.add(source)
            if self._wrapped is not None:
                return
            original = WorkerLoRAManager._load_adapter

            @functools.wraps(original)
            def _load_adapter(manager: Any, lora_request: Any) -> Any:
                with self._lock:
                    sources = list(self._sources)
                for source in sources:
                    lora = source(manager, lora_request)
                    if lora is not None:
                        return lora
                return original(manager, lora_request)

            self._wrapped = WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign,assignment]


_adapter_loads = _AdapterLoads()


def answer_adapter_loads(source: LoraSource) -> None:
    """Have vLLM's adapter loader ask ``source`` first, for as long as ``source`` lives."""
    _adapter_loads.add(source)


# Layerwise reload -------------------------------------------------------------------------


def _layerwise() -> Any:
    from vllm.model_executor.model_loader.reload import layerwise

    return layerwise


def is_recorded(model: torch.nn.Module) -> bool:
    """Whether vLLM recorded ``model``'s layers for a layerwise reload."""
    info = _layerwise().LAYERWISE_INFO
    return any(m in info for m in model.modules())


def replace_pending(replace: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Put ``replace(tensor)`` in place of each tensor a layer still waiting for weights
    holds (every layer of this process: vLLM's records keep the loader's arguments until
    the layer is complete)."""
    for info in list(_layerwise().LAYERWISE_INFO.values()):
        if not info.loaded_weights:
            continue
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and key != "param":
                    bound.arguments[key] = replace(value)


def layers_waiting(
    model: torch.nn.Module,
) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    """Each layer of ``model`` given part of its weights in this reload, with vLLM's record
    of it (``load_numel``, ``load_numel_total``, ``loaded_weights``)."""
    info_of = _layerwise().LAYERWISE_INFO
    for prefix, layer in model.named_modules():
        info = info_of.get(layer)
        if info is None or info.load_numel_total is None or info.load_numel <= 0:
            continue
        yield prefix, layer, info


def put_back(model: torch.nn.Module) -> None:
    """Put every layer of ``model`` still waiting for weights back on its processed tensors
    (its previous weights), and end vLLM's reload of it."""
    layerwise = _layerwise()
    for module in model.modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(module, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()
    original = getattr(model, "_original_do_torchao_reload", None)
    if original is not None:
        model._do_torchao_reload = original


# Recording fakes --------------------------------------------------------------------------

#: An op chain as the fakes record it: ``(op, args, kwargs)`` per view op, in order.
OpChain = tuple[tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]], ...]


def recorded_reads(
    model: torch.nn.Module, manifest: dict[str, tuple[str, tuple[int, ...]]]
) -> tuple[dict[str, list[OpChain]], dict[str, str]]:
    """Drive ``model.load_weights`` over recording fakes of ``manifest`` (name: dtype,
    shape), as ``sharded_rdt``'s bake does, one name at a time so a loader the fakes cannot
    follow costs only that name. Returns per name the op chains its loaders copy from, and
    the names that cannot be learned, with why. Nothing is loaded: the layers go to meta
    and are put back, whatever happens."""
    from vllm.distributed.weight_transfer.sharded_rdt_engine import (
        ShardedRDTWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor

    layerwise = _layerwise()
    if not is_recorded(model):
        layerwise.record_metadata_for_reloading(model)
    device = next(model.parameters()).device
    # The engine class lends its bake helpers; nothing of its transfer side is touched.
    bake = object.__new__(ShardedRDTWeightTransferEngine)
    bake.model, bake.device = model, device
    recorder, whole = BakeSink(), {}
    layerwise.initialize_layerwise_reload(model)
    try:
        bake._install_recording_stamps(model, recorder)
        for name, (dtype, shape) in manifest.items():
            fake = FakeRDTTensor(
                name=name,
                shape=torch.Size(shape),
                dtype=getattr(torch, dtype),
                device=device,
                sink=recorder,
            )
            try:
                model.load_weights([(name, fake)])  # type: ignore[operator]
            except Exception as exc:  # the fakes refuse an op: NotImplementedError
                whole[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        bake._restore_after_dry_run(model)
    chains: dict[str, list[OpChain]] = {}
    for copies in recorder.copies_by_layer.values():
        if any(c is None for c in copies):  # a copy no loader's stamp can attribute
            for c in copies:
                if c is not None:
                    whole.setdefault(c.src[0], "a copy_ outside the parameter's loader")
            continue
        for c in copies:
            if c is not None:
                chains.setdefault(c.src[0], []).append(c.src[1])
    for name in recorder.copied_names - chains.keys():
        whole.setdefault(name, "a copy_ outside the parameter's loader")
    return {n: c for n, c in chains.items() if n not in whole}, whole


# CPU kernels ------------------------------------------------------------------------------


def cpu_prepack_moe_weight(weight: torch.Tensor, isa: Any) -> torch.Tensor:
    """The CPU build's grouped-GEMM layout of an MoE weight."""
    from vllm._custom_ops import cpu_prepack_moe_weight as prepack

    return prepack(weight, isa)  # type: ignore[no-any-return]


def uses_zentorch(experts: Any) -> bool:
    """Whether the CPU MoE experts run on zentorch (which packs its own weights)."""
    return bool(getattr(experts, "_use_zentorch", False))
