"""The reverse direction: streamsync's adapters in front of vLLM's own weight-transfer
backends (``nccl``, ``ipc``, ``sparse_nccl``), as a vLLM ``WeightSource``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync.engine.loops import EventLoopThread, caller_cuda
from streamsync.errors import ConfigError
from streamsync.pipeline import AdapterLike
from streamsync.sources import named_tensors


class _PipelineSource(WeightSource):
    """A vLLM ``WeightSource`` over a streamsync stream through a pipeline (see
    :func:`weight_source`)."""

    def __init__(self, weights: Any, pipeline: AdapterLike | None, *, timeout: float) -> None:
        self._weights = weights
        self._pipeline = pipeline
        self._timeout = timeout
        self._meta: list[ParamMeta] | None = None

    async def _open(self) -> Any:
        weights = self._weights
        if callable(weights) and not isinstance(weights, torch.nn.Module):
            weights = weights()
        stream = named_tensors(weights)
        return self._pipeline(stream) if self._pipeline is not None else stream

    def metadata(self) -> list[ParamMeta]:
        # What the pipeline yields is only known by running it (names, dtypes and shapes
        # change in MoE expansion and quantization): one pass, kept.
        if self._meta is None:
            for _ in self:
                pass
        assert self._meta is not None
        return list(self._meta)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        # The async pipeline runs on a loop thread of its own, under the caller's CUDA
        # stream (adapters that quantize on the GPU work where the caller would).
        loop = EventLoopThread("streamsync-weight-source")
        cuda = caller_cuda()
        meta: list[ParamMeta] = []

        async def step(stream: AsyncIterator[Any]) -> Any:
            with cuda():
                return await stream.__anext__()

        try:
            stream = loop.run(self._open, timeout=self._timeout, what="opening the stream")
            try:
                while True:
                    item = loop.run(
                        partial(step, stream), timeout=self._timeout, what="the next tensor"
                    )
                    name, tensor = _named_tensor(item)
                    meta.append(ParamMeta(name, tensor.dtype, tuple(tensor.shape)))
                    yield name, tensor
                    del item, tensor
            except StopAsyncIteration:
                pass
            finally:
                with contextlib.suppress(Exception):
                    loop.run(stream.aclose, timeout=self._timeout, what="closing the stream")
        finally:
            loop.stop()
        if self._meta is None:
            self._meta = meta
        elif [m.name for m in meta] != [m.name for m in self._meta]:
            raise ConfigError(
                "weight_source: this pass yielded other names than the first "
                f"({len(meta)} vs {len(self._meta)} tensors); the stream must be the same "
                "each round"
            )


def _named_tensor(item: Any) -> tuple[str, torch.Tensor]:
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
    ):
        return item
    raise ConfigError(
        f"weight_source: the pipeline yielded a {type(item).__name__}, not a (name, tensor) "
        "pair; leave bucketing out of a pipeline for vLLM's own backends"
    )


def weight_source(
    weights: Any,
    *,
    pipeline: AdapterLike | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> WeightSource:
    """A vLLM ``WeightSource`` that yields ``weights`` through streamsync's ``pipeline``
    (``expand_moe``, ``quantize_fp8``, ``split_buffers``, ...), for vLLM's own backends
    (``nccl``, ``ipc``, ``sparse_nccl``): ``trainer_init(..., source=weight_source(model,
    pipeline=expand_moe()))``.

    ``weights`` must give a fresh stream every round: an ``nn.Module``, a mapping of
    tensors, a vLLM ``WeightSource``, or a function returning anything
    :func:`~streamsync.named_tensors` takes. ``metadata()`` runs the pipeline once (what it
    yields is only known that way) and keeps the result. ``timeout`` bounds each step.
    """
    if isinstance(weights, Iterator | AsyncIterator):
        raise ConfigError(
            f"weight_source: a {type(weights).__name__} can be iterated only once, and vLLM "
            "reads a source every round; pass an nn.Module, a mapping, a WeightSource or a "
            "function returning a fresh stream"
        )
    return _PipelineSource(weights, pipeline, timeout=timeout)
