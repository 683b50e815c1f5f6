"""Staged syncs on the trainer side (:class:`ChannelStaging`): a version delivered to every
worker of every engine while they serve, then committed everywhere in a short pause, or
nowhere.

::

    stage(weights)      every worker: start_stage (returns at once; the engine serves on)
                        the send, as in any sync (every route of a sharded channel)
                        every worker: staged -> its receive's end
                        any failure: drop on every engine, raise the root cause by name
    commit(mode)        every engine at once, commit_paused: pause (mode), apply, weight
                        version, prefix cache reset (requests in flight recompute), resume
                        all applied: caches reset, each engine's version is the sync's
                        some applied: PartialCommitError naming each engine's version
    drop()              every worker frees its staged version

A failed staging leaves every model as it was. A failed commit leaves the engines that
failed with an unknown version, and the channel's next sync full on every engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio
import msgspec

from streamsync._log import log
from streamsync.engine.clients import (
    EngineClient,
    PauseMode,
    StagingClient,
    VersionClient,
    able,
)
from streamsync.engine.fanout import Sends
from streamsync.engine.messages import WorkerOptions, WorkerResult
from streamsync.engine.rounds import SyncRound, each
from streamsync.errors import (
    ConfigError,
    PartialCommitError,
    ReceiverFailedError,
)
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport

if TYPE_CHECKING:
    from streamsync.engine.channel import EngineChannel

#: The pause modes :meth:`ChannelStaging.commit` takes.
PAUSE_MODES: tuple[PauseMode, ...] = ("keep", "wait", "abort")


class Receiving:
    """How a sync's workers receive: each engine's receive applies as the bytes land."""

    #: Whether the receive applies the sync to the models (the engines' caches then go).
    applies = True

    async def __call__(
        self, client: EngineClient, endpoint: str, options: WorkerOptions, where: str
    ) -> list[WorkerResult]:
        """Engine ``client``'s receive from ``endpoint`` (``where``: how errors name it)."""
        return await client.start_receive(endpoint, options)

    def send_ended(self) -> None:
        """The send ended (done or failed)."""


#: Seconds between the checks on an engine while its workers stage: no RPC waits on a
#: transfer, so an engine that dies is found by asking (each ask pauses it for an RPC).
ALIVE_EVERY = 1.0


class Staging(Receiving):
    """A staged sync's receive: each engine's workers start staging and return at once;
    while the send runs each engine is asked every :data:`ALIVE_EVERY` seconds whether its
    workers still stage (an engine that died, or a worker that failed, fails the sync at
    once); once the send has ended, each worker's end of the staging is collected."""

    applies = False

    def __init__(self, timeout: float) -> None:
        self._sent = anyio.Event()
        #: How long an engine may take to answer whether its workers still stage.
        self.timeout = timeout

    async def __call__(
        self, client: EngineClient, endpoint: str, options: WorkerOptions, where: str
    ) -> list[WorkerResult]:
        staging = cast(StagingClient, client)
        assert options.sync_id is not None  # set by the channel
        sync_id = options.sync_id

        async def bounded(call: Awaitable[list[WorkerResult]], what: str) -> list[WorkerResult]:
            # Each call returns at once on a live engine; one gone never answers.
            try:
                with anyio.fail_after(self.timeout):
                    return await call
            except TimeoutError:
                raise ReceiverFailedError(
                    f"{where} did not {what} sync {sync_id} within {self.timeout:g} s: it is "
                    "gone or stuck"
                ) from None

        started = await bounded(staging.start_stage(endpoint, options), "start staging")
        if not all(r.ok for r in started):
            return started
        while not self._sent.is_set():
            with anyio.move_on_after(ALIVE_EVERY):
                await self._sent.wait()
            if not self._sent.is_set():
                now = await bounded(staging.staged(sync_id, wait=False), "say how it stages")
                if not all(r.ok for r in now):
                    return now
        return await staging.staged(sync_id)

    def send_ended(self) -> None:
        self._sent.set()


async def commit_paused(
    client: StagingClient, sync_id: int, *, version: str, mode: PauseMode
) -> list[WorkerResult]:
    """The commit sequence of one engine, the one place it is written: pause (``mode``),
    apply staged sync ``sync_id`` on every worker; if every worker applied it, set the
    weight version to ``version`` and reset the prefix cache inside the pause (requests in
    flight recompute what they hold on the new weights); resume, whatever happened."""
    await client.pause(mode)
    try:
        results = await client.apply_staged(sync_id, version=version)
        if all(r.ok for r in results):
            if isinstance(client, VersionClient):
                await client.set_weight_version(version)
            await client.reset_prefix_cache()
    finally:
        with anyio.CancelScope(shield=True):
            await client.resume()
    return results


