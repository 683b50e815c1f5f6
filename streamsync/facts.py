"""What an engine tells the trainer of itself: its hello when a channel opens
(:class:`EngineFacts`), and what each worker reads of each checkpoint tensor (:class:`Needs`,
for a sharded channel). Low in the package, so that what decides from them (an adapter, the
boxes a sharded sync cuts) needs no part of the engine seam; the seam's own messages
(:mod:`streamsync.engine.messages`) are :class:`Versioned` structs too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

import msgspec

from streamsync._versions import parse_version, vllm_version
from streamsync.errors import ProtocolVersionError, StreamsyncError, WireFormatError

#: Version of every :class:`Versioned` struct on the engine's RPC (the engine's facts, and
#: :mod:`streamsync.engine.messages`); a worker and a trainer that disagree fail with
#: :class:`~streamsync.ProtocolVersionError`.
WORKER_PROTOCOL = 7


class Versioned(msgspec.Struct, frozen=True, kw_only=True):
    """A struct that crosses an engine's control plane as plain values, stamped with
    :data:`WORKER_PROTOCOL`: a peer of another streamsync fails by name, not by field."""

    version: int = WORKER_PROTOCOL

    #: What the struct is, as errors name it (``{rank}``: the worker's).
    what: ClassVar[str]
    #: The error a malformed one raises.
    invalid: ClassVar[type[StreamsyncError]] = WireFormatError

    def to_wire(self) -> dict[str, Any]:
        """Plain values for the engine's RPC."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls, data: object, *, rank: int = 0) -> Self:
        """The struct from what crossed the RPC (from worker ``rank``)."""
        if isinstance(data, cls):
            return data
        what = cls.what.format(rank=rank)
        version = data.get("version", WORKER_PROTOCOL) if isinstance(data, Mapping) else None
        if version != WORKER_PROTOCOL:
            raise ProtocolVersionError(
                f"{what} of protocol version {version!r}; this streamsync speaks "
                f"{WORKER_PROTOCOL}: install the same streamsync on the trainer and the engine"
            )
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            fields = ", ".join(f for f in cls.__struct_fields__ if f != "version")
            raise cls.invalid(f"{what}: {exc}; valid fields: {fields}") from None


class EngineFacts(Versioned, frozen=True, kw_only=True):
    """What an engine tells the trainer of itself when a channel opens (its hello), so the
    trainer decides from the engine's facts, not from what is installed beside it (a
    trainer image without vLLM, or with another version, would decide wrongly)."""

    what: ClassVar[str] = "the engine's hello"
    #: The engine's vLLM as ``(major, minor, patch)``; ``None``: not a vLLM engine, or its
    #: version is unknown.
    vllm_version: tuple[int, int, int] | None = None

    @classmethod
    def here(cls) -> EngineFacts:
        """The facts of the engine in this process (what its workers answer)."""
        return cls(vllm_version=vllm_version())

    @classmethod
    def of_vllm(cls, version: str) -> EngineFacts:
        """The facts of a vLLM engine that says it is ``version`` (its server's ``/version``)."""
        return cls(vllm_version=parse_version(version))


class Box(msgspec.Struct, frozen=True, array_like=True):
    """Elements ``start[d]:stop[d]`` of each dimension ``d`` of one checkpoint tensor."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Its length along each dimension."""
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))


class Need(msgspec.Struct, frozen=True, array_like=True):
    """What one worker reads of one checkpoint tensor: ``box`` of it, or (``box`` ``None``)
    all of it, because its loader reads it whole or because the recording fakes could not
    follow the loader (``why_whole`` then says which op, for the report)."""

    name: str
    #: The checkpoint shape and dtype the worker learned against.
    shape: tuple[int, ...]
    dtype: str
    box: Box | None
    why_whole: str = ""


class Needs(Versioned, frozen=True, kw_only=True):
    """One model instance's reads on one worker, learned from the engine's own loaders: a
    tensor the worker does not read has no :class:`Need`. Workers of one ``layout`` (DP
    replicas of one TP rank) read the same slices."""

    what: ClassVar[str] = "worker {rank}'s needs"
    #: ``"main"`` or ``"drafter"`` on the worker; the channel's key names the worker too.
    instance: str
    #: Digest of what decides the slices: the model's class and parameters, its TP and PP
    #: rank and size, quantization and the checkpoint's names, shapes and dtypes.
    layout: str
    needs: tuple[Need, ...]


class WorkerFacts(Versioned, frozen=True, kw_only=True):
    """What one engine worker tells the trainer of itself as it joins a channel (the
    ``facts`` of its transport's hello), so that a trainer whose control client can only
    start the engine's calls (vLLM's ``VLLMWeightSyncClient`` protocol) learns what it
    would otherwise ask: how many workers there are, the engine's facts and, for a sharded
    channel, what the worker reads."""

    what: ClassVar[str] = "worker {rank}'s introduction"
    #: The worker's engine (its id, shared by its workers; the transport's ``team``).
    engine_id: str = ""
    #: The worker's rank in its engine.
    rank: int
    #: How many workers the engine has (tensor x pipeline x data parallel).
    workers: int
    engine: EngineFacts
    #: What each of its model instances reads (told when the trainer asks: a sharded channel).
    needs: tuple[Needs, ...] = ()

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, raw: bytes, *, who: str) -> WorkerFacts:
        """The introduction ``who`` sent (refused by name if it is not one of this
        protocol)."""
        try:
            data = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError as exc:
            raise WireFormatError(f"{who} sent no worker introduction ({exc})") from None
        return cls.from_wire(data)
