"""``split_buffers(...)``: buffer updates applied by in-place copy, apart from ``load_weights``.

Some models keep training-updated state in registered buffers (DeepSeek-V3's
``e_score_correction_bias``), which many engine models' ``load_weights`` drop or route
wrongly. The receiver's :class:`BufferRouter` copies them in place, shape-checked and cast,
into each model instance that has the name. A name is a buffer if a receiving instance
registers it as one, or if the sender declared it with this adapter, in the manifest tensor
:data:`~streamsync.sink.BUFFER_MANIFEST` (UTF-8 JSON as ``uint8``) sent first, which the
receive path takes out of the stream and hands to a sink's ``declare_buffers``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import torch

from streamsync.errors import ShapeMismatchError, UnknownTensorError, WireFormatError
from streamsync.pipeline import NamedTensor, adapter
from streamsync.report import LoadResult
from streamsync.sink import BUFFER_MANIFEST, Sink, call_phase

Instances = Sequence[torch.nn.Module] | Mapping[str, torch.nn.Module]


def buffer_names(module: torch.nn.Module) -> frozenset[str]:
    """The state-dict names of ``module``'s persistent buffers."""
    names = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                names.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(names)


def _encode(names: Iterable[str]) -> torch.Tensor:
    raw = json.dumps(sorted(names)).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def manifest_names(tensor: torch.Tensor) -> frozenset[str]:
    """The buffer names a manifest tensor declares (a :class:`~streamsync.WireFormatError`
    for one that is not a manifest)."""
    try:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise ValueError(f"dtype {tensor.dtype}, {tensor.dim()} dims")
        names = json.loads(bytes(tensor.cpu().numpy()).decode())
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("not a list of names")
    except ValueError as exc:
        raise WireFormatError(
            f"tensor {BUFFER_MANIFEST!r} is not a buffer manifest (1-D uint8 JSON list of "
            f"names): {exc}"
        ) from None
    return frozenset(names)


def _configure(buffers: torch.nn.Module | Iterable[str]) -> dict[str, Any]:
    if isinstance(buffers, torch.nn.Module):
        return {"names": buffer_names(buffers)}
    if isinstance(buffers, str) or not isinstance(buffers, Iterable):
        raise TypeError(
            "split_buffers() takes the trainer's nn.Module or an iterable of buffer names, "
            f"not {type(buffers).__name__}"
        )
    names = frozenset(buffers)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"split_buffers(): buffer names must be str, not {bad[0]!r}")
    return {"names": names}


@adapter(configure=_configure)
async def split_buffers(
    source: AsyncIterable[NamedTensor], *, names: frozenset[str]
) -> AsyncIterator[NamedTensor]:
    """``split_buffers(module_or_names)``: declares the trainer's buffers (a module's
    persistent ones, or names) in a manifest sent first; passes the stream through."""
    yield BUFFER_MANIFEST, _encode(names)
    async for item in source:
        yield item


def _labelled(instances: Instances) -> dict[str, torch.nn.Module]:
    if isinstance(instances, Mapping):
        out = dict(instances)
    elif isinstance(instances, torch.nn.Module):
        out = {"instance0": instances}
    else:
        out = {f"instance{i}": m for i, m in enumerate(instances)}
    for label, module in out.items():
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model instance {label!r} is a {type(module).__name__}, not a Module")
    if not out:
        raise ValueError("no model instances given")
    return out


