"""Which box of each checkpoint tensor one engine worker receives, from its :class:`Needs`.

::

    Needs of each model instance of a worker (main, drafter)
      -> slices_of: per name, the bounding box of the instances' boxes
           (a name some instance reads whole is sent whole, so it has no slice)
      -> trainer side: cut each tensor to its box and send it
      -> worker side: streamsync.vllm.boxes.wrap hands the loaders a BoxTensor

Pure and free of vLLM, so the trainer and the worker compute the same slices from the same
``Needs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from streamsync.engine.messages import Box, Needs
from streamsync.errors import ShapeMismatchError

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
