"""The messages of the engine seam's RPC: what the trainer tells every worker for one sync
(:class:`WorkerOptions`), what each worker answers (:class:`WorkerResult`), and where each
worker of a sharded channel receives from (:class:`Route`); what an engine tells the trainer
of itself is in :mod:`streamsync.facts`. All are versioned msgspec structs that cross the
engine's RPC as plain values (``to_wire`` / ``from_wire``), never pickled; an error crosses as
its kind (class name) and message, mapped back to the class by
:func:`streamsync.errors.error_class`.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import msgspec

from streamsync.errors import ConfigError, ReceiverFailedError, StreamsyncError, error_class
from streamsync.facts import Versioned
from streamsync.report import SyncReport

__all__ = ["WorkerResult"]


class Route(msgspec.Struct, frozen=True, array_like=True):
    """Where one worker of a sharded channel receives from, and the layouts (of its model
    instances' :class:`~streamsync.facts.Needs`) the trainer cut its slices for: a worker
    whose layout is not among them refuses the sync rather than load slices cut for another
    layout."""

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
    transport: dict[str, Any] = msgspec.field(default_factory=dict)
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
