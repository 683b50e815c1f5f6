"""streamsync: stream model weights from an RL trainer into live inference engines.

Weights flow as ``AsyncIterator[tuple[str, torch.Tensor]]`` through stackable adapters
(:mod:`streamsync.adapters`), over a transport chosen by URL (:mod:`streamsync.transports`),
into a receiver-side sink that runs prepare → load each bucket → finalize.
"""

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync.errors import (
    AuthenticationError,
    ChecksumError,
    ClosedError,
    ConfigError,
    DeltaBaseError,
    DtypeMismatchError,
    DuplicateTensorError,
    EndOfStream,
    LoraError,
    PartialCommitError,
    PeerBrokenError,
    ProtocolVersionError,
    ReceiverFailedError,
    SenderAbortedError,
    ShapeMismatchError,
    StaleSyncError,
    StreamsyncError,
    SyncInProgressError,
    SyncTimeoutError,
    UnknownTensorError,
    UnsupportedVersionError,
    WireFormatError,
)
from streamsync.pipeline import adapter
from streamsync.receiving import receive
from streamsync.report import DeltaReport, LoadResult, LoraReport, SyncReport
from streamsync.sending import send
from streamsync.sink import AbortableSink, ModuleSink, Sink, TargetSink
from streamsync.sources import named_tensors
from streamsync.transports import open_receiver, open_sender
from streamsync.transports.base import Receiver, Sender

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "AbortableSink",
    "AuthenticationError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "DeltaBaseError",
    "DeltaReport",
    "DtypeMismatchError",
    "DuplicateTensorError",
    "EndOfStream",
    "LoadResult",
    "LoraError",
    "LoraReport",
    "ModuleSink",
    "PartialCommitError",
    "PeerBrokenError",
    "ProtocolVersionError",
    "Receiver",
    "ReceiverFailedError",
    "Sender",
    "SenderAbortedError",
    "ShapeMismatchError",
    "Sink",
    "StaleSyncError",
    "StreamsyncError",
    "SyncInProgressError",
    "SyncReport",
    "SyncTimeoutError",
    "TargetSink",
    "UnknownTensorError",
    "UnsupportedVersionError",
    "WireFormatError",
    "adapter",
    "named_tensors",
    "open_receiver",
    "open_sender",
    "receive",
    "send",
]
