"""Errors cross process boundaries as text one way (``describe`` / ``described``), and a
failed sync raises its root cause."""

from __future__ import annotations

import pytest

import streamsync as ss
from streamsync import errors

CLASSES = [
    obj
    for obj in vars(errors).values()
    if isinstance(obj, type) and issubclass(obj, errors.StreamsyncError)
]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_reads_back_by_class(cls: type[ss.StreamsyncError]) -> None:
    text = errors.describe(cls("model.w: shape (2, 3)"))
    assert errors.described(text, ss.PeerBrokenError) == (cls, "model.w: shape (2, 3)")
    wrapped = f'{{"detail": "500: {text}"}}'  # a server's error body around it
    assert errors.described(wrapped, ss.PeerBrokenError)[0] is cls


def test_text_naming_no_streamsync_error_gets_the_default() -> None:
    assert errors.described("KeyError: 'x'", ss.ReceiverFailedError) == (
        ss.ReceiverFailedError,
        "KeyError: 'x'",
    )


def test_the_root_cause_is_the_first_that_is_not_a_consequence() -> None:
    cause = ss.UnknownTensorError("w")
    assert errors.root_cause([None, ss.SyncTimeoutError("t"), cause]) is cause
    timeout = ss.SyncTimeoutError("t")
    assert errors.root_cause([None, timeout, ss.EndOfStream("e")]) is timeout
    assert errors.root_cause([None, None]) is None
