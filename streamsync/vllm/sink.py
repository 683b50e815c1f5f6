"""``VllmSink``: the three-phase lifecycle on every model instance of a vLLM worker.

A worker serves a main model and, with speculative decoding, a drafter; every bucket goes to
every instance, and each loads the names it knows. The phases are a
:class:`~streamsync.vllm.lifecycles.Lifecycle`'s, with the named fix-ups of
:mod:`streamsync.vllm.quirks` around them. Buffer updates bypass ``load_weights``: they are
kept until the lifecycle has finished (reloading re-materialises layers) and then copied in
place by the :class:`~streamsync.adapters.split_buffers.BufferRouter`.

A parameter held under several names (tied embeddings) is loaded under every one of them,
since each name's layer re-processes its own copy; a later tensor under another of those
names must hold the same bytes. No parameter or buffer may be left on the meta device.

With ``delta=True`` the worker's :class:`WorkerState` keeps a host copy of every tensor
received, in checkpoint coordinates: a delta patches those copies and then loads them all
through the ordinary lifecycle, so fused, sharded, quantized and repacked layers are rebuilt
from whole checkpoint tensors as in a full sync."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from streamsync._copies import clone, copy_tensors
from streamsync._log import log, warn
from streamsync.adapters.quantize_fp8 import SCALE_SUFFIX
from streamsync.adapters.split_buffers import BufferRouter
from streamsync.boxes import BoxTensor, Slices, wrap
from streamsync.errors import (
    ConfigError,
    ReceiverFailedError,
    ShapeMismatchError,
    StreamsyncError,
    UnknownTensorError,
)
from streamsync.facts import Box, Need, Needs
from streamsync.pipeline import NamedTensor
from streamsync.report import LoadResult
from streamsync.sink import BUFFER_MANIFEST
from streamsync.vllm.lifecycles import Lifecycle, choose_lifecycle
from streamsync.vllm.quirks import active_quirks
from streamsync.vllm.slices import worker_needs

if TYPE_CHECKING:
    from streamsync.vllm.lora import LoraStore


@dataclass
class WorkerState:
    """What one vLLM worker keeps between syncs, by model instance name (``"main"``,
    ``"drafter"``): the version each instance holds, and the checkpoint-coordinate copies a
    delta-tracking sink patches, and the adapter versions LoRA syncs staged. Made by the
    worker's entry point and handed to every sink it builds."""

    #: The version (sync id) each instance was last completely synced to.
    versions: dict[str, int] = field(default_factory=dict)
    #: Per instance, the copies of every tensor it received (``delta=True`` only).
    copies: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: The adapter versions staged on this worker (made at its first adapter sync).
    lora: LoraStore | None = None
    #: What each instance reads of each checkpoint tensor (a sharded channel's).
    needs: dict[str, Needs] = field(default_factory=dict)


