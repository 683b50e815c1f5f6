"""The engine seam's trainer side: :class:`EngineChannel`, a persistent channel into one
inference engine, or into several from one stream, each reached through an
:class:`~streamsync.engine.clients.EngineClient`. Its :class:`~.fanout.FanOut` owns the
senders and the cut; a sync round runs the fan-out's send beside every client's receive
and concludes the sync (:mod:`.rounds`). Lifecycles (staging, LoRA adapters) run rounds.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Self, TypeVar, cast

import anyio
import anyio.to_thread
import msgspec

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync._log import log, warn
from streamsync.engine.blocking import BlockingFace, forwarded, run_blocking, two_faced
from streamsync.engine.clients import (
    ConnectingClient,
    EngineClient,
    FactsClient,
    NeedsClient,
    PauseMode,
    VersionClient,
)
from streamsync.engine.collective import CollectiveCut, Ranks, check_pipeline
from streamsync.engine.fanout import FanOut, RouteCut, Sends, WholeCut
from streamsync.engine.loras import ChannelLoras
from streamsync.engine.messages import Route, WorkerOptions, WorkerResult
from streamsync.engine.rounds import SyncRound, each, several
from streamsync.engine.routes import plan_routes
from streamsync.engine.staged import ChannelStaging, Receiving
from streamsync.errors import (
    ClosedError,
    ConfigError,
    ReceiverFailedError,
    StreamsyncError,
    SyncTimeoutError,
    WireFormatError,
)
from streamsync.facts import EngineFacts, Needs, WorkerFacts
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport
from streamsync.sending import next_sync_id
from streamsync.transports import check_options
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

__all__ = ["EngineChannel"]

T = TypeVar("T")


# The channel's own keywords, beside the transport's (``require_all`` is passed on).
_WEIGHT_SYNC_KEYWORDS = (
    "delta",
    "pipeline",
    "bucket_bytes",
    "timeout",
    "checksum",
    "worker_options",
    "sharded",
    "staged",
)


def _sharding(
    clients: Sequence[EngineClient], sharded: bool | None, ranks: Ranks | None, require_all: bool
) -> bool:
    """Whether a channel into ``clients`` is sharded: as asked, or by default where an engine
    has several workers (tensor parallel) and every client can ask them what they read."""
    can_ask = all(isinstance(c, NeedsClient | ConnectingClient) for c in clients)
    if sharded is None:
        sharded = can_ask and require_all and any(c.receivers > 1 for c in clients)
    if sharded and not can_ask:
        raise ConfigError(
            "WeightSync(sharded=True): an engine client cannot say what its workers "
            "read (no needs()); open the channel without sharded=True"
        )
    if ranks is not None and (not sharded or ranks.rank != 0):
        raise ConfigError(
            f"WeightSync(ranks=...): rank 0 drives the engine, with sharded=True; rank "
            f"{ranks.rank} takes part with RankPeer(ranks, endpoint)"
        )
    if sharded and not require_all:
        raise ConfigError(
            "WeightSync(sharded=True) needs require_all=True: a sharded sync sends each "
            "worker its own slices, so it cannot complete without one"
        )
    return sharded


def _engines_of(told: Mapping[int, bytes], url: str) -> list[list[WorkerFacts]]:
    """The workers that joined ``url`` (what each said, by receiver index), by engine and
    rank; each engine's ranks once each."""
    engines: dict[str, list[WorkerFacts]] = {}
    for i, raw in told.items():
        facts = WorkerFacts.from_bytes(raw, who=f"receiver {i} of {url}")
        engines.setdefault(facts.engine_id, []).append(facts)
    found = [sorted(workers, key=lambda w: w.rank) for _, workers in sorted(engines.items())]
    for workers in found:
        ranks = [w.rank for w in workers]
        if ranks != list(range(len(workers))) or {w.workers for w in workers} != {len(workers)}:
            raise WireFormatError(
                f"{url}: engine {workers[0].engine_id!r}'s workers are not each rank once "
                f"(ranks {ranks}, saying {sorted({w.workers for w in workers})} workers)"
            )
    return found