class BufferRouter:
    """Splits each bucket into buffer updates, copied in place, and the rest.

    ``instances``: the receiving models, a sequence (labelled ``instance0``, ...) or a mapping
    of labels. ``buffers``: more names to treat as buffers. ``strict``: a buffer that no
    instance has raises :class:`~streamsync.UnknownTensorError`, else it is passed on.
    """

    def __init__(
        self, instances: Instances, *, buffers: Iterable[str] = (), strict: bool = True
    ) -> None:
        self.instances = _labelled(instances)
        self.buffers = frozenset(buffers)
        self.strict = strict
        self.begin()

    def begin(self) -> None:
        """Start a sync: forget the previous manifest and collect each instance's tensors
        afresh (engines may replace parameters between syncs)."""
        self.declared: set[str] = set(self.buffers)
        self.applied: dict[str, set[str]] = {label: set() for label in self.instances}
        self.unexpected: list[str] = []
        self.refresh()

    def refresh(self) -> None:
        """Collect each instance's tensors again, keeping this sync's manifest (for an engine
        that swaps its tensors while loading)."""
        self._targets: dict[str, dict[str, torch.Tensor]] = {}
        self._registered: set[str] = set()
        for label, module in self.instances.items():
            targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
            for name, buf in module.named_buffers(remove_duplicate=False):
                targets[name] = buf
                self._registered.add(name)
            self._targets[label] = targets

    def is_buffer(self, name: str) -> bool:
        """Whether ``name`` is applied by in-place copy rather than passed on."""
        return name in self.declared or name in self._registered

    def split(
        self, tensors: Iterable[NamedTensor]
    ) -> tuple[list[NamedTensor], dict[str, list[str]]]:
        """Copy the buffer updates among ``tensors`` into every instance that has them;
        returns the remaining tensors (for ``load_weights``) and, per instance label, the
        names copied into it. A shape mismatch raises before anything is copied."""
        rest: list[NamedTensor] = []
        plan: list[tuple[str, str, torch.Tensor, torch.Tensor]] = []
        for name, tensor in tensors:
            if not self.is_buffer(name):
                rest.append((name, tensor))
                continue
            found = False
            for label, targets in self._targets.items():
                dst = targets.get(name)
                if dst is None:
                    continue
                found = True
                if dst.shape != tensor.shape:
                    raise ShapeMismatchError(
                        f"buffer {name!r}: received shape {list(tensor.shape)}, model instance "
                        f"{label!r} has {list(dst.shape)}"
                    )
                plan.append((label, name, dst, tensor))
            if not found:
                if self.strict:
                    raise UnknownTensorError(
                        f"buffer {name!r} is in none of the model instances "
                        f"{', '.join(map(repr, self.instances))}"
                    )
                self.unexpected.append(name)
                rest.append((name, tensor))
        applied: dict[str, list[str]] = {label: [] for label in self.instances}
        with torch.no_grad():
            for label, name, dst, src in plan:
                dst.copy_(src)  # casts to the instance's dtype and device
                applied[label].append(name)
                self.applied[label].add(name)
        return rest, applied


class BufferSink:
    """A sink that applies buffer updates to every model instance itself and hands the rest
    of each bucket to ``sink`` (typically one that calls ``load_weights``).

    Its :class:`~streamsync.LoadResult` is ``sink``'s, with the buffers applied added to
    ``loaded`` (and removed from ``missing``) and to each instance's entry in ``instances``.
    """

    def __init__(
        self,
        sink: Sink,
        instances: Instances,
        *,
        buffers: Iterable[str] = (),
        strict: bool = True,
    ) -> None:
        self.sink = sink
        self.router = BufferRouter(instances, buffers=buffers, strict=strict)

    async def prepare(self) -> None:
        self.router.begin()
        await call_phase(self.sink.prepare)

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The wrapped sink's tensor for a large parameter (see :class:`~streamsync.Sink`);
        buffers are small and go through the router."""
        inner = getattr(self.sink, "target", None)
        if inner is None or name == BUFFER_MANIFEST or self.router.is_buffer(name):
            return None
        result: torch.Tensor | None = inner(name, dtype, shape)
        return result

    def declare_buffers(self, names: frozenset[str]) -> None:
        """The trainer's buffer names, from its manifest (the receive path hands it here)."""
        self.router.declared |= names

    async def load(self, tensors: Sequence[NamedTensor]) -> None:
        rest, _ = self.router.split(tensors)
        if rest:
            await call_phase(self.sink.load, rest)

    async def finalize(self) -> LoadResult:
        result = await call_phase(self.sink.finalize)
        base = result if isinstance(result, LoadResult) else LoadResult()
        applied = self.router.applied
        everywhere = set().union(*applied.values())
        instances = dict(base.instances)
        for label, names in applied.items():
            prev = instances.get(label, LoadResult())
            instances[label] = LoadResult(
                loaded=tuple(sorted(set(prev.loaded) | names)),
                missing=tuple(n for n in prev.missing if n not in names),
                unexpected=prev.unexpected,
            )
        return LoadResult(
            loaded=tuple(sorted(set(base.loaded) | everywhere)),
            missing=tuple(n for n in base.missing if n not in everywhere),
            unexpected=(*base.unexpected, *self.router.unexpected),
            instances=instances,
        )
