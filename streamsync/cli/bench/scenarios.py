"""What the benchmark runs: the scenarios (which weights, through which adapters, into
which layout), the transports, and the bounds each transport is compared with."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

import streamsync as ss
from streamsync.adapters import BufferSink, cast, expand_moe, split_buffers
from streamsync.cli.bench.models import (
    WIRE_DTYPE,
    SyntheticModel,
    fp8_model,
    synthetic_model,
    uniform_model,
)
from streamsync.pipeline import AdapterLike
from streamsync.sink import Sink
from streamsync.testing.peers import free_port
from streamsync.transports import _registry


@dataclass(frozen=True)
class Scenario:
    """One way the weights go: which model, in which dtype, through which adapters, into
    which receiving layout."""

    name: str
    description: str
    moe: bool
    source_dtype: torch.dtype = WIRE_DTYPE
    #: The adapter chain for ``send(..., pipeline=)``; None: no adapters.
    pipeline: Callable[[SyntheticModel], AdapterLike] | None = None
    #: The receiver holds per-expert tensors (what ``expand_moe`` makes).
    expanded: bool = False
    #: Every tensor this size (:func:`uniform_model`) instead of a Qwen3-shaped model.
    tensor_bytes: int | None = None
    #: An FP8 expert stack (:func:`fp8_model`) instead.
    fp8: bool = False
    #: Its own bound where the transport's is two memcpys at once (a scenario that moves
    #: more bytes through memory than two copies of the model do).
    copy_bound: str | None = None

    def bound(self, transport: TransportSpec) -> str:
        """The key in ``BOUNDS`` this scenario is compared with on ``transport``."""
        if self.copy_bound is not None and transport.bound == "two_copy_parallel":
            return self.copy_bound
        return transport.bound

    def model(self, size: int) -> SyntheticModel:
        """The model this scenario sends, of at most ``size`` bytes."""
        if self.fp8:
            return fp8_model(size)
        if self.tensor_bytes is not None:
            return uniform_model(size, self.tensor_bytes)
        return synthetic_model(size, moe=self.moe)

    def adapters(self, model: SyntheticModel) -> AdapterLike | None:
        """A fresh adapter chain for one sync of ``model``, or None."""
        return self.pipeline(model) if self.pipeline is not None else None

    def sink(self, module: torch.nn.Module, model: SyntheticModel) -> Sink:
        """The receiver's sink: a strict ModuleSink, behind a BufferSink for a chain that
        declares buffers."""
        inner = ss.ModuleSink(module)
        return BufferSink(inner, [module]) if self.pipeline is not None and model.buffers else inner


def _moe_chain(model: SyntheticModel) -> AdapterLike:
    keep = model.buffers  # router biases stay float32, as engines keep them
    return (
        expand_moe(when="always")
        | split_buffers(sorted(keep))
        | cast(WIRE_DTYPE, only=lambda n: n not in keep)
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("dense", "bf16 weights, no adapters", moe=False),
        Scenario(
            "dense-fp32-cast",
            "fp32 weights, cast(bf16) fused into packing",
            moe=False,
            source_dtype=torch.float32,
            pipeline=lambda model: cast(WIRE_DTYPE),
            copy_bound="cast_split",
        ),
        Scenario("moe", "bf16 MoE, packed experts, no adapters", moe=True),
        Scenario(
            "moe-chain",
            "bf16 MoE through expand_moe | split_buffers | cast",
            moe=True,
            pipeline=_moe_chain,
            expanded=True,
        ),
        Scenario(
            "small-tensors",
            "many bf16 tensors of 16 KiB (FP8 scales, experts)",
            moe=False,
            tensor_bytes=16 << 10,
        ),
        Scenario("large-tensors", "bf16 tensors of 8 MiB each", moe=False, tensor_bytes=8 << 20),
        Scenario(
            "fp8-layers",
            "FP8 experts shaped as DeepSeek-V3's, each with fp32 scales",
            moe=False,
            source_dtype=torch.float8_e4m3fn,
            fp8=True,
        ),
    )
}


@dataclass(frozen=True)
class TransportSpec:
    """A transport the bench runs: how to name a fresh channel, and its bound."""

    name: str
    url: Callable[[str], str]
    #: The key in ``BOUNDS`` this transport is compared with.
    bound: str
    #: Both sides in one process (otherwise one process each).
    in_process: bool = False
    #: The module it needs (and the ``streamsync[extra]`` that installs it).
    needs: str | None = None
    #: The ``os`` function it needs, and what lacking it means.
    needs_os: tuple[str, str] | None = None

    def slots(self, asked: int | None) -> int:
        """The ring's slots: ``asked``, else the transport's own default (what users get)."""
        if asked is not None:
            return asked
        found = _registry.get(self.name, f"{self.name}://")
        return int(next(o.default for o in found.sender_options if o.name == "slots"))

    def unavailable(self) -> str | None:
        """Why this transport cannot run here, or ``None``."""
        if self.needs is not None and importlib.util.find_spec(self.needs) is None:
            return f"{self.name} needs {self.needs} (pip install 'streamsync[{self.needs}]')"
        if self.needs_os is not None and not hasattr(os, self.needs_os[0]):
            return f"{self.name} needs {self.needs_os[1]}"
        return None


TRANSPORTS: dict[str, TransportSpec] = {
    t.name: t
    for t in (
        TransportSpec("memory", lambda tag: f"memory://bench-{tag}", "two_copy_serial", True),
        TransportSpec(
            "shm",
            lambda tag: f"shm://bench-{tag}",
            "two_copy_parallel",
            needs_os=("memfd_create", "Linux (memfd)"),
        ),
        TransportSpec(
            "zmq+ipc",
            lambda tag: f"zmq+ipc://@streamsync-bench-{tag}",
            "raw_pyzmq_ipc",
            needs="zmq",
        ),
        TransportSpec(
            "zmq+tcp",
            lambda tag: f"zmq+tcp://127.0.0.1:{free_port()}",
            "raw_pyzmq_tcp",
            needs="zmq",
        ),
    )
}

#: Every bound the bench measures, and what it is.
BOUNDS = {
    "memcpy": "one memcpy of the model's tensors",
    "two_copy_serial": "two memcpys back to back in one process (memcpy / 2)",
    "two_copy_parallel": (
        "two memcpys at once, in two processes, one thread each"
        " (the faster of glibc's memmove and the library's streaming copy)"
    ),
    "cast_split": (
        "a fused fp32 -> bf16 cast sync's work split evenly over two processes at once, one"
        " thread each: each casts half of every fp32 tensor and copies the bf16 bytes on"
        " (the library's kernels; no hand-offs)"
    ),
    "raw_pyzmq_ipc": "raw pyzmq PUSH/PULL over ipc, bucket-sized messages",
    "raw_pyzmq_tcp": "raw pyzmq PUSH/PULL over tcp loopback, bucket-sized messages",
}