async def commit_everywhere(
    channel: EngineChannel,
    staged: SyncReport,
    apply: Callable[[int], Awaitable[Sequence[WorkerResult]]],
    *,
    what: str,
    settled: Callable[[list[int]], dict[int, int | None]],
) -> SyncRound:
    """Commit a version every worker of every engine holds (``staged``'s: the weights, or
    an adapter) on every engine at once, ``apply(e)`` on engine ``e`` (each bounded): the
    one place a staged version is committed. ``settled(committed)`` records which engines
    committed and returns each engine's version. Returns the round; raises the root cause
    where no engine committed, and :class:`~streamsync.PartialCommitError` where some did
    (the next sync is then full everywhere)."""
    clients = channel.clients
    sync = SyncRound.of(len(clients))
    sync.report = staged
    limit = channel.timeout * 5

    async def one(e: int) -> None:
        where = "the engine" if not channel.fanout else f"engine {e}"
        await sync.collect(
            e,
            apply(e),
            limit=limit,
            engine=channel.engine_index(e),
            late=f"{where} did not commit {what} within {limit:g} s",
            broken=f"{where} failed to commit {what}",
        )

    await each(len(clients), one)
    committed = sync.applied([c.receivers for c in clients])
    versions = settled(committed)
    failure = sync.failure({}, channel.engine_index)
    if failure is None:
        return sync
    channel.drop_baselines()
    if committed:
        failed = sorted(set(versions) - set(committed))
        raise PartialCommitError(
            f"{what} was committed on engines {committed} and failed on engines {failed} "
            f"(their version is unknown; the next sync is full everywhere): "
            f"{type(failure).__name__}: {failure}",
            versions,
        ) from failure
    raise failure


class ChannelStaging:
    """One channel's staged version and each engine's committed one."""

    def __init__(self, channel: EngineChannel) -> None:
        self._channel = channel
        #: The staged sync's report (``None``: nothing staged).
        self.staged: SyncReport | None = None
        #: Per engine, the sync id its models hold as this channel knows it (``None``:
        #: unknown, as before the first sync, or after a failed one).
        self.versions: dict[int, int | None] = dict.fromkeys(range(len(channel.clients)))

    def require(self) -> None:
        """Refuse, by name, a channel whose engines cannot stage."""
        self._clients()

    def _clients(self) -> list[StagingClient]:
        return able(self._channel.clients, StagingClient, "stage a sync (staged=True)")

    def synced(self, report: SyncReport | None) -> None:
        """A plain sync ended: applied everywhere (its report), or failed (``None``)."""
        for e in self.versions:
            self.versions[e] = None if report is None else report.sync_id

    async def stage(
        self, weights: Any, *, pipeline: AdapterLike | None, mode: bool | Literal["full"]
    ) -> SyncReport:
        """``stage`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        channel = self._channel
        self.require()
        if self.staged is not None:
            raise ConfigError(
                f"stage(): sync {self.staged.sync_id} is staged already; commit() or drop() it "
                "first"
            )
        if not channel.require_all:
            raise ConfigError(
                "stage(): a staged sync commits on every engine or none, so it needs "
                "require_all=True"
            )
        try:
            report = await channel.sync_round(
                weights,
                channel.worker_options,
                pipeline,
                Sends.weights(mode),
                receiving=Staging(channel.timeout),
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._drop_everywhere()
            raise
        self.staged = report
        log("engine.staged", endpoint=channel.endpoint, sync_id=report.sync_id)
        return report

    async def commit(self, mode: PauseMode, version: str | None = None) -> SyncReport:
        """``commit`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"commit(mode={mode!r}): use one of {', '.join(PAUSE_MODES)}")
        channel = self._channel
        staged = self.staged
        if staged is None:
            raise ConfigError("commit(): nothing is staged; stage(weights) first")
        self.staged = None
        clients = self._clients()
        label = str(staged.sync_id) if version is None else version

        def apply(e: int) -> Awaitable[list[WorkerResult]]:
            return commit_paused(clients[e], staged.sync_id, version=label, mode=mode)

        def settled(committed: list[int]) -> dict[int, int | None]:
            for e in self.versions:
                self.versions[e] = staged.sync_id if e in committed else None
            return dict(self.versions)

        what = f"sync {staged.sync_id}"
        sync = await commit_everywhere(channel, staged, apply, what=what, settled=settled)
        merged = sync.merged(channel.fanout, {})
        applies = [
            r.report.phases["apply"]
            for results in sync.results
            for r in results
            if r.report is not None and "apply" in r.report.phases
        ]
        if applies:  # the slowest worker's apply (the engines commit at once)
            merged = msgspec.structs.replace(
                merged, phases={**merged.phases, "apply": max(applies)}
            )
        log("engine.committed", endpoint=channel.endpoint, sync_id=staged.sync_id, mode=mode)
        return merged

    async def drop(self) -> None:
        """``drop`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        if self.staged is None:
            return
        self.staged = None
        # The sender's baseline is the staged version, which no model will hold.
        self._channel.drop_baselines()
        await self._drop_everywhere()

    async def _drop_everywhere(self) -> None:
        """Every engine drops its staged version (best effort: a failed engine warns)."""
        channel = self._channel

        async def drop(client: EngineClient) -> None:
            await cast(StagingClient, client).drop()

        await channel._each_client("engine.drop_failed", drop)
