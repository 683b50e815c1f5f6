"""Which box of each checkpoint tensor one engine worker receives, from its :class:`Needs`.

::

    Needs of each model instance of a worker (main, drafter)
      -> slices_of: per name, the bounding box of the instances' boxes
           (a name some instance reads whole is sent whole, so it has no slice)
      -> trainer side: cut each tensor to its box and send it
      -> worker side: wrap hands the loaders a BoxTensor of each box received

A worker hands ``load_weights`` a tensor it reads whole as it arrived, one it reads in part
as a :class:`BoxTensor` around the box it received: the loaders' own ``narrow``, int index,
``unbind`` or ``unsqueeze`` inside the box answer with the received data; outside it, or any
other op on it, raises :class:`~streamsync.errors.ReceiverFailedError` naming the tensor.
So the engine's own loaders stay in the path, and a wrong learned slice fails loudly rather
than loading bytes that were never sent. Free of vLLM: the trainer and the worker compute
the same slices from the same ``Needs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from streamsync.errors import ConfigError, ReceiverFailedError, ShapeMismatchError
from streamsync.facts import Box, Needs
from streamsync.pipeline import NamedTensor

#: Checkpoint name -> (the box one worker receives of it, the whole tensor's shape).
Slices = Mapping[str, tuple[Box, tuple[int, ...]]]


def box_union(a: Box, b: Box) -> Box:
    """The smallest box holding both ``a`` and ``b`` (of the same number of dimensions)."""
    if len(a.start) != len(b.start):
        raise ValueError(f"boxes of {len(a.start)} and {len(b.start)} dimensions have no union")
    return Box(
        tuple(map(min, a.start, b.start)),
        tuple(map(max, a.stop, b.stop)),
    )


def box_meet(a: Box, b: Box) -> Box | None:
    """The intersection of ``a`` and ``b``; ``None`` if empty."""
    lo = tuple(map(max, a.start, b.start))
    hi = tuple(map(min, a.stop, b.stop))
    if any(x >= y for x, y in zip(lo, hi, strict=True)):
        return None
    return Box(lo, hi)


def narrowed(data: torch.Tensor, held: Box, part: Box) -> torch.Tensor:
    """``part`` (global coordinates) of ``data``, which holds box ``held``."""
    for d, (a, b) in enumerate(zip(part.start, part.stop, strict=True)):
        if (a, b) != (held.start[d], held.stop[d]):
            data = data.narrow(d, a - held.start[d], b - a)
    return data


def slices_of(needs: Iterable[Needs]) -> dict[str, tuple[Box, tuple[int, ...]]]:
    """One worker's slices, from the :class:`Needs` of its model instances: per name, the
    bounding box of the instances' boxes. A name some instance reads whole (box ``None``),
    or whose bounding box is the whole tensor, is not in the result: it is sent whole.

    Raises :class:`ShapeMismatchError` when two instances learned a name against different
    shapes (one tensor is sent to both)."""
    shapes: dict[str, tuple[int, ...]] = {}
    boxes: dict[str, Box | None] = {}  # None: some instance reads it whole
    for instance in needs:
        for need in instance.needs:
            shape = shapes.setdefault(need.name, need.shape)
            if shape != need.shape:
                raise ShapeMismatchError(
                    f"tensor {need.name!r}: model instance {instance.instance!r} reads it as "
                    f"shape {list(need.shape)}, another instance as {list(shape)}"
                )
            if need.name not in boxes:
                boxes[need.name] = need.box
            else:
                kept = boxes[need.name]
                boxes[need.name] = (
                    None if kept is None or need.box is None else box_union(kept, need.box)
                )
    return {
        name: (box, shapes[name])
        for name, box in boxes.items()
        if box is not None and box.shape != shapes[name]
    }


#: What a loader may do with a :class:`BoxTensor`, for the error messages.
_SUPPORTED = "narrow, select, an int index, unbind, unsqueeze and clone"


class BoxTensor(torch.Tensor):
    """A checkpoint tensor of which this worker received only a box.

    It has the whole tensor's shape, dtype and device, so shape queries answer as for the
    whole. ``narrow``, ``select``, an int index (dim 0) and ``unbind`` inside the box, and
    ``unsqueeze``, answer with the received data: a plain tensor when the result lies
    within the box in every dimension, else another :class:`BoxTensor`. ``clone`` copies
    the received data. Reading outside the box, or any other op that touches the data,
    raises :class:`~streamsync.errors.ReceiverFailedError` naming the tensor.
    """

    _tensor_name: str
    _start: tuple[int, ...]
    _received: torch.Tensor

    @staticmethod
    def __new__(
        cls, name: str, received: torch.Tensor, start: Sequence[int], shape: Sequence[int]
    ) -> BoxTensor:
        """``received`` (plain, of the box's shape) placed at ``start`` in a tensor of
        ``shape``; :class:`ShapeMismatchError` when it does not fit there."""
        start, shape = tuple(int(s) for s in start), tuple(int(n) for n in shape)
        if isinstance(received, BoxTensor) or not (
            len(start) == len(shape) == received.dim()
            and all(
                0 <= a <= a + n <= whole
                for a, n, whole in zip(start, received.shape, shape, strict=True)
            )
        ):
            stop = tuple(a + n for a, n in zip(start, received.shape, strict=False))
            raise ShapeMismatchError(
                f"tensor {name!r}: received data of shape {list(received.shape)} at "
                f"{_box_text(Box(start, stop))} does not fit in its whole shape {list(shape)}"
            )
        out: BoxTensor = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=received.dtype, device=received.device
        )
        out._tensor_name, out._start, out._received = name, start, received
        return out

    @property
    def tensor_name(self) -> str:
        """The checkpoint name of the tensor."""
        return self._tensor_name

    @property
    def received(self) -> torch.Tensor:
        """The received data: the box of the whole tensor, as a plain tensor."""
        return self._received

    @property
    def box(self) -> Box:
        """Where :attr:`received` lies in the whole tensor."""
        stop = tuple(a + n for a, n in zip(self._start, self._received.shape, strict=True))
        return Box(self._start, stop)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"BoxTensor({self._tensor_name!r}, shape={list(self.shape)}, "
            f"received={_box_text(self.box)}, dtype={self.dtype})"
        )

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        self = args[0] if args else kwargs.get("input", kwargs.get("self"))
        read = _READS.get(func)
        if isinstance(self, BoxTensor) and read is not None:
            rest = {k: v for k, v in kwargs.items() if k not in ("input", "self")}
            return read(self, *args[1:], **rest)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        leaves, _ = tree_flatten((args, kwargs or {}))
        box = next(leaf for leaf in leaves if isinstance(leaf, BoxTensor))
        raise box._refused(f"{func} reads it")

    def _refused(self, what: str) -> ReceiverFailedError:
        return ReceiverFailedError(
            f"tensor {self._tensor_name!r}: {what}, but this worker received only "
            f"{_box_text(self.box)} of it (shape {list(self.shape)} as the loader holds it): "
            f"the learned slice does not match the loader, or the loader uses an op a "
            f"received box does not answer; inside the box it may use {_SUPPORTED}"
        )

    def narrow(self, dim: int, start: int | torch.Tensor, length: int) -> torch.Tensor:  # type: ignore[override]
        """Elements ``start:start + length`` of dimension ``dim``."""
        dim = _dim(dim, self.dim())
        begin, length = int(start), int(length)
        begin += self.shape[dim] if begin < 0 else 0
        if not 0 <= begin <= begin + int(length) <= self.shape[dim]:
            raise IndexError(
                f"tensor {self._tensor_name!r}: narrow({dim}, {start}, {length}) is out of "
                f"range for shape {list(self.shape)}"
            )
        low = begin - self._start[dim]
        if low < 0 or low + length > self._received.shape[dim]:
            end = begin + length
            raise self._refused(f"elements {begin}:{end} of dim {dim} were read")
        data = self._received.narrow(dim, low, length)
        shape = (*self.shape[:dim], length, *self.shape[dim + 1 :])
        if tuple(data.shape) == shape:
            return data
        start_at = (*self._start[:dim], 0, *self._start[dim + 1 :])
        return BoxTensor(self._tensor_name, data, start_at, shape)

    def select(self, dim: int, index: int) -> torch.Tensor:  # type: ignore[override]
        """Element ``index`` of dimension ``dim``, that dimension dropped."""
        dim, index = _dim(dim, self.dim()), int(index)
        if not -self.shape[dim] <= index < self.shape[dim]:
            raise IndexError(
                f"tensor {self._tensor_name!r}: index {index} is out of range for dim {dim} "
                f"of shape {list(self.shape)}"
            )
        one = self.narrow(dim, index % self.shape[dim], 1)
        if not isinstance(one, BoxTensor):
            return one.squeeze(dim)
        shape = (*self.shape[:dim], *self.shape[dim + 1 :])
        start = (*one._start[:dim], *one._start[dim + 1 :])
        return BoxTensor(self._tensor_name, one._received.squeeze(dim), start, shape)

    def unbind(self, dim: int = 0) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        """Every element of dimension ``dim`` (each must have been received)."""
        dim = _dim(dim, self.dim())
        return tuple(self.select(dim, i) for i in range(self.shape[dim]))

    def unsqueeze(self, dim: int) -> BoxTensor:
        """A new dimension of size 1 at ``dim``."""
        dim = _dim(dim, self.dim() + 1)
        shape = (*self.shape[:dim], 1, *self.shape[dim:])
        start = (*self._start[:dim], 0, *self._start[dim:])
        return BoxTensor(self._tensor_name, self._received.unsqueeze(dim), start, shape)

    def clone(self, *, memory_format: Any = None) -> BoxTensor:  # type: ignore[override]
        """A copy of the received data, in the same place of the same whole."""
        return BoxTensor(self._tensor_name, self._received.clone(), self._start, self.shape)

    def _getitem(self, index: Any) -> torch.Tensor:
        if type(index) is int:
            return self.select(0, index)
        raise self._refused(f"index {index!r} was used (only an int index is supported)")

    def _iter(self) -> Iterator[torch.Tensor]:
        return iter(self.unbind(0))


def _dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dimension {dim} is out of range for {ndim} dimensions")
    return dim % ndim


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(box.start, box.stop, strict=False)) + "]"


#: The ops a :class:`BoxTensor` answers itself, in their method and function forms.
_READS: dict[Any, Callable[..., Any]] = {
    torch.Tensor.narrow: BoxTensor.narrow,
    torch.narrow: BoxTensor.narrow,
    torch.Tensor.select: BoxTensor.select,
    torch.select: BoxTensor.select,
    torch.Tensor.unbind: BoxTensor.unbind,
    torch.unbind: BoxTensor.unbind,
    torch.Tensor.unsqueeze: BoxTensor.unsqueeze,
    torch.unsqueeze: BoxTensor.unsqueeze,
    torch.Tensor.clone: BoxTensor.clone,
    torch.clone: BoxTensor.clone,
    torch.Tensor.__getitem__: BoxTensor._getitem,
    torch.Tensor.__iter__: BoxTensor._iter,
}


def wrap(tensors: Sequence[NamedTensor], slices: Slices) -> list[NamedTensor]:
    """``tensors`` as the loaders take them: one named in ``slices`` that arrived in its
    box's shape as a :class:`BoxTensor` of the whole shape, any other as it is.

    Raises :class:`ShapeMismatchError` for a tensor named in ``slices`` that has neither
    its box's shape nor the whole tensor's."""
    out: list[NamedTensor] = []
    for name, tensor in tensors:
        found = slices.get(name)
        if found is not None and tuple(tensor.shape) != found[1]:
            box, whole = found
            if tuple(tensor.shape) != box.shape:
                raise ShapeMismatchError(
                    f"tensor {name!r}: received shape {list(tensor.shape)}, but this worker "
                    f"receives box {_box_text(box)} (shape {list(box.shape)}) of it or "
                    f"the whole (shape {list(whole)})"
                )
            tensor = BoxTensor(name, tensor, box.start, whole)
        out.append((name, tensor))
    return out


# -- the trainer side of a collective sync -------------------------------------------


class Sharded:
    """A sharded tensor as the ranks hold it: this rank's data and the box every rank holds
    (``None``: none of it), in the coordinates of the whole, of shape :attr:`shape`.

    What a pipeline stage of a collective sync sees for a DTensor. Indexing (ints and
    unit-step slices, as ``expand_moe`` takes an expert or half of one) and ``to(dtype)``
    (``cast``) act on every rank's box at once, on this rank's data as a view: each rank
    keeps only what it holds, and the route's owner assembles each box the workers read."""

    __slots__ = ("boxes", "dtype", "local", "name", "rank", "shape")

    def __init__(
        self,
        name: str,
        local: torch.Tensor,
        boxes: list[Box | None],
        shape: tuple[int, ...],
        rank: int,
    ) -> None:
        self.name, self.local, self.boxes = name, local, boxes
        self.shape, self.rank, self.dtype = torch.Size(shape), rank, local.dtype

    def __repr__(self) -> str:
        return f"Sharded({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"

    def dim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def detach(self) -> Sharded:
        return self

    def to(self, dtype: torch.dtype) -> Sharded:
        """Every rank's data as ``dtype`` (elementwise, so each rank casts its own)."""
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"tensor {self.name!r}: a sharded tensor converts only dtype")
        return Sharded(self.name, self.local.to(dtype), self.boxes, tuple(self.shape), self.rank)

    def __getitem__(self, index: Any) -> Sharded:
        """Ints and unit-step slices over the leading dimensions; anything else is a
        :class:`ConfigError` naming the tensor."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.dim():
            raise IndexError(f"tensor {self.name!r}: {len(index)} indices for {self.dim()} dims")
        lo, hi, dropped = [0] * self.dim(), list(self.shape), []
        for d, i in enumerate(index):
            if isinstance(i, int) and not isinstance(i, bool):
                if not -self.shape[d] <= i < self.shape[d]:
                    raise IndexError(f"tensor {self.name!r}: index {i} out of range on dim {d}")
                lo[d], hi[d] = i % self.shape[d], i % self.shape[d] + 1
                dropped.append(d)
            elif isinstance(i, slice) and i.step in (None, 1):
                lo[d], hi[d], _ = i.indices(self.shape[d])
                hi[d] = max(hi[d], lo[d])
            else:
                raise ConfigError(
                    f"tensor {self.name!r}: index {i!r} of a sharded tensor; a collective "
                    "sync's stages may index it with ints and unit-step slices only"
                )
        chosen = Box(tuple(lo), tuple(hi))
        keep = [d for d in range(self.dim()) if d not in dropped]

        def moved(box: Box) -> Box:
            return Box(
                tuple(box.start[d] - lo[d] for d in keep),
                tuple(box.stop[d] - lo[d] for d in keep),
            )

        boxes: list[Box | None] = []
        for held in self.boxes:
            part = None if held is None else box_meet(held, chosen)
            boxes.append(None if part is None else moved(part))
        held = self.boxes[self.rank]
        part = None if held is None else box_meet(held, chosen)
        if part is None or held is None:
            local = self.local.new_empty((0,) * len(keep))
        else:
            local = narrowed(self.local, held, part)
            for d in reversed(dropped):
                local = local.squeeze(d)
        shape = tuple(hi[d] - lo[d] for d in keep)
        return Sharded(self.name, local, boxes, shape, self.rank)
