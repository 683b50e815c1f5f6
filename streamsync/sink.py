"""Sinks: the receiver side's three-phase lifecycle.

A sink has ``prepare()``, called once before the first bucket of a sync; ``load(tensors)``,
called once per bucket with that bucket's complete tensors; and ``finalize()``, called once
after the last bucket, which may return a :class:`~streamsync.LoadResult`. Each method may be
a plain or an ``async`` function. A sink that routes buffers may offer
``declare_buffers(names)``: the buffer names the trainer declared
(:func:`~streamsync.adapters.split_buffers`), taken out of the stream before ``load``.

**The tensors handed to ``load`` are views into a transport slot that is reused as soon as
``load`` returns.** A sink must copy what it keeps; keeping a view is how an engine ends up
with another bucket's bytes in its weights. A sink may also offer ``target`` (a
:class:`TargetSink`).
"""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol, cast, runtime_checkable

import torch

from streamsync._copies import CopyBatch, MovePlan
from streamsync.errors import DtypeMismatchError, ShapeMismatchError, UnknownTensorError
from streamsync.pipeline import NamedTensor
from streamsync.report import LoadResult
from streamsync.wire.checks import CheckedLayout
from streamsync.wire.unpack import BucketTensors

#: Name of the tensor in which :func:`~streamsync.adapters.split_buffers` declares the
#: trainer's buffer names; ``::`` never occurs in a PyTorch state-dict name.
BUFFER_MANIFEST: Final = "streamsync::buffers"


@runtime_checkable
class Sink(Protocol):
    """Receiver-side target of a sync (plain or async methods)."""

    def prepare(self) -> Any:
        """Before the first bucket: get the model ready to be loaded."""

    def load(self, tensors: Sequence[NamedTensor]) -> Any:
        """One bucket's complete tensors. Views: copy what you keep."""

    def finalize(self) -> Any:
        """After the last bucket; may return a :class:`LoadResult`."""


@runtime_checkable
class TargetSink(Sink, Protocol):
    """A sink that also offers ``target(name, dtype, shape)``: the (contiguous, CPU) tensor
    it will hold that tensor in (``None``: stage it). The chunks of a tensor larger than a
    bucket are then written straight into it, and ``load`` receives that same tensor. Its
    content is undefined if the sync fails before it is complete; the partial report then
    lists the name among those applied."""

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The sink's own tensor for ``name``, or ``None``."""


@runtime_checkable
class VersionedSink(TargetSink, Protocol):
    """A sink that can take delta syncs: it says which version (sync id) its model holds,
    and patches land in the tensors ``target`` gives. :func:`~streamsync.receive` sets
    ``version`` to ``None`` before it touches the model and to the sync's id once the sync
    is applied; a delta on another version is refused before anything is applied. A sink
    made anew each sync keeps the version where it outlives the sink (with the model's
    owner); :class:`ModuleSink` has the receiver keep it. ``None`` also means "send me full
    syncs"."""

    version: int | None


#: Bucket layouts a :class:`ModuleSink` keeps the moves of (a trainer repeats a few).
_LAYOUTS_KEPT: Final = 64


@runtime_checkable
class AbortableSink(Sink, Protocol):
    """A sink that can put back what ``prepare`` took apart when a sync fails between
    ``prepare`` and ``finalize`` (``VllmSink``: the layers still waiting for weights). The
    worker side calls ``abort`` then, on the thread the other phases ran on."""

    def abort(self) -> None:
        """Leave the model able to serve after a failed sync."""


@runtime_checkable
class BufferDeclaringSink(Sink, Protocol):
    """A sink told which names of a sync are buffers (the trainer's manifest, from
    :func:`~streamsync.adapters.split_buffers`), not parameters to load."""

    def declare_buffers(self, names: frozenset[str]) -> None:
        """The sync's buffer names, before the tensors that carry them."""


@runtime_checkable
class WrappingSink(Sink, Protocol):
    """A sink around another, ``inner``, the sink a plain sync would load into
    (:class:`~streamsync.staging.StagingSink`): a receive that keeps a
    :class:`ModuleSink`'s version between syncs keeps it for ``inner``'s model."""

    inner: Sink


