"""What crosses vLLM's control plane for the ``streamsync`` backend, as JSON-native values:
the backend's name and the worker's init info (:class:`TransferInit`); the update info is the
engine seam's :class:`~streamsync.engine.messages.WorkerOptions`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from streamsync.engine.messages import WORKER_PROTOCOL
from streamsync.errors import ConfigError, ProtocolVersionError
from streamsync.sync import DEFAULT_TIMEOUT

#: The name of the backend in vLLM's factories and in ``--weight-transfer-config``.
BACKEND = "streamsync"


class TransferInit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the trainer tells every worker at ``init_weight_transfer_engine`` (as builtins)."""

    version: int = WORKER_PROTOCOL
    #: The transport URL the workers connect to (the trainer's sender is already bound).
    endpoint: str
    #: Keyword arguments of :func:`~streamsync.open_receiver` (``secret``, ``heartbeat``...).
    transport: dict[str, Any] = {}
    #: Seconds for the connect, and the default for each wait of a sync.
    timeout: float = DEFAULT_TIMEOUT

    def to_wire(self) -> dict[str, Any]:
        """Plain values for the control plane (JSON over HTTP)."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls, data: object) -> TransferInit:
        """The struct from a worker's ``init_info`` dict."""
        version = data.get("version", WORKER_PROTOCOL) if isinstance(data, Mapping) else None
        if version != WORKER_PROTOCOL:
            raise ProtocolVersionError(
                f"streamsync init_info of protocol version {version!r}; this streamsync "
                f"speaks {WORKER_PROTOCOL}: install the same streamsync on trainer and server"
            )
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            fields = ", ".join(f for f in cls.__struct_fields__ if f != "version")
            raise ConfigError(f"streamsync init_info: {exc}; valid fields: {fields}") from None
