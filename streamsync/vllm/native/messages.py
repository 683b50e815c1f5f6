"""What crosses vLLM's control plane for the ``streamsync`` backend, as JSON-native values:
the backend's name and the worker's init info (:class:`TransferInit`); the update info is the
engine seam's :class:`~streamsync.engine.messages.WorkerOptions`."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from streamsync.engine.messages import Versioned
from streamsync.errors import ConfigError, StreamsyncError
from streamsync.sync import DEFAULT_TIMEOUT

#: The name of the backend in vLLM's factories and in ``--weight-transfer-config``.
BACKEND = "streamsync"


class TransferInit(Versioned, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the trainer tells every worker at ``init_weight_transfer_engine`` (as builtins)."""

    what: ClassVar[str] = "streamsync init_info"
    invalid: ClassVar[type[StreamsyncError]] = ConfigError

    #: The transport URL the workers connect to (the trainer's sender is already bound).
    endpoint: str
    #: Keyword arguments of :func:`~streamsync.open_receiver` (``secret``, ``heartbeat``...).
    transport: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Seconds for the connect, and the default for each wait of a sync.
    timeout: float = DEFAULT_TIMEOUT