@dataclass
class ModelInstance:
    """One model a worker serves: ``"main"`` or ``"drafter"``."""

    name: str
    model: torch.nn.Module
    model_config: Any = None
    loaded: set[str] = field(default_factory=set)
    offered: set[str] = field(default_factory=set)
    #: Each name of a parameter the model holds under several names, with its other names
    #: (found at the first prepare).
    tied: dict[str, tuple[str, ...]] | None = None
    #: Names loaded in this sync as another name's tie, with the fingerprint of the bytes.
    tied_loaded: dict[str, tuple[str, Fingerprint, Box | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerModels:
    """What one vLLM worker serves a sync into."""

    #: The model instances a sync may target (``main``, ``drafter``).
    instances: Sequence[ModelInstance]
    #: The worker's ``VllmConfig``.
    vllm_config: Any
    #: What the worker keeps between syncs (versions held, delta copies).
    state: WorkerState


def checkpoint_name(name: str) -> str:
    """A model parameter's name as the checkpoint (and the model's loader) knows it: a layer
    vLLM wrapped for LoRA holds its weights under ``.base_layer``."""
    return name.replace(".base_layer.", ".")


def tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter ``model`` holds under several names, with the others."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(checkpoint_name(name))
    return {
        name: tuple(other for other in names if other != name)
        for names in groups.values()
        if len(names) > 1
        for name in names
    }


#: A tensor's dtype, shape and the xxh3-64 of its bytes.
Fingerprint = tuple[torch.dtype, tuple[int, ...], int]


def _fingerprint(tensor: torch.Tensor, box: Box | None = None) -> Fingerprint:
    """The fingerprint of the data received of ``tensor``: of a :class:`BoxTensor`, its box
    and the data in it; of a whole tensor seen through ``box`` (a tied partner that arrived
    as that box), the same."""
    if isinstance(tensor, BoxTensor):
        box, data = tensor.box, tensor.received
    elif box is not None:
        data = tensor[tuple(map(slice, box.start, box.stop))]
    else:
        data = tensor
    data = data.detach().contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    digest = xxhash.xxh3_64(data.reshape(-1).view(torch.uint8).numpy().data)
    if box is not None:
        digest.update(repr(box).encode())
    return data.dtype, tuple(tensor.shape), digest.intdigest()


def _with_ties(inst: ModelInstance, tensors: list[NamedTensor]) -> list[NamedTensor]:
    """``tensors`` with each tied parameter's other names added after the first name the
    sync carries; a later tensor under one of those names is checked and dropped."""
    if not inst.tied:
        return tensors
    out: list[NamedTensor] = []
    for name, tensor in tensors:
        earlier = inst.tied_loaded.get(name)
        if earlier is not None:
            first, digest, box = earlier
            if _fingerprint(tensor, box) != digest:
                raise ReceiverFailedError(
                    f"model instance {inst.name!r} ties {name!r} to {first!r} (one parameter), "
                    f"but the sync carried different values under the two names"
                )
            continue
        out.append((name, tensor))
        others = [o for o in inst.tied.get(name, ()) if o not in inst.offered]
        if others:
            digest = _fingerprint(tensor)
            for other in others:
                out.append((other, tensor))
                inst.tied_loaded[other] = (
                    name,
                    digest,
                    tensor.box if isinstance(tensor, BoxTensor) else None,
                )
    return out


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


def _require_materialised(inst: ModelInstance) -> None:
    """Fail by name if the lifecycle left a parameter or buffer of ``inst`` on the meta
    device (the engine would die at its next step)."""
    left = [
        name
        for name, tensor in (*inst.model.named_parameters(), *inst.model.named_buffers())
        if tensor.device.type == "meta"
    ]
    if left:
        shown = ", ".join(repr(n) for n in left[:8]) + (" ..." if len(left) > 8 else "")
        raise ReceiverFailedError(
            f"model instance {inst.name!r}: the sync left {len(left)} tensor(s) without "
            f"values (on the meta device): {shown}"
        )


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _require_fp8_engine(inst: ModelInstance, tensors: Sequence[NamedTensor]) -> None:
    """Refuse FP8 weights (``quantize_fp8()``'s) for an instance whose engine is not FP8,
    before any is loaded: vLLM would cast some into its weights and fail on the scales."""
    fp8 = next((n for n, t in tensors if _is_fp8(t.dtype) or n.endswith(SCALE_SUFFIX)), None)
    if fp8 is None or getattr(inst.model_config, "quantization", None) is not None:
        return
    dtypes = {p.dtype for p in inst.model.parameters()}
    if any(_is_fp8(dtype) for dtype in dtypes):
        return
    shown = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    raise ConfigError(
        f"model instance {inst.name!r}: tensor {fp8!r} is FP8 (quantize_fp8's), but the "
        f"engine's weights are not FP8 (they are {shown}): drop quantize_fp8() from the "
        "pipeline, or serve an FP8 checkpoint"
    )


#: Where a checkpoint name lands in an instance: the layer, its parameter's name there, and
#: the shard of a fused layer (``q``/``k``/``v``, ``gate``/``up``) as an index, or ``None``.
_Landing = tuple[torch.nn.Module, str, int | None]


def _landings(inst: ModelInstance) -> dict[str, _Landing]:
    """Every checkpoint name ``inst`` knows (its parameters' and, for fused layers, their
    parts' from the model's ``packed_modules_mapping``), with where it lands."""
    packed: dict[str, list[str]] = dict(getattr(inst.model, "packed_modules_mapping", {}) or {})
    out: dict[str, _Landing] = {}
    for prefix, module in inst.model.named_modules():
        prefix = checkpoint_name(f"{prefix}.").rstrip(".")
        parent, _, last = prefix.rpartition(".")
        for pname, _ in module.named_parameters(recurse=False):
            out.setdefault(f"{prefix}.{pname}".lstrip("."), (module, pname, None))
            for shard, part in enumerate(packed.get(last, ())):
                out.setdefault(f"{parent}.{part}.{pname}".lstrip("."), (module, pname, shard))
    return out


def _checkpoint_shape(landing: _Landing) -> tuple[int, ...] | None:
    """The shape a checkpoint tensor landing there has: a linear layer's full (unsharded)
    ``[out, in]`` weight and ``[out]`` bias, a shard's part of a fused one; otherwise the
    parameter's shape."""
    from vllm.model_executor.layers.linear import LinearBase

    module, pname, shard = landing
    if isinstance(module, LinearBase) and pname in ("weight", "bias"):
        sizes = getattr(module, "output_sizes", None)
        out = sizes[shard] if shard is not None and sizes else module.output_size
        return (int(out), int(module.input_size)) if pname == "weight" else (int(out),)
    return tuple(getattr(module, pname).shape) if shard is None else None


def _named_failure(
    inst: ModelInstance, name: str | None, tensor: torch.Tensor, exc: Exception
) -> StreamsyncError:
    """The error of the model's loader failing on tensor ``name``, as a plain module's sink
    names it: an unknown name with its close matches, a shape with both shapes; any other
    failure as the loader gave it, with the tensor's name."""
    landings = _landings(inst) if name is not None else {}
    landing = landings.get(name) if name is not None else None
    model = type(inst.model).__name__
    if name is not None and landing is None:
        close = difflib.get_close_matches(name, list(landings), n=3)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        return UnknownTensorError(
            f"tensor {name!r} is not a parameter or buffer of {model} (model instance "
            f"{inst.name!r}){hint}"
        )
    want = _checkpoint_shape(landing) if landing is not None else None
    if want is not None and want != tuple(tensor.shape):
        return ShapeMismatchError(
            f"tensor {name!r}: received shape {list(tensor.shape)}, the engine's is "
            f"{list(want)} (model instance {inst.name!r}, {model})"
        )
    return ReceiverFailedError(
        f"model instance {inst.name!r} could not load tensor {name!r} of shape "
        f"{tuple(tensor.shape)}: {type(exc).__name__}: {exc}"
    )


class _Tracked(list[NamedTensor]):
    """A bucket that remembers the last name its consumer took (the model's loader walks
    it; when the loader fails, that is the tensor it failed on)."""

    current: str | None = None

    def __iter__(self) -> Iterator[NamedTensor]:
        for item in super().__iter__():
            self.current = item[0]
            yield item


class VllmSink:
    """A sink that applies each sync to every model instance of one vLLM worker.

    ``slices`` (a sharded channel's, :func:`~streamsync.boxes.slices_of`): the box of each
    tensor this worker receives only in part; such a tensor reaches the loaders as a
    :class:`~streamsync.boxes.BoxTensor` of the whole shape (a delta's kept copy is
    the box)."""

    def __init__(
        self,
        instances: Sequence[ModelInstance],
        *,
        lifecycle: Lifecycle | None = None,
        vllm_config: Any = None,
        quirks: Sequence[Any] | None = None,
        delta: bool = False,
        state: WorkerState | None = None,
        slices: Slices | None = None,
    ) -> None:
        if not instances:
            raise ConfigError("VllmSink needs at least one model instance")
        self.instances = list(instances)
        self.lifecycle = lifecycle or choose_lifecycle()
        self.vllm_config = vllm_config
        self.quirks = list(quirks) if quirks is not None else active_quirks()
        self._router = BufferRouter({inst.name: inst.model for inst in self.instances})
        self._buffers: list[NamedTensor] = []
        self._prepared = False  # between prepare and finalize: what abort undoes
        self.state = state if state is not None else WorkerState()
        main = self.instances[0].name
        if delta:
            self._copies: dict[str, torch.Tensor] | None = self.state.copies.setdefault(main, {})
        else:
            self._copies = None
            self.state.copies.pop(main, None)  # a full sync without tracking: they go stale
        self._received: set[str] = set()
        #: The box of each tensor this worker receives only in part (a sharded channel's).
        self.slices = slices
        #: What a staged sync is checked against (:meth:`learn_staged`).
        self._known: dict[str, Need] | None = None
        self._tied: set[str] = set()

    @property
    def version(self) -> int | None:
        """The version every instance holds, when this sink keeps copies to patch."""
        if self._copies is None:
            return None
        held = {self.state.versions.get(inst.name) for inst in self.instances}
        return held.pop() if len(held) == 1 else None

    @version.setter
    def version(self, version: int | None) -> None:
        for inst in self.instances:
            if version is None:
                self.state.versions.pop(inst.name, None)
            else:
                self.state.versions[inst.name] = version

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The kept copy of ``name`` (allocated at its first sync) when the sink keeps
        copies: chunks and patches land in it."""
        if self._copies is None:
            return None
        copy = self.kept(name, dtype, shape)
        if copy is None:
            copy = self._copies[name] = torch.empty(shape, dtype=dtype)
        return copy

    def kept(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The kept copy of ``name`` if there is one of that dtype and shape (a staged
        delta's base: :mod:`streamsync.staging`); allocates nothing."""
        copy = None if self._copies is None else self._copies.get(name)
        if copy is None or copy.dtype != dtype or tuple(copy.shape) != shape:
            return None
        return copy

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        if self.vllm_config is None:
            yield
            return
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            yield

    def prepare(self) -> None:
        self._prepared = True
        self._received = set()
        with self._context():
            self._router.begin()
            self._buffers = []
            for inst in self.instances:
                inst.loaded = set()
                inst.offered = set()
                inst.tied_loaded = {}
                if inst.tied is None:
                    inst.tied = tied_names(inst.model)
                self.lifecycle.prepare(inst)

    def declare_buffers(self, names: frozenset[str]) -> None:
        """The trainer's buffer names, from its manifest (the receive path hands it here)."""
        self._router.declared |= names

    def load(self, tensors: Sequence[NamedTensor]) -> None:
        if self._copies is not None:
            tensors = self._keep(tensors)
        with self._context():
            params: list[NamedTensor] = []
            for name, tensor in tensors:
                if self._router.is_buffer(name):
                    self._buffers.append((name, clone(tensor)))  # a view: keep a copy
                else:
                    params.append((name, tensor))
            if self.slices:
                params = wrap(params, self.slices)
            for inst in self.instances:
                offered = _with_ties(inst, params)
                inst.offered.update(n for n, _ in offered)
                if offered:
                    _require_fp8_engine(inst, offered)
                    tracked = _Tracked(offered)
                    try:
                        inst.loaded |= self.lifecycle.load(inst, tracked)
                    except StreamsyncError:
                        raise
                    except Exception as exc:  # the model's own loader: name the tensor
                        current = tracked.current
                        tensor = dict(offered)[current] if current else torch.empty(0)
                        raise _named_failure(inst, current, tensor, exc) from exc

    def _keep(self, tensors: Sequence[NamedTensor]) -> list[NamedTensor]:
        """Each tensor as its kept copy (copied there unless it landed there already)."""
        assert self._copies is not None
        out: list[NamedTensor] = []
        moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in tensors:
            copy = self.target(name, tensor.dtype, tuple(tensor.shape))
            assert copy is not None
            if copy is not tensor:
                moves.append((copy, tensor))
            out.append((name, copy))
            self._received.add(name)
        copy_tensors(moves)
        return out

    def abort(self) -> None:
        """After a sync that failed between :meth:`prepare` and :meth:`finalize`: leave every
        instance able to serve (the lifecycle's ``abort``), then run the quirks over what
        was loaded."""
        if not self._prepared:
            return
        self._prepared = False
        with self._context():
            for inst in self.instances:
                abort = getattr(self.lifecycle, "abort", None)
                if abort is not None:
                    abort(inst)
                for quirk in self.quirks:
                    quirk.after_finalize(inst)
            self._buffers = []
        log("vllm.abort", lifecycle=self.lifecycle.name, instances=[i.name for i in self.instances])

    def learn_staged(self) -> None:
        """Learn what :meth:`check_staged` checks against: what the loaders read
        (:func:`~streamsync.vllm.slices.worker_needs`, once per layout). It drives the
        loaders with fakes, so it runs where the engine is not stepping: when the staging
        starts, on the RPC's thread. Where it cannot be learned (no local checkpoint) the
        check warns and passes."""
        try:
            learned = worker_needs(WorkerModels(self.instances, self.vllm_config, self.state))
        except Exception as exc:
            warn("vllm.staging_unchecked", error=f"{type(exc).__name__}: {exc}")
            self._known = None
            return
        self._known = {need.name: need for needs in learned for need in needs.needs}
        self._tied = {n for inst in self.instances for n in tied_names(inst.model)}

    def check_staged(self, staged: Mapping[str, torch.Tensor], buffers: frozenset[str]) -> None:
        """Refuse, by name, a staged version a commit would fail on: a tensor no loader of
        these instances reads (with its close matches), or one of another shape than the
        engine's checkpoint (its slice's, in a sharded sync); see :meth:`learn_staged`."""
        known = self._known
        if known is None:
            return
        for name, tensor in staged.items():
            if name in buffers or name == BUFFER_MANIFEST:
                continue
            need = known.get(name)
            if need is None:
                if name in self._tied:
                    continue
                close = difflib.get_close_matches(name, list(known), n=3)
                hint = f"; close matches: {', '.join(close)}" if close else ""
                raise UnknownTensorError(
                    f"tensor {name!r} is read by no loader of model instances "
                    f"{[i.name for i in self.instances]}{hint}"
                )
            sliced = self.slices.get(name) if self.slices else None
            shapes = {need.shape} | ({sliced[0].shape} if sliced is not None else set())
            if tuple(tensor.shape) not in shapes:
                raise ShapeMismatchError(
                    f"tensor {name!r}: staged shape {list(tensor.shape)}, the engine's is "
                    f"{list(need.shape)}"
                )

    def finalize(self) -> LoadResult:
        per_instance: dict[str, LoadResult] = {}
        if self._copies is not None:
            # What a delta left out did not change: every layer is rebuilt from whole
            # checkpoint tensors, as a full sync rebuilds it.
            rest = [(n, t) for n, t in self._copies.items() if n not in self._received]
            if rest:
                self.load(rest)
        with self._context():
            for inst in self.instances:
                self.lifecycle.finalize(inst)
                for quirk in self.quirks:
                    quirk.after_finalize(inst)
            self._prepared = False
            for inst in self.instances:
                _require_materialised(inst)
            self._router.refresh()
            _, applied = self._router.split(self._buffers)
            self._buffers = []
            for inst in self.instances:
                inst.loaded.update(applied[inst.name])
                params = {checkpoint_name(n) for n, _ in inst.model.named_parameters()}
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