class EngineChannel:
    """A persistent trainer-side channel into one engine, or into several from one stream
    and one sender (fan-out: pass a list of clients).

    The transport's slots and sockets are made once, on the channel's own
    :class:`EventLoopThread`, and reused by every sync, so the channel serves any caller:

    - any event loop, a fresh one per step included: ``async with WeightSync(...) as sync:
      await sync.update(weights)``. A client whose engine is bound to its event loop (vLLM's
      ``AsyncLLM``) must use this form, from that loop;
    - plain synchronous code: ``with WeightSync(...) as sync: sync.update(weights)``, where
      ``sync`` is a :class:`BlockingWeightSync` whose ``update`` blocks (the caller owns no
      event loop and no thread).

    Entering acquires the transport; closing closes it and the workers' receivers.

    An engine that fails a sync (its worker raised, its process died) fails that sync with
    a named error (``exc.engine`` says which, with several); the channel stays open, and a
    restarted engine's workers rejoin it at the next sync. With ``require_all=False`` a sync
    instead completes on the engines that are there and names the others in
    ``report.absent``.
    """

    def __init__(
        self,
        client: EngineClient | Sequence[EngineClient],
        endpoint: str,
        *,
        pipeline: AdapterLike | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        checksum: bool = False,
        worker_options: WorkerOptions | Mapping[str, Any] | None = None,
        require_all: bool = True,
        delta: bool = False,
        sharded: bool | None = None,
        ranks: Ranks | None = None,
        staged: bool = False,
        **transport_options: Any,
    ) -> None:
        #: Whether the channel was given several engines (its report names ``engine<e>.``).
        self.fanout = several(client)
        self.clients: tuple[EngineClient, ...] = (
            tuple(cast("Sequence[EngineClient]", client))
            if self.fanout
            else (cast("EngineClient", client),)
        )
        if not self.clients:
            raise ConfigError("WeightSync: no engine given; pass one engine client or several")
        self.endpoint = endpoint
        self.pipeline = pipeline
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        #: Every update is a delta sync (see :func:`~streamsync.send`); each sync's worker
        #: options take it from here.
        self.delta = delta
        self.worker_options = worker_options  # type: ignore[assignment]  # coerced
        #: False: a sync completes on the engines that are there and names the others in
        #: ``report.absent``.
        self.require_all = require_all
        if not require_all:
            transport_options = {**transport_options, "require_all": False}
        check_options(endpoint, transport_options, caller=("WeightSync", _WEIGHT_SYNC_KEYWORDS))
        # The senders live on a loop thread of the channel's own, started at the first open
        # and kept across reopenings until aclose.
        self._fan = FanOut(
            endpoint,
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            checksum=checksum,
            transport_options=transport_options,
            name="channel",
        )
        connecting = [c for c in self.clients if isinstance(c, ConnectingClient)]
        if connecting and (self.fanout or ranks is not None):
            raise ConfigError(
                f"WeightSync: {type(connecting[0]).__name__} connects its engine's workers "
                "itself; open one channel per engine, without ranks"
            )
        #: The client whose workers connect when told and say what they are.
        self._connecting = connecting[0] if connecting else None
        self._loras = ChannelLoras(self)
        #: What each engine that says so told of itself when the channel opened.
        self.facts: tuple[EngineFacts, ...] = ()
        #: Ask each worker what it reads of each checkpoint tensor when the channel opens
        #: (:attr:`needs`), and send each worker only that.
        self.sharded = _sharding(self.clients, sharded, ranks, require_all)
        #: The trainer ranks of a collective sharded sync, of which this is rank 0.
        self.ranks = ranks
        if ranks is not None:
            check_pipeline(pipeline)
        self._needs: dict[str, Needs] = {}
        #: Every update stages the sync on every worker, then commits it everywhere.
        self.staged = staged
        self._staging = ChannelStaging(self)
        if staged:
            self._staging.require()

    @property
    def worker_options(self) -> WorkerOptions:
        """What every worker is told for each sync (a mapping of
        :class:`WorkerOptions` fields may be assigned); its ``delta`` is the channel's."""
        return self._worker_options

    @worker_options.setter
    def worker_options(self, options: WorkerOptions | Mapping[str, Any] | None) -> None:
        coerced = WorkerOptions.coerce(options)
        if coerced.delta and not self.delta:
            raise ConfigError(
                "worker_options: delta=True is the channel's option, not the workers': "
                "open the channel with delta=True"
            )
        self._worker_options = coerced

    @property
    def timeout(self) -> float:
        """Seconds any single wait of a sync may take (the workers' too)."""
        return self._fan.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._fan.timeout = seconds

    @property
    def url(self) -> str:
        """The URL workers connect to: ``endpoint``, with a port 0 resolved once open."""
        return self._fan.url

    @property
    def receivers(self) -> int:
        """How many workers a sync reaches, over every engine."""
        return sum(c.receivers for c in self.clients)

    def __enter__(self) -> BlockingWeightSync:
        try:
            run_blocking(
                self.clients,
                "with WeightSync(...)",
                self._ensure_open,
                instead="async with WeightSync(...)",
            )
        except BaseException:
            self._fan.stop()
            raise
        return BlockingWeightSync(self)

    def __exit__(self, *exc: object) -> None:
        run_blocking(self.clients, "sync.close()", self.aclose, instead="await sync.aclose()")

    async def __aenter__(self) -> EngineChannel:
        try:
            await self._ensure_open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._fan.stop)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the trainer side, then ask the workers to close theirs (best effort: the
        engine may be gone). A later sync reopens both."""
        with anyio.CancelScope(shield=True):  # every wait in here is bounded
            try:
                await self._close_both()
            finally:
                if not self._fan.is_current():
                    await anyio.to_thread.run_sync(self._fan.stop)

    async def _close_both(self) -> None:
        # What the workers connected to (a port 0 resolved): each route's endpoint.
        urls = [self.url, *(plan.endpoint for plan in self._fan.cut.plans[1:])]
        await self._fan.close()

        async def close(client: EngineClient) -> int:
            return sum([await client.close_receivers(url) for url in urls])

        # An engine that shut down first, or whose RPC fails, is warned of.
        closed = await self._each_client("engine.close_receivers_failed", close)
        log("engine.close", endpoint=self.endpoint, receivers=closed)

    async def _each_client(
        self, failed: str, call: Callable[[EngineClient], Awaitable[T]]
    ) -> list[T | None]:
        """``call(client)`` for every engine at once, each bounded by the channel's timeout;
        an engine whose call fails gets ``None`` and a warning ``failed``."""
        answers: list[T | None] = [None] * len(self.clients)

        async def ask(e: int) -> None:
            try:
                with anyio.fail_after(self.timeout):
                    answers[e] = await call(self.clients[e])
            except Exception as exc:
                warn(failed, endpoint=self.endpoint, engine=e, error=repr(exc))

        await each(len(self.clients), ask)
        return answers

    async def _ensure_open(self) -> FanOut:
        """The fan-out, open: each engine's facts asked, and on a sharded channel each
        worker's needs and the cut they make, once per opening."""
        if not self._fan.is_open:
            if self._connecting is not None:
                await self._join(self._connecting)
                return self._fan
            self.facts = await self._hello()
            cut = WholeCut()
            if self.sharded:
                self._needs = await self._ask_needs()
                cut = self._cut()
            await self._fan.open(cut, self.receivers, engines=self.facts)
        return self._fan

    async def _join(self, client: ConnectingClient) -> None:
        """Open for the workers of an engine that connects them when told
        (:class:`ConnectingClient`), and learn from their introductions how many they are,
        the engine's facts and, sharded, their needs; a sharded channel whose workers read
        slices then reopens with its routes and tells the workers again."""
        try:
            await self._fan.open(WholeCut(), client.receivers)  # 0: as the first one says
            await self._connect(client, needs=self.sharded)
            engines = _engines_of(self._fan.sender(0).introductions(), self.url)
            workers = [w for engine in engines for w in engine]
            client.introduced(len(workers))
            self.facts = tuple(engine[0].engine for engine in engines)
            self._fan.engines = self.facts
            if not self.sharded:
                return
            self._needs = self._named_needs([[list(w.needs) for w in workers]])
            cut = self._cut()
            if type(cut) is WholeCut:
                return
            await self._fan.close()
            await self._fan.open(cut, self.receivers, engines=self.facts)
            await self._connect(client, needs=False)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._fan.close()
            raise

    async def _connect(self, client: ConnectingClient, *, needs: bool) -> None:
        """Tell ``client``'s workers where to connect, and wait until they joined. Where
        the engine says only that its call failed, the sender may know why it refused one
        (a wrong secret, another protocol): that is raised."""
        try:
            await client.connect(self.url, self.routes(), needs=needs)
        except ReceiverFailedError as exc:
            if type(exc) is ReceiverFailedError:
                with contextlib.suppress(SyncTimeoutError):
                    await self._fan.wait_ready(timeout=1.0)
            raise
        await self._fan.wait_ready()

    def routes(self, e: int = 0) -> tuple[Route, ...]:
        """Where each worker of engine ``e`` receives a sharded sync from, by rank (empty
        unless the channel, open, sends slices): what an engine that connects its workers
        ahead of the first sync tells them."""
        return self._fan.cut.routes_for(self._workers(e))

    def _workers(self, e: int) -> list[str]:
        """Engine ``e``'s workers, by rank, named as in a report."""
        where = f"engine{e}." if self.fanout else ""
        return [f"{where}worker{w}" for w in range(self.clients[e].receivers)]

    def _cut(self) -> WholeCut:
        """A sharded channel's cut: its routes, planned from the workers' needs, fed by the
        ranks, or by this process (everything to one route when every worker reads it all)."""
        workers = [w for e in range(len(self.clients)) for w in self._workers(e)]
        plans = plan_routes(workers, self._needs)
        log("engine.routes", endpoint=self.endpoint, routes=[p.workers for p in plans])
        if self.ranks is not None:
            return CollectiveCut(self.ranks, plans)
        sliced = len(plans) > 1 or any(plan.slices for plan in plans)
        return RouteCut(plans) if sliced else WholeCut()

    @property
    def needs(self) -> Mapping[str, Needs]:
        """What each worker's model instance reads of each checkpoint tensor, by its name in
        a report's ``instances`` (``worker<w>.<instance>``), as the workers told it when the
        channel opened (empty without ``sharded=True``); workers of one layout share one
        tuple of needs. Each sync routes every worker the slices its needs name
        (:meth:`routes`)."""
        return types.MappingProxyType(self._needs)

    async def _ask_needs(self) -> dict[str, Needs]:
        """Each worker's needs, asked once per opening; an engine whose answer fails is
        left out, with a warning, as with the hello."""
        told = await self._each_client(
            "engine.needs_failed", lambda client: cast("NeedsClient", client).needs()
        )
        return self._named_needs(told)

    def _named_needs(self, told: Sequence[list[list[Needs]] | None]) -> dict[str, Needs]:
        """Each engine's needs (per worker, per instance), by name in a report."""
        found: dict[str, Needs] = {}
        by_layout: dict[str, Needs] = {}
        for e, workers in enumerate(told):
            for w, instances in enumerate(workers or ()):
                for needs in instances:
                    seen = by_layout.setdefault(needs.layout, needs)
                    where = f"engine{e}.worker{w}" if self.fanout else f"worker{w}"
                    name = f"{where}.{needs.instance}"
                    found[name] = msgspec.structs.replace(seen, instance=name)
        return found

    async def _hello(self) -> tuple[EngineFacts, ...]:
        """Each engine's facts, asked once per opening; an engine whose hello fails (it may
        be down, and rejoin later) is left out, with a warning."""

        async def hello(client: EngineClient) -> EngineFacts | None:
            return await client.hello() if isinstance(client, FactsClient) else None

        told = await self._each_client("engine.hello_failed", hello)
        return tuple(f for f in told if f is not None)

    @two_faced
    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker has joined the channel (``timeout``: the channel's); raises
        why one was refused (a wrong secret, more workers than ``receivers``)."""
        await (await self._ensure_open()).wait_ready(timeout)

    def engine_index(self, e: int) -> int | None:
        """The index errors name for engine ``e`` (``exc.engine``): ``None`` with one."""
        return e if self.fanout else None

    @two_faced
    async def update(
        self, weights: Any, *, pipeline: AdapterLike | None = None, delta: bool | None = None
    ) -> SyncReport:
        """Stream ``weights`` into every worker of every engine; returns the sender's report
        with one :class:`~streamsync.LoadResult` per worker and model instance in
        ``instances`` (``worker<w>.<instance>``, or ``engine<e>.worker<w>.<instance>`` with
        several engines). ``pipeline`` overrides the channel's for this sync; on a channel
        opened with ``delta=True``, ``delta=False`` makes this one sync full (the next is a
        delta on it again).

        A worker's failure is raised as the worker's own exception class, with its partial
        report; with several engines its message and ``exc.engine`` say which engine. The
        engines whose every worker applied the sync still drop their caches.
        """
        mode = self._mode(delta)
        if self.staged:
            await self._staging.stage(weights, pipeline=pipeline, mode=mode)
            return await self._staging.commit("keep")
        try:
            report = await self.sync_round(
                weights, self.worker_options, pipeline, Sends.weights(mode)
            )
        except BaseException:
            self._staging.synced(None)
            raise
        self._staging.synced(report)
        return report

    def _mode(self, delta: bool | None) -> bool | Literal["full"]:
        if delta and not self.delta:
            raise ConfigError("update(delta=True) needs a channel opened with delta=True")
        return self.delta and ("full" if delta is False else True)

    @two_faced
    async def stage(
        self, weights: Any, *, pipeline: AdapterLike | None = None, delta: bool | None = None
    ) -> SyncReport:
        """Deliver ``weights`` into a staging area on every worker of every engine while
        they serve the old version; returns once every worker holds the whole version,
        checked as a sync is (every tensor, checksums if on). Nothing is applied: if any
        worker of any engine fails, every engine drops what it staged and keeps serving
        untouched, and the error names the worker. :meth:`commit` applies it. Options as
        :meth:`update`'s; one version is staged at a time."""
        return await self._staging.stage(weights, pipeline=pipeline, mode=self._mode(delta))

    @two_faced
    async def commit(self, *, mode: PauseMode = "keep", version: str | None = None) -> SyncReport:
        """Apply the staged version on every engine at once: each pauses (``mode``, as
        vLLM's pause takes it: ``keep`` freezes the requests in flight and they go on with
        the new weights, recomputing what they hold, ``wait`` lets them finish first,
        ``abort`` ends them), applies it to every model instance, sets its weight version
        (``version``; default: the sync's id), drops its prefix cache and resumes. Returns
        the sync's report with every worker's instances. A commit that fails on some
        engines after others applied it raises :class:`~streamsync.PartialCommitError`
        naming each engine's version; the next sync is then full on every engine."""
        return await self._staging.commit(mode, version)

    @two_faced
    async def drop(self) -> None:
        """Drop the staged version on every engine (none of them ever served it)."""
        await self._staging.drop()

    @property
    def versions(self) -> dict[int, int | None]:
        """Per engine (by index), the sync id its models hold as this channel knows it
        (``None``: unknown: before the first sync, or after one that failed there)."""
        return dict(self._staging.versions)

    @property
    def staged_version(self) -> int | None:
        """The sync id of the version staged and not yet committed, if any."""
        return None if self._staging.staged is None else self._staging.staged.sync_id

    def drop_baselines(self) -> None:
        """Forget every route's delta baseline: the next sync is full everywhere."""
        self._fan.drop_baselines()

    async def sync_round(
        self,
        weights: Any,
        options: WorkerOptions,
        pipeline: AdapterLike | None,
        sends: Sends,
        *,
        sync_id: int | None = None,
        receiving: Receiving | None = None,
    ) -> SyncReport:
        """One sync into every engine: the fan-out's ``sends`` beside every engine's
        receive (``receiving``: how the workers take it, applied as it lands by default),
        concluded through the cut."""
        receiving = receiving if receiving is not None else Receiving()
        fan = await self._ensure_open()
        timeout = self.timeout if options.timeout is None else options.timeout
        # The workers learn the sync's id up front, so none takes an earlier one's leftovers.
        sync_id = await fan.cut.begin(next_sync_id() if sync_id is None else sync_id)
        options = msgspec.structs.replace(
            options, timeout=timeout, sync_id=sync_id, delta=self.delta
        )
        sync = SyncRound.of(len(self.clients))
        pipeline = pipeline if pipeline is not None else self.pipeline
        fan.cut.check(pipeline)
        pipeline = fan.told(pipeline)
        weights = fan.cut.stream(weights)
        await self._run(sync, fan, options, weights, pipeline, sends, receiving)
        settled = await fan.settle()
        if sync.report is None and sync.send_error is None and not settled:
            # Cancelled (an engine failed first), and a call still runs on the channel's
            # loop: the sender's state is unknown, so it goes.
            await fan.close()
        after = sends.resets and receiving.applies
        return await fan.cut.end(weights, pipeline, lambda: self._conclude(sync, after=after))

    @two_faced
    async def update_lora(
        self,
        name: str,
        adapter: Any,
        *,
        config: Any = None,
        pipeline: AdapterLike | None = None,
    ) -> SyncReport:
        """Stream LoRA adapter ``adapter`` into every worker of every engine and install it
        as ``name``, replacing the version serving under that name; the base weights do not
        move. ``adapter``: a ``peft.PeftModel`` (its active adapter), or named LoRA tensors
        with ``config`` (peft's ``LoraConfig`` or its dict). ``pipeline``: applied to the
        adapter's tensors (default: the channel's).

        Every worker checks the adapter against its engine (LoRA enabled, the rank, the
        modules and shapes, how many adapters it holds) before any engine installs it: a
        :class:`~streamsync.LoraError` names what is wrong, and the previous version keeps
        serving. The report's ``lora`` says what was installed."""
        await self.stage_lora(name, adapter, config=config, pipeline=pipeline)
        return await self._loras.commit(name)

    @two_faced
    async def stage_lora(
        self,
        name: str,
        adapter: Any,
        *,
        config: Any = None,
        pipeline: AdapterLike | None = None,
    ) -> SyncReport:
        """The first half of :meth:`update_lora`: every worker of every engine receives,
        checks and holds the adapter's new version, and every engine keeps serving the
        version it serves under ``name``; :meth:`commit_lora` installs it. Staging ``name``
        again replaces a version staged and not committed."""
        return await self._loras.stage(name, adapter, config=config, pipeline=pipeline)

    @two_faced
    async def commit_lora(self, name: str) -> SyncReport:
        """Install the staged version of adapter ``name`` on every engine at once (vLLM
        swaps it in without a pause; requests generating with ``name`` go on with it);
        returns the staging's report with ``lora`` set."""
        return await self._loras.commit(name)

    def lora(self, name: str) -> tuple[int, str]:
        """The engine's id for adapter ``name`` and the path of the version this channel
        installed last."""
        return self._loras.lora(name)

    @property
    def loras(self) -> tuple[str, ...]:
        """The adapters this channel installed and serves."""
        return self._loras.names

    @two_faced
    async def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` on every engine and drop its tensors on every worker
        (an adapter another channel installed too: adapters outlive their channel)."""
        await self._loras.remove(name)

    async def _run(
        self,
        sync: SyncRound,
        fan: FanOut,
        options: WorkerOptions,
        weights: Any,
        pipeline: AdapterLike | None,
        sends: Sends,
        receiving: Receiving,
    ) -> None:
        """The send beside every engine's receive; a failure that dooms the sync cancels
        the rest (see :meth:`_receive`)."""
        assert options.sync_id is not None  # set by sync_round
        async with anyio.create_task_group() as tg:
            for e, client in enumerate(self.clients):
                tg.start_soon(self._receive, sync, e, client, options, tg.cancel_scope, receiving)
            if not self.require_all:
                receivers = [c.receivers for c in self.clients]
                await sync.joined(fan.sender(0), receivers, within=self.timeout / 2)
            try:
                sync.report = await fan.send(weights, pipeline, sends, sync_id=options.sync_id)
            except StreamsyncError as exc:
                sync.send_error = exc
                if isinstance(exc, ClosedError):
                    await fan.close()  # reopened by the next sync
            except Exception as exc:  # the trainer's own source or pipeline (aborted)
                sync.source_error = exc
            finally:
                receiving.send_ended()
            absent = sync.report is not None and not self.require_all
            # A collective sync whose exchange failed (a rank is gone): the routes of
            # the other ranks may never end, so their workers get the channel's
            # timeout to report, not their receive's. So do the workers of a failed
            # staged sync: nothing of it was applied, and it is dropped everywhere.
            failed = sync.send_error is not None or sync.source_error is not None
            gone = failed and (fan.cut.peers or not receiving.applies)
            if (absent or gone) and await sync.absent_after(self.timeout, self._late):
                tg.cancel_scope.cancel()

    def _late(self, e: int) -> StreamsyncError:
        where = "the engine" if not self.fanout else f"engine {e}"
        late = SyncTimeoutError(
            f"{where} did not report within {self.timeout:g} s of the end of the sync "
            f"from {self.endpoint}, which completed without it"
        )
        late.engine = self.engine_index(e)
        return late

    async def _receive(
        self,
        sync: SyncRound,
        e: int,
        client: EngineClient,
        options: WorkerOptions,
        scope: anyio.CancelScope,
        receiving: Receiving,
    ) -> None:
        """Engine ``e``'s receive on all its workers, into ``sync``. With ``require_all``, an
        engine that fails, or a worker that fails before applying anything (bad options, no
        connection), cancels ``scope``: the sync cannot complete, so the send stops instead
        of waiting out its timeout."""
        limit = self.timeout * 5
        where = "the engine" if not self.fanout else f"engine {e}"

        async def receive() -> Sequence[WorkerResult]:
            routes = self._fan.cut.routes_for(self._workers(e))
            opts = msgspec.structs.replace(options, routes=routes)
            return await receiving(client, self.url, opts, where)

        await sync.collect(
            e,
            receive(),
            limit=limit,
            engine=self.engine_index(e),
            late=f"{where}'s workers did not report on the sync from {self.endpoint} "
            f"within {limit:g} s",
            broken=f"{where} failed to run the receive from {self.endpoint}",
        )
        sync.done(e)
        error = sync.engine_errors.get(e)
        doomed = error is not None or any(not r.ok and r.report is None for r in sync.results[e])
        if doomed and self.require_all:
            scope.cancel()

    async def _conclude(self, sync: SyncRound, *, after: bool = True) -> SyncReport:
        """Raise the sync's root cause, or merge the workers' reports into the sender's;
        either way the engines whose every worker applied it drop their caches (unless
        ``after`` is false: an adapter sync, whose versions the caches tell apart)."""
        if sync.source_error is not None:
            raise sync.source_error
        applied = sync.applied([c.receivers for c in self.clients]) if after else []
        # Without require_all, an engine that could not take part is absent, not a failure.
        absent = {} if self.require_all else dict(sync.engine_errors)
        failure = sync.failure(absent, self.engine_index)
        if failure is not None:
            if applied:
                with anyio.CancelScope(shield=True):
                    await self._after_sync(applied, None)
            raise failure from (sync.send_error if failure is not sync.send_error else None)
        assert sync.report is not None
        merged = sync.merged(self.fanout, absent)
        if absent:
            warn("engine.absent", endpoint=self.endpoint, engines=sorted(absent))
        if applied:
            await self._after_sync(applied, merged)
        log(
            "engine.sync",
            endpoint=self.endpoint,
            engines=len(self.clients),
            workers=sum(len(r) for r in sync.results),
            sync_id=sync.report.sync_id,
        )
        return merged

    async def _after_sync(self, engines: Sequence[int], report: SyncReport | None) -> None:
        async def after(i: int) -> None:
            client = self.clients[engines[i]]
            await client.after_sync()
            if report is not None and isinstance(client, VersionClient):
                await client.set_weight_version(str(report.sync_id))

        try:
            with anyio.fail_after(self.timeout):
                await each(len(engines), after)
        except TimeoutError:
            if report is None:
                warn("engine.after_sync_timeout", endpoint=self.endpoint, engines=list(engines))
                return
            late = SyncTimeoutError(
                f"the engine's after-sync hooks did not finish within {self.timeout:g} s; "
                f"the sync from {self.endpoint} itself completed (exc.report)"
            )
            late.report = report
            raise late from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint!r}, engines={len(self.clients)})"


class BlockingWeightSync(BlockingFace):
    """The synchronous face of a channel, what ``with WeightSync(...)`` gives: each call is
    the channel's, and blocks until done, with no event loop in the caller (the channel runs
    the transport on its own loop thread). Not for ``AsyncLLM``: use ``async with``."""

    channel: EngineChannel

    update = EngineChannel.update
    stage = EngineChannel.stage
    commit = EngineChannel.commit
    drop = EngineChannel.drop
    update_lora = EngineChannel.update_lora
    stage_lora = EngineChannel.stage_lora
    commit_lora = EngineChannel.commit_lora
    remove_lora = EngineChannel.remove_lora
    wait_ready = EngineChannel.wait_ready
    needs: forwarded[Mapping[str, Needs]] = forwarded()
    versions: forwarded[dict[int, int | None]] = forwarded()
    staged_version: forwarded[int | None] = forwarded()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """The channel's ``aclose``, blocking: the transport, the workers' receivers and the
        channel's loop thread."""
        self._run("sync.close()", self.channel.aclose, "await sync.aclose()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.channel!r})"
