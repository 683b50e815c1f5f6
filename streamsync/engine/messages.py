"""The messages of the engine seam's RPC: what an engine tells the trainer of itself when a
channel opens (:class:`EngineFacts`, its hello), what the trainer tells every worker for one
sync (:class:`WorkerOptions`), what each worker answers (:class:`WorkerResult`), and what
each worker reads of each checkpoint tensor (:class:`Needs`, for a sharded channel). All are
versioned msgspec structs that cross the engine's RPC as plain values (``to_wire`` /
``from_wire``), never pickled; an error crosses as its kind (class name) and message, mapped
back to the class by :func:`streamsync.errors.error_class`.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, ClassVar, Self

import msgspec

from streamsync._versions import parse_version, vllm_version
from streamsync.errors import (
    ConfigError,
    ProtocolVersionError,
    ReceiverFailedError,
    StreamsyncError,
    WireFormatError,
    error_class,
)
from streamsync.report import SyncReport

__all__ = ["WorkerResult"]

#: Version of :class:`WorkerOptions` and :class:`WorkerResult` on the engine's RPC; a worker
#: and a trainer that disagree fail with :class:`~streamsync.ProtocolVersionError`.
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


#: The facts of the engines the running sync feeds (one per engine), set by the channel
#: around its send: the adapters of its pipeline decide from them (``expand_moe("auto")``).
#: Empty outside a channel's sync (a plain :func:`~streamsync.send`).
sending_to: ContextVar[tuple[EngineFacts, ...]] = ContextVar("streamsync_sending_to", default=())


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


class Route(msgspec.Struct, frozen=True, array_like=True):
    """Where one worker of a sharded channel receives from, and the layouts (of its model
    instances' :class:`Needs`) the trainer cut its slices for: a worker whose layout is not
    among them refuses the sync rather than load slices cut for another layout."""

    endpoint: str
    layouts: tuple[str, ...]


class LoraTarget(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a LoRA adapter sync is for: the sync's tensors are the adapter's, built into one
    version of adapter ``name`` on every worker (``EngineChannel.update_lora``)."""

    #: The adapter's name.
    name: str
    #: This version: the id of the sync that carries it.
    version: int
    #: The adapter's LoRA config as JSON values (peft's ``LoraConfig.to_dict()``: ``r``,
    #: ``lora_alpha``, ``target_modules``, ...).
    config: dict[str, Any] = {}
    #: Other versions of ``name`` the workers keep (the one serving until this one is in).
    keep: tuple[int, ...] = ()
    #: Drop every version of ``name`` instead (the sync carries no tensors).
    remove: bool = False


class WorkerOptions(Versioned, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the trainer tells every worker for one sync (``worker_options=`` of a channel,
    as this struct or as a mapping of its fields)."""

    what: ClassVar[str] = "worker options from the trainer"
    #: Seconds for each wait of the receive; ``None``: the channel's ``timeout``.
    timeout: float | None = None
    #: Keyword arguments of :func:`~streamsync.open_receiver` on the worker.
    transport: dict[str, Any] = {}
    #: The sink's lifecycle by registered name; ``None``: the best the engine offers.
    lifecycle: str | None = None
    #: The sink's quirks by registered name; ``None``: those the engine needs, ``()``: none.
    quirks: tuple[str, ...] | None = None
    #: Only these model instances (``"main"``, ``"drafter"``); ``None``: all of them.
    instances: tuple[str, ...] | None = None
    #: Keep the copies a delta sync patches (a channel opened with ``delta=True``).
    delta: bool = False
    #: A LoRA adapter sync: what it builds (set by ``EngineChannel.update_lora``).
    lora: LoraTarget | None = None
    #: The sync this receive is for (set by the channel): whatever of an earlier
    #: sync is still queued on the worker's receiver (one given up before this worker
    #: began it) is skipped, not taken for this sync.
    sync_id: int | None = None
    #: A sharded channel's: per worker rank, where it receives its slices from (set by the
    #: channel); empty: every worker receives everything from the receive's endpoint.
    routes: tuple[Route, ...] = ()

    @classmethod
    def coerce(cls, options: WorkerOptions | Mapping[str, Any] | None) -> WorkerOptions:
        """``options`` as a struct: a mapping must name only this struct's fields."""
        if isinstance(options, WorkerOptions):
            return options
        try:
            return msgspec.convert(dict(options or {}), cls)
        except msgspec.ValidationError as exc:
            fields = ", ".join(f for f in cls.__struct_fields__ if f != "version")
            raise ConfigError(f"worker_options: {exc}; valid options: {fields}") from None

    def to_wire(self) -> dict[str, Any]:
        """Plain values for the engine's RPC."""
        return msgspec.to_builtins(self, builtin_types=(bytes, bytearray))  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls, data: object, *, rank: int = 0) -> Self:
        """The struct a worker received (``None``: the defaults)."""
        return cls() if data is None else super().from_wire(data, rank=rank)


class WorkerResult(Versioned, frozen=True, kw_only=True):
    """One worker's outcome of one sync: its receiver's report, or the error it hit (by
    class name, with the partial report), so that a failed sync never takes the engine
    down and the trainer re-raises the worker's own exception class."""

    what: ClassVar[str] = "worker {rank}'s result"
    pid: int
    #: The receiver's report (partial, or ``None`` if nothing was received, on failure).
    report: SyncReport | None = None
    #: Class name of the :class:`~streamsync.StreamsyncError` the worker hit.
    error: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def succeeded(cls, report: SyncReport) -> WorkerResult:
        return cls(pid=os.getpid(), report=report)

    @classmethod
    def started(cls) -> WorkerResult:
        """A staged receive that started (its result comes when it ends)."""
        return cls(pid=os.getpid())

    @classmethod
    def failed(cls, exc: StreamsyncError) -> WorkerResult:
        return cls(pid=os.getpid(), report=exc.report, error=type(exc).__name__, message=str(exc))

    def exception(self, rank: int, *, engine: int | None = None) -> StreamsyncError | None:
        """The worker's error, re-created on this side (``None`` if it succeeded); with
        ``engine``, the message and ``exc.engine`` say which of several engines it was."""
        if self.error is None:
            return None
        where = f"worker {rank}" if engine is None else f"engine {engine} worker {rank}"
        exc = error_class(self.error, ReceiverFailedError)(
            f"{where} (pid {self.pid}): {self.message}"
        )
        exc.report = self.report
        exc.engine = engine
        return exc

    def to_text(self) -> str:
        """This result as one token of plain characters (no quotes, no escapes), for a
        control plane that carries only an error's text back (vLLM's HTTP routes): an
        error message ends with it, and :meth:`from_text` finds it in whatever text the
        server wraps it in."""
        packed = base64.urlsafe_b64encode(msgspec.msgpack.encode(self.to_wire())).decode()
        return f"{_TOKEN}{packed}."

    @classmethod
    def from_text(cls, text: str) -> WorkerResult | None:
        """The result :meth:`to_text` wrote into ``text``, or ``None`` if there is none."""
        found = _TOKEN_PATTERN.search(text)
        if found is None:
            return None
        try:
            return cls.from_wire(msgspec.msgpack.decode(base64.urlsafe_b64decode(found[1])))
        except (ValueError, msgspec.DecodeError):
            return None


_TOKEN = "streamsync-result:"
_TOKEN_PATTERN = re.compile(re.escape(_TOKEN) + r"([A-Za-z0-9_=-]+)\.")