@runtime_checkable
class StageCheckedSink(Sink, Protocol):
    """A sink that refuses, by name, a staged version (:mod:`streamsync.staging`) that it
    would refuse to load, when the staging ends rather than at the commit."""

    def learn_staged(self) -> None:
        """Learn what :meth:`check_staged` checks against; called when a staging around
        this sink begins (where the engine does not step)."""

    def check_staged(self, staged: Mapping[str, torch.Tensor], buffers: frozenset[str]) -> None:
        """Raise the error loading ``staged`` (``buffers``: the declared buffer names)
        would raise, before anything is loaded."""


@runtime_checkable
class CopyKeepingSink(VersionedSink, Protocol):
    """A versioned sink whose patches land in copies it keeps of the model's tensors
    (``VllmSink``), not in the model's own: a staged delta starts from that copy."""

    def kept(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The kept copy of ``name`` if there is one of that dtype and shape; allocates
        nothing."""


def as_target(sink: Sink) -> TargetSink | None:
    """``sink`` if it is a :class:`TargetSink`, else ``None``: one attribute lookup, where
    ``isinstance`` against a runtime-checkable protocol collects its members again on every
    call (12 µs for ``TargetSink``, 34 µs for ``VersionedSink`` on Python 3.11)."""
    return cast(TargetSink, sink) if getattr(sink, "target", None) is not None else None


def as_versioned(sink: Sink) -> VersionedSink | None:
    """``sink`` if it is a :class:`VersionedSink`, else ``None`` (see :func:`as_target`)."""
    if as_target(sink) is None or not hasattr(sink, "version"):
        return None
    return cast(VersionedSink, sink)


async def call_phase(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a sink method that may be plain or async."""
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


class ModuleSink:
    """Copies received tensors into a module's parameters and persistent buffers, in place,
    by state-dict name.

    Strict (the default): a name the module lacks, or a shape or dtype that differs from the
    module's, raises an error naming the tensor, before anything of that bucket is applied.
    With ``strict=False`` unknown names are skipped (reported as ``unexpected``) and dtypes
    are converted; shapes must still match.
    """

    def __init__(self, module: torch.nn.Module, *, strict: bool = True) -> None:
        self.module = module
        self.strict = strict
        # Interned, as the receiver's unpacker interns the names of the layouts it keeps: a
        # name is one string on this side, however many plans and reports hold it.
        self._targets: dict[str, torch.Tensor] = {
            sys.intern(name): t.detach() for name, t in module.state_dict(keep_vars=True).items()
        }
        # Tied weights share storage under several names: loading one loads them all.
        by_storage: dict[tuple[int, tuple[int, ...], torch.dtype], list[str]] = {}
        for name, t in self._targets.items():
            if t.numel():
                key = (t.data_ptr(), tuple(t.shape), t.dtype)
                by_storage.setdefault(key, []).append(name)
        self._aliases = {n: group for group in by_storage.values() for n in group}
        # Per name, what ``load`` checks and where a memmove writes: (shape, dtype, address
        # of a contiguous CPU tensor or None, bytes). Looked up once per tensor instead of
        # asking torch for each attribute (a sync may carry tens of thousands of tensors).
        self._meta: dict[str, tuple[torch.Size, torch.dtype, int | None, int]] = {
            name: (
                t.shape,
                t.dtype,
                t.data_ptr() if t.is_cpu and t.is_contiguous() else None,
                t.numel() * t.element_size(),
            )
            for name, t in self._targets.items()
        }
        self._patchable = strict and all(
            address is not None for _, _, address, _ in self._meta.values()
        )
        #: Every name, sorted (the report of a sync that loaded them all).
        self._names = tuple(sorted(self._targets))
        self._loaded: set[str] = set()
        #: The names of each bucket loaded by its plan (kept as the plan's tuple, not added
        #: to ``_loaded`` name by name).
        self._laid: list[tuple[str, ...]] = []
        self._unexpected: list[str] = []
        # Per bucket layout, its moves into the module (or None: that layout takes the
        # general path); a trainer repeats a few layouts every step.
        self._plans: dict[CheckedLayout, MovePlan | None] = {}
        self._version: int | None = None

    @property
    def version(self) -> int | None:
        """The version the module holds, when a delta can patch it in place (a strict sink
        whose tensors are all contiguous on the CPU); else ``None``. The receiver keeps it
        between syncs (``ReceiverState.held``) and sets it here when a sync begins."""
        return self._version if self._patchable else None

    @version.setter
    def version(self, version: int | None) -> None:
        self._version = version

    def prepare(self) -> None:
        self._loaded = set()
        self._laid = []
        self._unexpected = []

    def _check(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor | None:
        """The module's tensor for ``name`` after the strict checks, or ``None`` for a name
        a non-strict sink skips."""
        meta = self._meta.get(name)
        if meta is None:
            if self.strict:
                close = difflib.get_close_matches(name, self._targets, n=3)
                hint = f"; close matches: {', '.join(close)}" if close else ""
                raise UnknownTensorError(
                    f"tensor {name!r} is not a parameter or buffer of "
                    f"{type(self.module).__name__}{hint}"
                )
            return None
        if meta[0] != tuple(shape):
            raise ShapeMismatchError(
                f"tensor {name!r}: received shape {list(shape)}, the module's is {list(meta[0])}"
            )
        if meta[1] != dtype and self.strict:
            raise DtypeMismatchError(
                f"tensor {name!r}: received dtype {dtype}, the module's is {meta[1]}"
            )
        return self._targets[name]

    def learn_staged(self) -> None:
        """Nothing to learn: :meth:`check_staged` checks against the module's own tensors."""

    def check_staged(self, staged: Mapping[str, torch.Tensor], buffers: frozenset[str]) -> None:
        """Refuse, by name, a staged version (:mod:`streamsync.staging`) that ``load``
        would refuse, before anything is loaded."""
        for name, tensor in staged.items():
            self._check(name, tensor.dtype, tuple(tensor.shape))

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The module's own tensor for ``name``, for chunks to be written straight into it;
        checked as ``load`` would (errors are raised before any byte is written)."""
        dst = self._check(name, dtype, shape)
        if dst is None or dst.dtype != dtype:
            return None  # skipped, or converted by load from the staging buffer
        return dst if dst.is_contiguous() and dst.device.type == "cpu" else None

    def _moves(self, layout: CheckedLayout) -> MovePlan | None:
        """The memmoves of a bucket of ``layout`` into the module, when every entry is one
        of its contiguous CPU tensors with the same shape and dtype; else ``None``."""
        if layout in self._plans:
            return self._plans[layout]
        dst: list[int] = []
        meta = self._meta
        plan: MovePlan | None = None
        for name, dtype, shape in zip(layout.names, layout.dtypes, layout.shapes(), strict=True):
            known = meta.get(name)
            if known is None or known[0] != shape or known[1] != dtype or known[2] is None:
                break
            dst.append(known[2])
        else:
            plan = MovePlan(dst, layout.offsets, layout.sizes, spread_small=False)
        if len(self._plans) >= _LAYOUTS_KEPT:
            self._plans.clear()
        self._plans[layout] = plan
        return plan

    def load(self, tensors: Sequence[NamedTensor]) -> None:
        if isinstance(tensors, BucketTensors) and tensors.layout is not None:
            layout, data = tensors.layout, tensors.data
            moves = self._moves(layout) if data is not None and data.is_cpu else None
            if moves is not None and data is not None:  # memmoves: host memory only
                moves.run(0, data.data_ptr())
                self._laid.append(layout.names)
                return
        batch = CopyBatch()
        meta = self._meta
        loaded: list[str] = []
        for name, src in tensors:
            known = meta.get(name)
            if known is not None and known[0] == src.shape and known[1] == src.dtype:
                # The common case, checked from the cache: the name, shape and dtype match.
                loaded.append(name)
                _, _, address, nbytes = known
                if address is not None and src.is_cpu and src.is_contiguous():
                    if src.data_ptr() != address:  # not a chunked tensor already in place
                        batch.move(address, src.data_ptr(), nbytes)
                    continue
                batch.copy(self._targets[name], src)
                continue
            dst = self._check(name, src.dtype, src.shape)  # raises for a strict mismatch
            if dst is None:
                self._unexpected.append(name)
                continue
            loaded.append(name)
            if src is not dst:
                batch.copy(dst, src)  # converted (a non-strict sink)
        # Everything checked: now apply the whole bucket.
        batch.run()
        self._loaded.update(loaded)

    def finalize(self) -> LoadResult:
        # Every name loaded is the module's (``load`` checks each): as many distinct names
        # as the module has is all of them.
        loaded = self._loaded.union(*self._laid)
        if len(loaded) == len(self._names):
            return LoadResult(loaded=self._names, unexpected=tuple(self._unexpected))
        done = {alias for name in loaded for alias in self._aliases.get(name, (name,))}
        return LoadResult(
            loaded=tuple(sorted(loaded)),
            missing=tuple(sorted(n for n in self._targets if n not in done)),
            unexpected=tuple(self._unexpected),
        )
