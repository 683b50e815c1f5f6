"""Structured events. One event per sync phase, with bytes and seconds.

If the application configured structlog, events go through its pipeline; otherwise they go to
the standard ``logging`` logger ``"streamsync"`` (silent below WARNING unless configured), so
importing the library never prints anything.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["log"]

_stdlib = structlog.wrap_logger(
    logging.getLogger("streamsync"),
    processors=[
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.KeyValueRenderer(key_order=["event"]),
    ],
    wrapper_class=structlog.stdlib.BoundLogger,
)


def _logger() -> Any:
    return structlog.get_logger("streamsync") if structlog.is_configured() else _stdlib


def log(event: str, **fields: Any) -> None:
    """Emit one info-level event."""
    _logger().info(event, **fields)


def warn(event: str, **fields: Any) -> None:
    """Emit one warning-level event."""
    _logger().warning(event, **fields)
