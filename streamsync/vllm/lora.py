"""LoRA adapters on the worker side: built from the tensors a sync carried, never from disk.

At ``finalize`` a :class:`LoraSink` builds the adapter as vLLM's loader does and checks every
module and shape against the engine's LoRA layers, so a bad adapter fails by name on every
worker before any is installed; then it stages the version in the worker's
:class:`LoraStore`. The trainer installs it with vLLM's own ``add_lora`` once every worker
has staged; vLLM reads adapters from disk only, so the store answers its loads (also the
reloads after its LRU cache or ``reset_lora_state`` dropped one) for the path reserved for
each version (:func:`~streamsync.lora.version_path`). A path per version keeps vLLM's prefix
cache, keyed on name and path, from serving an old version's KV for a new one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from streamsync._log import log, warn
from streamsync.engine.messages import LoraTarget
from streamsync.errors import LoraError
from streamsync.lora import lora_id, path_version
from streamsync.pipeline import NamedTensor
from streamsync.report import LoadResult

if TYPE_CHECKING:
    from streamsync.vllm.sink import WorkerState


def lora_request(name: str, lora_id: int, path: str, *, load_inplace: bool = False) -> Any:
    """vLLM's ``LoRARequest`` for adapter ``name``'s version at ``path`` (``load_inplace``:
    the engine replaces what it holds under ``lora_id``)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, path, load_inplace=load_inplace)


@dataclass
class _Version:
    """One staged version: the adapter's tensors and config, and the ``LoRAModel`` checked at
    staging, handed to vLLM at the first load (each later load builds afresh: vLLM scales
    what it is given in place)."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    built: Any = None
    #: vLLM loaded it (it serves, or served): a version staged by a sync that failed on
    #: another worker never is.
    loaded: bool = False


NO_LORA = (
    "the engine was started without LoRA: start it with enable_lora=True "
    "(the server: --enable-lora), with max_lora_rank at least the adapter's rank"
)


@dataclass(frozen=True)
class LoraEngine:
    """What building an adapter needs of one worker: its LoRA model manager (the LoRA
    layers), its LoRA config, and the numbers vLLM's loader passes."""

    adapters: Any
    lora_config: Any
    vocab_size: int | None
    max_position_embeddings: int | None

    @classmethod
    def of_model(cls, model: Any, vllm_config: Any) -> LoraEngine:
        """From the main model a worker serves (vLLM's LoRA manager hangs on it) and the
        worker's config; a :class:`LoraError` naming ``enable_lora`` when it serves no LoRA."""
        adapters = getattr(model, "lora_manager", None)
        lora_config = getattr(vllm_config, "lora_config", None)
        if adapters is None or lora_config is None:
            raise LoraError(NO_LORA)
        model_config = vllm_config.model_config
        text = model_config.hf_config.get_text_config()
        # What vLLM's worker passes its loader: an encoder-decoder's target positions.
        positions = "max_target_positions" if model_config.is_encoder_decoder else ""
        return cls(
            adapters,
            lora_config,
            model_config.get_vocab_size(),
            getattr(text, positions or "max_position_embeddings", None),
        )


class LoraStore:
    """One worker's staged adapter versions (name -> {sync version: version}, newest last),
    staged into on the receive thread and read on vLLM's engine thread, under one lock."""

    def __init__(self, engine: LoraEngine) -> None:
        from streamsync.vllm import _compat

        self.engine = engine
        self._lock = threading.Lock()
        self._adapters: dict[str, dict[int, _Version]] = {}
        _compat.answer_adapter_loads(self)

    def __call__(self, worker_manager: Any, request: Any) -> Any:
        """The ``LoRAModel`` for vLLM's ``request``, or ``None`` when it is for another
        worker's LoRA layers or its path is not one of streamsync's (vLLM's own loader
        reads it)."""
        from vllm.exceptions import LoRAAdapterNotFoundError

        from streamsync.vllm import _compat

        name = request.lora_name
        version = path_version(name, request.lora_path)
        if version is None or _compat.adapter_manager(worker_manager) is not self.engine.adapters:
            return None
        with self._lock:
            versions = self._adapters.get(name)
            if not versions:
                raise LoRAAdapterNotFoundError(name, request.lora_path)
            entry = versions.get(version)
            if entry is None:
                # A request older than the versions kept (it outlived two updates): the newest.
                newest = next(reversed(versions))
                warn("lora.old_version", name=name, version=version, now=newest)
                entry = versions[newest]
            lora, entry.built = entry.built, None
            entry.loaded = True
        if lora is None:
            lora = build(self.engine, request.lora_int_id, entry.tensors, entry.config)
        lora.id = request.lora_int_id
        lora.is_3d_lora_weight = bool(getattr(request, "is_3d_lora_weight", False))
        return lora

    def held(self) -> list[str]:
        """The adapters vLLM has loaded a version of, sorted."""
        with self._lock:
            return sorted(n for n, v in self._adapters.items() if any(e.loaded for e in v.values()))

    def stage(self, name: str, version: int, entry: _Version, keep: Sequence[int]) -> int:
        """Stage ``entry`` as ``version`` of adapter ``name``, dropping the versions other
        than those in ``keep``; how many versions of ``name`` are now staged."""
        with self._lock:
            versions = self._adapters.setdefault(name, {})
            for old in [v for v in versions if v != version and v not in keep]:
                del versions[old]
            versions[version] = entry
            return len(versions)

    def remove(self, name: str) -> None:
        """Drop every version of adapter ``name``."""
        with self._lock:
            self._adapters.pop(name, None)


