"""One sync of a channel into its engines (:class:`SyncRound`): who takes part (without
``require_all``, the engines that joined and those named absent), what each engine's
workers answered, the send's outcome, and from those the error to raise or the merged
report.

A worker's report names its model instances; merged, they are ``worker<rank>.<name>`` (one
engine) or ``engine<e>.worker<rank>.<name>`` (several, from one stream).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from streamsync.engine.messages import WorkerResult
from streamsync.errors import (
    CONSEQUENCES,
    PeerBrokenError,
    ReceiverFailedError,
    SenderAbortedError,
    StreamsyncError,
    SyncTimeoutError,
    root_cause,
)
from streamsync.report import LoadResult, SyncReport
from streamsync.transports.base import Sender


async def each(count: int, call: Callable[[int], Coroutine[Any, Any, object]]) -> None:
    """``call(e)`` for each of ``count`` engines at once; with one engine its error is
    raised as it is, not in a group."""
    if count == 1:
        await call(0)
        return
    async with anyio.create_task_group() as tg:
        for e in range(count):
            tg.start_soon(call, e)


def several(engines: Any) -> bool:
    """Whether ``engines`` is several engines (a list or tuple of them), not one."""
    return isinstance(engines, list | tuple)


def _instances(prefix: str, results: Sequence[WorkerResult]) -> dict[str, LoadResult]:
    """Each worker's model instances as ``<prefix>worker<rank>.<name>``; a worker whose
    sink has no instances (a ``ModuleSink``) as ``<prefix>worker<rank>``."""
    out: dict[str, LoadResult] = {}
    for rank, result in enumerate(results):
        report = result.report
        if report is None:
            continue
        for name, inst in report.instances.items():
            out[f"{prefix}worker{rank}.{name}"] = inst
        if not report.instances:
            out[f"{prefix}worker{rank}"] = LoadResult(
                loaded=report.loaded, missing=report.missing, unexpected=report.unexpected
            )
    return out


@dataclass
class SyncRound:
    """One sync's state: each engine's worker results (by rank) and failures, and the
    send's report or error."""

    results: list[list[WorkerResult]]
    engine_errors: dict[int, StreamsyncError] = field(default_factory=dict)
    report: SyncReport | None = None
    send_error: StreamsyncError | None = None
    #: The trainer's own error (its source or pipeline raised): raised as it is.
    source_error: Exception | None = None
    #: Engines whose receive has not returned yet, and the event their last one sets.
    waiting: set[int] = field(default_factory=set)
    reported: anyio.Event = field(default_factory=anyio.Event)

    @classmethod
    def of(cls, engines: int) -> SyncRound:
        """A round into ``engines`` engines, all of them waited for."""
        return cls(results=[[] for _ in range(engines)], waiting=set(range(engines)))

    async def collect(
        self,
        e: int,
        call: Awaitable[Sequence[WorkerResult]],
        *,
        limit: float,
        engine: int | None,
        late: str,
        broken: str,
    ) -> None:
        """Engine ``e``'s worker results from ``call``, awaited at most ``limit`` seconds,
        into :attr:`results`; a failure into :attr:`engine_errors`, naming ``engine``: a
        :class:`~streamsync.SyncTimeoutError` saying ``late``, the streamsync error the call
        raised, or (the engine's own call failed: it is gone) a
        :class:`~streamsync.ReceiverFailedError` that starts with ``broken``."""
        error: StreamsyncError | None = None
        try:
            with anyio.fail_after(limit):
                self.results[e] = list(await call)
        except TimeoutError:
            error = SyncTimeoutError(late)
        except StreamsyncError as exc:
            error = exc
        except Exception as exc:
            error = ReceiverFailedError(f"{broken}: {type(exc).__name__}: {exc}")
        if error is not None:
            error.engine = engine
            self.engine_errors[e] = error

    def done(self, e: int) -> None:
        """Engine ``e``'s receive returned."""
        self.waiting.discard(e)
        if not self.waiting:
            self.reported.set()

    async def joined(self, sender: Sender, receivers: Sequence[int], *, within: float) -> None:
        """Without ``require_all`` a sync begins with whoever is there: first let each engine
        (``receivers``: each one's worker count) that is alive join (its receive opens its
        workers' receivers, a restarted one's included) or fail, for at most ``within``
        seconds: the workers already there wait for the first bucket with the whole
        timeout, so they must not run out of it meanwhile."""
        with anyio.move_on_after(within):
            while sender.present < sum(receivers) - sum(receivers[e] for e in self.engine_errors):
                await anyio.sleep(0.01)

    async def absent_after(self, timeout: float, late: Callable[[int], StreamsyncError]) -> bool:
        """Without ``require_all``, once the sync completed on the workers there: an engine
        still not reporting within ``timeout`` took no part (its workers' reports came over
        the transport with the sync's end), so it gets ``late(e)`` as its error instead of
        being waited for up to its receive's own, longer limit (a dead engine's RPC may
        never return). Whether any did."""
        with anyio.move_on_after(timeout):
            await self.reported.wait()
        for e in sorted(self.waiting):
            self.engine_errors[e] = late(e)
        return bool(self.waiting)

    def applied(self, receivers: Sequence[int]) -> list[int]:
        """The engines (``receivers``: each one's worker count) whose every worker applied
        the sync."""
        return [
            e
            for e, count in enumerate(receivers)
            if len(self.results[e]) == count and all(r.ok for r in self.results[e])
        ]

    def failure(
        self, absent: Mapping[int, StreamsyncError], engine: Callable[[int], int | None]
    ) -> StreamsyncError | None:
        """The error to raise (the workers', then the engines', then the send's root
        cause), the ``absent`` engines left out; ``engine(e)``: the index named in it. A
        worker's :class:`SenderAbortedError` gives way to the send's own error, which
        caused it, and so does any other consequence (a timeout, a peer gone) when no
        party failed of its own."""
        workers = [
            result.exception(rank, engine=engine(e))
            for e, per_engine in enumerate(self.results)
            if e not in absent
            for rank, result in enumerate(per_engine)
        ]
        if self.send_error is not None:
            workers = [w for w in workers if not isinstance(w, SenderAbortedError)]
        cause = root_cause(
            [
                *(err for e, err in self.engine_errors.items() if e not in absent),
                *workers,
                self.send_error,
            ]
        )
        if isinstance(cause, CONSEQUENCES) and self.send_error is not None:
            cause = self.send_error  # no party's own failure: the trainer's view first
            gone = [
                err
                for e, err in self.engine_errors.items()
                if e not in absent and isinstance(err, PeerBrokenError)
            ]
            if gone:  # the engine's host saw it go, and names it
                named = type(cause)(f"{gone[0]}; {cause}")
                named.engine, named.report = gone[0].engine, cause.report
                cause = named
        assert cause is None or isinstance(cause, StreamsyncError)
        return cause

    def merged(self, fanout: bool, absent: Mapping[int, StreamsyncError]) -> SyncReport:
        """The sender's report with every worker's instances, and the ``absent`` engines
        named in ``absent``."""
        assert self.report is not None
        instances: dict[str, LoadResult] = {}
        worker_bytes: dict[str, int] = {}
        for e, results in enumerate(self.results):
            prefix = f"engine{e}." if fanout else ""
            instances.update(_instances(prefix, results))
            for rank, result in enumerate(results):
                if result.report is not None:
                    worker_bytes[f"{prefix}worker{rank}"] = result.report.wire_bytes
        rank_bytes = self.report.rank_bytes or {0: self.report.wire_bytes}
        merged = msgspec.structs.replace(
            self.report, instances=instances, worker_bytes=worker_bytes, rank_bytes=rank_bytes
        )
        if absent:
            gone = tuple(f"engine {e}: {type(err).__name__}: {err}" for e, err in absent.items())
            merged = msgspec.structs.replace(merged, absent=(*merged.absent, *gone))
        return merged
