"""Every exception streamsync raises, in one flat hierarchy under :class:`StreamsyncError`.

Each message names the tensor, the peer or the option involved and says what would be valid.
An exception raised by a sync that had already applied some tensors carries the partial
:class:`~streamsync.SyncReport` in ``exc.report`` (``report.complete`` is ``False``), so a
caller can tell exactly which names the receiving model now holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamsync.report import SyncReport


class StreamsyncError(Exception):
    """Base class of every streamsync error. ``report``: see the module; ``engine``: the
    index of the engine it came from, when one channel feeds several."""

    report: SyncReport | None = None
    engine: int | None = None


class ConfigError(StreamsyncError, ValueError):
    """An option, URL or argument is invalid; the message lists what is valid."""


class WireFormatError(StreamsyncError):
    """Bytes or metadata from a peer are malformed: bad encoding, impossible sizes,
    offsets outside the slot, unknown dtype, chunks out of order, counts that do not add up."""


class ChecksumError(WireFormatError):
    """A tensor's bytes do not match the checksum its sender computed."""


class ProtocolVersionError(WireFormatError):
    """The peer speaks another version of the streamsync wire protocol."""


class AuthenticationError(StreamsyncError):
    """The peer did not prove it knows the channel's shared secret."""


class StaleSyncError(StreamsyncError):
    """A sync id is not newer than the last one this receiver applied."""


class SyncInProgressError(StreamsyncError):
    """A second sync was started on a channel while one is still running."""


class UnknownTensorError(StreamsyncError, KeyError):
    """A strict sink received a name that its model does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(StreamsyncError):
    """A tensor's shape differs from the shape of the receiving tensor of that name."""


class DtypeMismatchError(StreamsyncError):
    """A tensor's dtype differs from the dtype of the receiving tensor of that name."""


class DuplicateTensorError(StreamsyncError):
    """The same name arrived twice in one sync."""


class DeltaBaseError(StreamsyncError):
    """A delta sync names a base version this receiver's model does not hold, or its sink
    cannot be patched: nothing of the sync is applied, and the sender's next sync is full."""


class LoraError(StreamsyncError, ValueError):
    """A LoRA adapter the engine cannot serve (an engine without LoRA, a rank above its
    ``max_lora_rank``, target modules or shapes its model lacks, more adapters than it
    holds): raised before anything is installed, so the previous version keeps serving."""


class UnsupportedVersionError(StreamsyncError, ImportError):
    """An installed dependency (vLLM, TRL) is outside the versions whose internals
    streamsync was tested with: the message names it, its version and the tested range."""


class PartialCommitError(StreamsyncError):
    """A staged version was committed on some engines and failed on others. ``versions``:
    each engine's version after it (the staged sync's id, or ``None`` where unknown); the
    channel's next sync is full on every engine, which brings them to one version."""

    versions: dict[int, int | None]

    def __init__(self, message: str, versions: dict[int, int | None] | None = None) -> None:
        super().__init__(message)
        self.versions = dict(versions or {})


class SyncTimeoutError(StreamsyncError, TimeoutError):
    """A wait ran past its timeout: the message says what was awaited and from whom."""


class ClosedError(StreamsyncError):
    """This side's channel was closed (by this process) and cannot be used any more."""


class PeerBrokenError(StreamsyncError):
    """The peer went away (process died, socket closed) without ending the sync."""


class EndOfStream(StreamsyncError):
    """The peer closed the channel cleanly; no further buckets will come."""


class SenderAbortedError(StreamsyncError):
    """The sender aborted the sync (its source or adapter chain raised, or the other
    receivers it waited for did not come); the message holds the sender's reason."""


class ReceiverFailedError(StreamsyncError):
    """A receiver reported that it could not apply the sync; the message names the receiver
    and holds its reason."""


#: Errors that follow from another party's failure: a wait that timed out, a peer that went
#: away or closed the channel, a sync the sender abandoned. The other party's error is the
#: one to raise.
CONSEQUENCES: tuple[type[StreamsyncError], ...] = (
    SyncTimeoutError,
    PeerBrokenError,
    EndOfStream,
    SenderAbortedError,
)


def root_cause(errors: Iterable[BaseException | None]) -> BaseException | None:
    """Of the errors the parties of one failed sync raised (``None`` for a party that did
    not fail), the one to raise: the first that is not one of :data:`CONSEQUENCES`, else
    the first; ``None`` when nobody failed. List the receiving side's errors before the
    sender's: a sender's :class:`ReceiverFailedError` only reports a receiver's."""
    found = [e for e in errors if e is not None]
    causes = [e for e in found if not isinstance(e, CONSEQUENCES)]
    return causes[0] if causes else (found[0] if found else None)


def describe(exc: BaseException) -> str:
    """``"ClassName: message"``: how an error reads where only its text crosses a process
    boundary (an HTTP error body)."""
    return f"{type(exc).__name__}: {exc}"


def error_class(name: str, default: type[StreamsyncError] | None = None) -> type[StreamsyncError]:
    """The streamsync exception class called ``name`` (as a peer reports it by name across a
    process boundary); ``default`` (or :class:`StreamsyncError`) for any other name."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, StreamsyncError):
        return cls
    return default if default is not None else StreamsyncError