def build(
    engine: LoraEngine, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Any:
    """The ``LoRAModel`` of one adapter, as vLLM's loader builds it from disk (the engine's
    rank and feature checks, its name mapping and skipped prefixes), from copies of
    ``tensors`` (vLLM scales ``lora_B`` in place when it installs)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from streamsync.vllm import _compat

    adapters = engine.adapters
    try:
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": engine.max_position_embeddings}
        )
        helper.validate_legal(engine.lora_config)
    except (ValueError, TypeError) as exc:
        raise LoraError(f"LoRA config: {exc}") from None
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    try:
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors={k: v.detach().clone() for k, v in tensors.items()},
            peft_helper=helper,
            device="cpu",
            dtype=engine.lora_config.lora_dtype,
            model_vocab_size=engine.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        _compat.validate_lora(adapters, lora)
    except (ValueError, RuntimeError) as exc:
        raise LoraError(f"LoRA adapter: {exc}") from None
    return lora


def check(engine: LoraEngine, lora: Any) -> None:
    """Check a built adapter against this engine's LoRA layers, without changing it: every
    module must be one the engine adapts, each A must have its config's rank, and every A and
    B must fill its slot exactly as the layer will copy it in (vLLM copies a smaller one
    partly, without a word, and fails midway on a larger one). Raises :class:`LoraError`
    naming the module."""
    adapters = engine.adapters
    for module, weights in lora.loras.items():
        first = weights.lora_a
        if torch.is_tensor(first) and first.shape[0] != weights.rank:
            raise LoraError(
                f"LoRA module {module!r}: lora_A has rank {first.shape[0]}, but the adapter's "
                f"config gives it r={weights.rank}"
            )
    packed: dict[str, list[str]] = dict(adapters.packed_modules)
    parts = {sub for subs in packed.values() for sub in subs}
    unknown = sorted(m for m in lora.loras if m not in adapters.modules and m not in parts)
    if unknown:
        shown = ", ".join(repr(m) for m in unknown[:6]) + (" ..." if len(unknown) > 6 else "")
        raise LoraError(
            f"the adapter targets {len(unknown)} module(s) this engine's model has no LoRA "
            f"layer for: {shown}"
        )
    for module, layer in adapters.modules.items():
        if module.endswith(".experts"):
            continue  # MoE: vLLM's own checks
        subs = packed.get(module)
        if subs:
            found = [lora.loras.get(sub) for sub in subs]
            if not any(found):
                continue
            a: Any = [w.lora_a if w else None for w in found]
            b: Any = [w.lora_b if w else None for w in found]
        else:
            weights = lora.loras.get(module)
            if weights is None:
                continue
            a, b = weights.lora_a, weights.lora_b
        _check_fit(module, layer, a, b)


def _check_fit(module: str, layer: Any, a: Any, b: Any) -> None:
    a_stacked = getattr(layer, "lora_a_stacked", None)
    b_stacked = getattr(layer, "lora_b_stacked", None)
    if not isinstance(a_stacked, Sequence) or not isinstance(b_stacked, Sequence):
        return  # embeddings, MoE: vLLM's own checks
    # What the layer's set_lora copies into its slots, prepared as it prepares it.
    if torch.is_tensor(a) != torch.is_tensor(b):
        return
    if torch.is_tensor(a) and len(a_stacked) != 1:
        return  # a layer that splits one tensor itself
    if not torch.is_tensor(b) and len(b) != len(b_stacked) and hasattr(layer, "expand_packed_lora"):
        a, b = layer.expand_packed_lora(a, b)
    if getattr(layer, "tp_size", 1) > 1:
        a, b = layer.slice_lora_a(a), layer.slice_lora_b(b)
    if torch.is_tensor(a):
        a, b = [a], [b]
    for i, (a_i, b_i) in enumerate(zip(a, b, strict=False)):
        if a_i is None or b_i is None or i >= len(a_stacked):
            continue
        # Slots: A is (loras, 1, rank, in), B is (loras, 1, out, rank).
        slot_a, slot_b = a_stacked[i].shape, b_stacked[i].shape
        rank = a_i.shape[0]
        fits = (
            a_i.dim() == 2
            and b_i.dim() == 2
            and rank <= slot_a[-2]
            and a_i.shape[1] == slot_a[-1]
            and b_i.shape == (slot_b[-2], rank)
        )
        if not fits:
            raise LoraError(
                f"LoRA module {module!r} (slice {i}): A {tuple(a_i.shape)} and B "
                f"{tuple(b_i.shape)} do not fit the engine's layer (in {slot_a[-1]}, out "
                f"{slot_b[-2]}, rank at most {slot_a[-2]} on this worker); the adapter was "
                "trained on another base model"
            )


class LoraSink:
    """The sink of one LoRA sync on one vLLM worker (see the module). The base weights are
    untouched, so its version is the base's."""

    def __init__(self, engine: LoraEngine, target: LoraTarget, state: WorkerState) -> None:
        self.engine = engine
        self.lora = target
        self.state = state
        self._tensors: dict[str, torch.Tensor] = {}

    @property
    def version(self) -> int | None:
        """The version the worker's main model holds."""
        return self.state.versions.get("main")

    @version.setter
    def version(self, version: int | None) -> None:
        pass  # an adapter sync leaves the base weights as they are

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Nothing to land in: an adapter is staged, then copied (a sink that reports its
        version is a target sink)."""
        return None

    def prepare(self) -> None:
        self._tensors = {}

    def load(self, tensors: Sequence[NamedTensor]) -> None:
        for name, tensor in tensors:
            if name in self._tensors:
                raise LoraError(f"LoRA tensor {name!r} arrived twice in one adapter sync")
            if not tensor.is_floating_point() or tensor.element_size() < 2:
                raise LoraError(
                    f"LoRA tensor {name!r} arrived as {tensor.dtype}: an adapter syncs in a "
                    "float dtype (the channel's pipeline quantizes it? pass "
                    "update_lora(..., pipeline=...) for the adapter)"
                )
            self._tensors[name] = tensor.clone()  # a view of the transport's slot

    def finalize(self) -> LoadResult:
        target = self.lora
        store = self.state.lora
        if store is None or store.engine.adapters is not self.engine.adapters:
            store = self.state.lora = LoraStore(self.engine)
        if target.remove:
            store.remove(target.name)
            return LoadResult()
        config = self.engine.lora_config
        limit = config.max_cpu_loras or config.max_loras
        held = store.held()
        if target.name not in held and len(held) + 1 > limit:
            raise LoraError(
                f"LoRA adapter {target.name!r} would be adapter {len(held) + 1} on an engine "
                f"that holds {limit} (max_cpu_loras, default max_loras): remove one first "
                f"(remove_lora), or start the engine with more; it holds {held}"
            )
        try:
            built = build(self.engine, lora_id(target.name), self._tensors, target.config)
            check(self.engine, built)
        except LoraError:
            raise
        except Exception as exc:  # vLLM's own code, on an adapter it did not expect
            raise LoraError(
                f"LoRA adapter {target.name!r} could not be checked against the engine: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        entry = _Version(self._tensors, dict(target.config), built)
        versions = store.stage(target.name, target.version, entry, target.keep)
        log(
            "lora.staged",
            name=target.name,
            version=target.version,
            tensors=len(self._tensors),
            versions=versions,
        )
        names = tuple(sorted(self._tensors))
        self._tensors = {}
        return LoadResult(loaded=names)
