"""What each worker of a vLLM engine reads of each checkpoint tensor: its :class:`Needs`.

::

    checkpoint manifest (names, dtypes, shapes): the engine's own .safetensors headers
      -> recorded_reads: load_weights over vLLM's recording fakes, on meta  (vllm/_compat.py)
           per name: the op chains its loaders copy from; or why not learnable
      -> read_box: each chain replayed on an index tensor -> the bounding box read
      -> Needs: per name, the box; whole where the box is all of it or not learnable

Learned once per model instance and layout (:func:`layout_digest`) and kept in the worker's
:class:`~streamsync.vllm.sink.WorkerState`; the model is left as it was.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from streamsync.errors import ConfigError
from streamsync.facts import Box, Need, Needs

if TYPE_CHECKING:
    from streamsync.vllm.sink import ModelInstance, WorkerModels

#: A checkpoint's tensors: name -> (dtype as torch names it, shape).
Manifest = Mapping[str, tuple[str, tuple[int, ...]]]

#: The view ops a recorded chain may hold (vLLM's ``sharded_rdt_common.ALLOWED_OPS``).
_VIEW_OPS = frozenset(
    {
        "narrow",
        "view",
        "reshape",
        "__getitem__",
        "unsqueeze",
        "squeeze",
        "transpose",
        "t",
        "permute",
        "flatten",
        "contiguous",
        "chunk",
        "unbind",
    }
)

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def replay(tensor: torch.Tensor, chain: Sequence[tuple[str, Any, Any]]) -> torch.Tensor:
    """``tensor`` through a recorded op chain; an op that is not a view is refused."""
    for op, args, kwargs in chain:
        if op not in _VIEW_OPS:
            raise ValueError(f"{op!r} is not a view op a recorded chain may hold")
        tensor = getattr(tensor, op)(*args, **dict(kwargs))
    return tensor


def read_box(shape: tuple[int, ...], chains: Sequence[Any]) -> Box | None:
    """The bounding box of the elements ``chains`` read of a tensor of ``shape``; ``None``
    if they read nothing. Each chain is replayed, per dimension, on that dimension's index
    broadcast to ``shape``: views of it hold no memory, and only a chain that views it
    flat makes one dimension's index whole."""
    lo, hi, read = list(shape), [0] * len(shape), False
    for chain in chains:
        for d, n in enumerate(shape):
            axis = [1] * len(shape)
            axis[d] = n
            coord = torch.arange(n).view(axis).expand(shape)
            try:
                coord = replay(coord, chain)
            except RuntimeError:  # a view the broadcast strides cannot take
                coord = replay(coord.contiguous(), chain)
            if not coord.numel():
                break
            read = True
            lo[d], hi[d] = min(lo[d], int(coord.min())), max(hi[d], int(coord.max()) + 1)
        else:
            read = read or not shape
    return Box(tuple(lo), tuple(hi)) if read else None


def need_of(name: str, dtype: str, shape: tuple[int, ...], chains: Sequence[Any]) -> Need | None:
    """What reading ``chains`` of checkpoint tensor ``name`` needs: its box, ``box=None``
    for all of it, ``None`` for nothing."""
    box = read_box(shape, chains)
    if box is None:
        return None
    whole = box.start == (0,) * len(shape) and box.stop == shape
    return Need(name, shape, dtype, None if whole else box)


def checkpoint_manifest(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The names, dtypes and shapes in the ``.safetensors`` files of directory ``path`` (the
    engine's model), read from their headers."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not os.path.isdir(path) or not files:
        raise ConfigError(
            f"a sharded channel learns each worker's slices against the engine's checkpoint, "
            f"but the engine's model {path!r} is not a local directory of .safetensors files"
        )
    manifest: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(file, framework="pt") as opened:
            for name in opened.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sliced = opened.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sliced.get_dtype(), sliced.get_dtype())
                manifest[name] = (dtype, tuple(sliced.get_shape()))
    return manifest


def layout_digest(inst: ModelInstance, manifest: Manifest) -> str:
    """A digest of what decides ``inst``'s slices on this worker: the model's class and
    parameters, its TP and PP rank and size, quantization and the checkpoint."""
    from vllm.distributed import parallel_state

    config = inst.model_config
    parts: list[Any] = [
        inst.name,
        type(inst.model).__qualname__,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pp_group().rank_in_group,
        parallel_state.get_pp_group().world_size,
        getattr(config, "quantization", None),
        sorted(manifest.items()),
        [(n, tuple(p.shape), str(p.dtype)) for n, p in inst.model.named_parameters()],
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def learn_needs(inst: ModelInstance, vllm_config: Any, manifest: Manifest, layout: str) -> Needs:
    """What ``inst``'s loaders read of each tensor of ``manifest`` on this worker, learned
    from vLLM's recording fakes."""
    from vllm.config import set_current_vllm_config

    from streamsync.vllm import _compat

    with set_current_vllm_config(vllm_config), torch.no_grad():
        chains, whole = _compat.recorded_reads(inst.model, dict(manifest))
    needs: list[Need] = []
    for name, (dtype, shape) in manifest.items():
        if name in whole:
            needs.append(Need(name, shape, dtype, None, whole[name]))
        elif name in chains:
            need = need_of(name, dtype, shape, chains[name])
            if need is not None:
                needs.append(need)
    return Needs(instance=inst.name, layout=layout, needs=tuple(needs))


def worker_needs(models: WorkerModels) -> list[Needs]:
    """The :class:`Needs` of each model instance of one worker, against the engine's
    checkpoint: kept in the worker's state, learned again when the layout changes."""
    found = []
    for inst in models.instances:
        manifest = checkpoint_manifest(str(inst.model_config.model))
        layout = layout_digest(inst, manifest)
        kept = models.state.needs.get(inst.name)
        if kept is None or kept.layout != layout:
            kept = models.state.needs[inst.name] = learn_needs(
                inst, models.vllm_config, manifest, layout
            )
        found.append(kept)
    return found
