"""Where the library's events go: the application's structlog pipeline if it configured one,
else the standard ``logging`` logger ``"streamsync"``, at that logger's level."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from streamsync._log import log, warn


@pytest.fixture
def unconfigured() -> Iterator[None]:
    """structlog as a library user finds it; ``capture_logs`` leaves it configured."""
    was = structlog.is_configured()
    yield
    if not was:
        structlog.reset_defaults()


def test_standard_logger_takes_info_events_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamsync")
    log("sync.end", sync_id=7)
    (record,) = [r for r in caplog.records if r.name == "streamsync"]
    assert record.levelno == logging.INFO
    assert "event='sync.end'" in record.getMessage()
    assert "sync_id=7" in record.getMessage()


def test_standard_logger_below_info_takes_warnings_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="streamsync")
    log("sync.end", sync_id=7)
    warn("channel.refused", who="pid 1")
    messages = [r.getMessage() for r in caplog.records if r.name == "streamsync"]
    assert len(messages) == 1
    assert "event='channel.refused'" in messages[0]


@pytest.mark.usefixtures("unconfigured")
def test_a_configured_structlog_gets_every_event_whatever_the_standard_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="streamsync")
    with capture_logs() as events:
        log("sync.end", sync_id=7)
        warn("channel.refused", who="pid 1")
    assert [(e["event"], e["log_level"]) for e in events] == [
        ("sync.end", "info"),
        ("channel.refused", "warning"),
    ]
    assert not [r for r in caplog.records if r.name == "streamsync"]
