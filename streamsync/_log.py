"""Structured events. One event per sync phase, with bytes and seconds.

If the application configured structlog, events go through its pipeline; otherwise they go to
the standard ``logging`` logger ``"streamsync"`` (silent below WARNING unless configured), so
importing the library never prints anything.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

_logging = logging.getLogger("streamsync")
_stdlib = structlog.wrap_logger(
    _logging,
    processors=[
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.KeyValueRenderer(key_order=["event"]),
    ],
    wrapper_class=structlog.stdlib.BoundLogger,
)


def _logger(level: int) -> Any:
    """The logger for an event at ``level``, or ``None`` where nothing would take it: the
    standard logger below its level costs a check, not a timestamp and a rendering."""
    if structlog.is_configured():
        return structlog.get_logger("streamsync")
    return _stdlib if _logging.isEnabledFor(level) else None


def log(event: str, **fields: Any) -> None:
    """Emit one info-level event."""
    if (logger := _logger(logging.INFO)) is not None:
        logger.info(event, **fields)


def warn(event: str, **fields: Any) -> None:
    """Emit one warning-level event."""
    if (logger := _logger(logging.WARNING)) is not None:
        logger.warning(event, **fields)
