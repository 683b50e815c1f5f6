"""One sync in this process, for users' unit tests of their pipelines and sinks.

:func:`sync` runs :func:`~streamsync.receive` and :func:`~streamsync.send` over a fresh
``memory://`` channel, in one task group, and raises the failure's root cause under its own
class (a bad rename is an :class:`~streamsync.errors.UnknownTensorError`, not an
``ExceptionGroup`` of it and the sender's :class:`~streamsync.errors.ReceiverFailedError`),
with the partial report attached as ``exc.report``.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import anyio

from streamsync.errors import root_cause
from streamsync.pipeline import AdapterLike
from streamsync.receiving import receive
from streamsync.report import SyncReport
from streamsync.sending import send
from streamsync.sink import Sink
from streamsync.transports import open_receiver, open_sender

_channels = itertools.count()


async def sync(
    weights: Any,
    sink: Sink,
    *,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int | None = None,
    timeout: float = 30.0,
    **transport_options: Any,
) -> SyncReport:
    """Send ``weights`` through ``pipeline`` into ``sink`` over ``memory://`` and return the
    sender's report.

    ``transport_options`` are the transport's (``slots``, ``slot_bytes``, ``secret``...,
    as :func:`~streamsync.open_sender` takes them). On failure, the receiver's error is
    raised if it is the cause (the sink refused a tensor), else the sender's (the pipeline
    raised); either carries ``exc.report``.
    """
    url = f"memory://streamsync-testing-{os.getpid()}-{next(_channels)}"
    secret = transport_options.get("secret")
    outcome: dict[str, Any] = {}

    async def run(side: str, fn: Any, on_error: Any = None) -> None:
        try:
            outcome[side] = await fn()
        except Exception as exc:
            outcome[side] = exc
            if on_error is not None:
                await on_error()

    async with (
        open_sender(url, **transport_options) as tx,
        open_receiver(url, secret=secret) as rx,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(run, "rx", lambda: receive(rx, sink, timeout=timeout))
        # A sender that failed before its first bucket leaves the receiver nothing to
        # wait for: closing it tells the receiver (after any abort already sent).
        tg.start_soon(
            run,
            "tx",
            lambda: send(
                weights, tx, pipeline=pipeline, bucket_bytes=bucket_bytes, timeout=timeout
            ),
            tx.aclose,
        )
    failures = [e if isinstance(e, Exception) else None for e in (outcome["rx"], outcome["tx"])]
    cause = root_cause(failures)
    if cause is not None:
        raise cause
    report: SyncReport = outcome["tx"]
    return report
