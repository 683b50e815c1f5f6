"""Errors cross process boundaries by class name, and a failed sync raises its root cause."""

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
def test_every_error_reads_back_by_class_name(cls: type[ss.StreamsyncError]) -> None:
    assert errors.error_class(cls.__name__, ss.PeerBrokenError) is cls


def test_a_name_of_no_streamsync_error_gets_the_default() -> None:
    assert errors.error_class("KeyError", ss.ReceiverFailedError) is ss.ReceiverFailedError
    assert errors.error_class("root_cause") is ss.StreamsyncError


def test_the_root_cause_is_the_first_that_is_not_a_consequence() -> None:
    cause = ss.UnknownTensorError("w")
    assert errors.root_cause([None, ss.SyncTimeoutError("t"), cause]) is cause
    timeout = ss.SyncTimeoutError("t")
    assert errors.root_cause([None, timeout, ss.EndOfStream("e")]) is timeout
    assert errors.root_cause([None, None]) is None
