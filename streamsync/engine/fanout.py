"""The trainer side's senders: a :class:`FanOut` owns an event-loop thread of its own, one
sender per route it opens, and a cut that says how a sync's weights reach those routes:

- :class:`WholeCut`: the whole model to one route, every worker of every engine on it;
- :class:`RouteCut`: each route the boxes its workers read (a sharded channel's routes,
  planned from the workers' needs), the pipeline run once and each tensor cut per route;
- ``CollectiveCut`` (:mod:`.collective`): each trainer rank its own shards of the routes it
  owns, assembled point to point, with the outcome agreed by every rank.

An engine channel drives one with its engines attached; a trainer rank other than 0 is one
with none (:class:`~streamsync.engine.collective.RankPeer`). The cut is chosen when the
fan-out opens; a sync round calls the same methods whichever it is.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import anyio

from streamsync._channel import sender_state
from streamsync.engine.loops import EventLoopThread, HostedSender
from streamsync.engine.messages import Route
from streamsync.engine.routes import (
    RoutePlan,
    combined,
    derive_endpoint,
    routes_for,
    send_routes,
    split_cast,
)
from streamsync.errors import describe
from streamsync.facts import EngineFacts
from streamsync.pipeline import AdapterLike, Chain
from streamsync.report import SyncReport
from streamsync.sending import send, send_aside
from streamsync.transports.base import Sender
from streamsync.wire.frames import Abort

#: One route's send: ``(stream, sender, pipeline=...)``, the transport options bound.
SendOne = Callable[..., Awaitable[SyncReport]]


@dataclass(frozen=True)
class Sends:
    """What a sync round sends, chosen by the lifecycle that runs it: ``send`` (the delta
    baseline's :func:`~streamsync.sending.send`, or :func:`~streamsync.sending.send_aside`
    for an adapter), whether a sharded channel slices its tensors per route (``sliced``; an
    adapter goes whole to every route), and whether the engines drop their caches once
    every worker applied it (``resets``; an adapter's version is told apart by name)."""

    send: Callable[..., Awaitable[SyncReport]]
    sliced: bool = True
    resets: bool = True

    @classmethod
    def weights(cls, delta: bool | Literal["full"]) -> Sends:
        """The model's weights, through the delta baseline (``delta``: the send's)."""
        return cls(partial(send, delta=delta))


#: An adapter's tensors, sent aside: whole to every route, the caches kept.
ADAPTER = Sends(send_aside, sliced=False, resets=False)


class WholeCut:
    """The whole model to one route that every worker joins."""

    #: Whether a failed send can leave routes of other trainer ranks that never end (their
    #: workers then get the channel's timeout to report, not their receive's).
    peers = False

    def __init__(self, plans: Sequence[RoutePlan] = ()) -> None:
        #: The routes (none: one route, everything to every worker).
        self.plans = list(plans)

    def owned(self) -> list[int]:
        """The routes this side opens a sender for."""
        return [0]

    def receivers(self, route: int, total: int) -> int:
        """How many workers join route ``route`` of ``total``."""
        return total

    async def agree(self, engines: tuple[EngineFacts, ...]) -> tuple[EngineFacts, ...]:
        """Before the senders open: settle the routes with the other trainer ranks; the
        facts of the engines the sync feeds (``engines``, where this side knows them)."""
        return engines

    async def opened(self) -> None:
        """After the senders opened: tell the other trainer ranks where."""

    async def begin(self, sync_id: int) -> int:
        """A sync starts: its id, as every trainer rank agrees it."""
        return sync_id

    def check(self, pipeline: AdapterLike | None) -> None:
        """Refuse, by name, a pipeline this cut cannot run."""

    def stream(self, weights: Any) -> Any:
        """What this side streams of ``weights``."""
        return weights

    def routes_for(self, workers: list[str]) -> tuple[Route, ...]:
        """Where each of ``workers`` (one engine's, by rank) receives from (none: the
        channel's endpoint)."""
        return ()

    async def send(
        self,
        fan: FanOut,
        weights: Any,
        pipeline: AdapterLike | None,
        one: SendOne,
        sends: Sends,
        sync_id: int,
    ) -> SyncReport:
        """The sync's send over ``fan``'s routes."""
        return await one(weights, fan.sender(0), pipeline=pipeline)

    async def end(
        self,
        weights: Any,
        pipeline: AdapterLike | None,
        conclude: Callable[[], Awaitable[SyncReport]],
    ) -> SyncReport:
        """After the send: the sync's report, as ``conclude()`` gives it (a collective cut
        first lets every rank finish, then agrees the outcome)."""
        return await conclude()


class RouteCut(WholeCut):
    """Each route the boxes its workers read: the pipeline once, a trailing cast fused into
    each route's packing copy, each tensor cut per route (a view)."""

    def owned(self) -> list[int]:
        return list(range(len(self.plans)))

    def receivers(self, route: int, total: int) -> int:
        return len(self.plans[route].workers)

    def routes_for(self, workers: list[str]) -> tuple[Route, ...]:
        return routes_for(self.plans, workers)

    def pieces(self) -> Any:
        """Each tensor's piece per route, or ``None`` for the plain cut of each plan."""
        return None

    async def send(
        self,
        fan: FanOut,
        weights: Any,
        pipeline: AdapterLike | None,
        one: SendOne,
        sends: Sends,
        sync_id: int,
    ) -> SyncReport:
        head, tail = split_cast(pipeline)
        routes = sorted(fan.routes)
        try:  # every worker joins before the first tensor is cut, so each hears an abort
            await fan.wait_ready()
        except BaseException as exc:  # (a collective sync's exchange is drained after)
            with anyio.CancelScope(shield=True):
                for sender in fan.senders:
                    await sender.abort(Abort(sync_id, describe(exc)))
            raise

        async def route(g: int, stream: AsyncIterable[Any]) -> SyncReport:
            return await one(stream, fan.sender(g), pipeline=tail)

        try:
            reports = await send_routes(
                weights,
                self.plans,
                head,
                route,
                sliced=sends.sliced,
                cut=self.pieces(),
                routes=routes,
            )
        except BaseException:
            # A route that completed holds a worker one sync ahead of the others: the next
            # sync is full on every route.
            fan.drop_baselines()
            raise
        return combined(reports, [self.plans[g] for g in routes])


def _abandoned(loop: EventLoopThread, senders: list[Sender]) -> None:
    # A fan-out dropped unclosed: close its senders on its loop, then stop that loop
    # (without waiting: this may run on any thread).
    loop.close_soon(*(sender.aclose for sender in senders))


class FanOut:
    """The senders of one trainer side: a loop thread of its own (started at the first
    open, kept across reopenings until :meth:`stop`), one sender per route the cut owns at
    ``endpoint`` (derived per route), and the sync's send through the cut."""

    def __init__(
        self,
        endpoint: str,
        *,
        bucket_bytes: int,
        timeout: float,
        checksum: bool,
        transport_options: dict[str, Any],
        name: str,
    ) -> None:
        self.endpoint = endpoint
        self.bucket_bytes, self.timeout, self.checksum = bucket_bytes, timeout, checksum
        self._transport_options = transport_options
        self._name = name
        self.cut: WholeCut = WholeCut()
        #: The facts of the engines the routes feed, which the pipeline's adapters decide
        #: from (``expand_moe("auto")``; :meth:`told`).
        self.engines: tuple[EngineFacts, ...] = ()
        self.routes: dict[int, HostedSender] = {}
        self._loop: EventLoopThread | None = None
        self._open: list[Sender] = []  # what the finalizer closes

    @property
    def is_open(self) -> bool:
        return bool(self.routes)

    @property
    def senders(self) -> list[HostedSender]:
        return list(self.routes.values())

    def sender(self, route: int) -> HostedSender:
        return self.routes[route]

    @property
    def url(self) -> str:
        """Route 0's URL (a port 0 resolved), or ``endpoint`` before it opens."""
        first = self.routes.get(0)
        return self.endpoint if first is None else str(getattr(first.sender, "url", self.endpoint))

    async def open(
        self, cut: WholeCut, receivers: int, *, engines: tuple[EngineFacts, ...] = ()
    ) -> None:
        """Open the senders of the routes ``cut`` owns, for ``receivers`` workers in all of
        the ``engines`` (their facts, where this side knows them)."""
        if self._loop is None:
            self._loop = EventLoopThread(f"streamsync-{self._name} {self.endpoint}")
            self._finalizer = weakref.finalize(self, _abandoned, self._loop, self._open)
        self.cut = cut
        self.engines = await cut.agree(engines)
        for g in cut.owned():
            options = {
                "receivers": cut.receivers(g, receivers),
                "slot_bytes": self.bucket_bytes,
                **self._transport_options,
            }
            endpoint = derive_endpoint(self.endpoint, g)
            sender = await HostedSender.open_on(self._loop, endpoint, options)
            self._open.append(sender.sender)
            self.routes[g] = sender
            if cut.plans:
                cut.plans[g].endpoint = str(getattr(sender.sender, "url", endpoint))
        await cut.opened()

    def told(self, pipeline: AdapterLike | None) -> AdapterLike | None:
        """``pipeline`` as it runs into the fan-out's engines: its adapters that decide from
        the engines (``expand_moe("auto")``) told their facts."""
        return None if pipeline is None else Chain(pipeline).for_engines(self.engines)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker joined every route (``timeout``: the fan-out's)."""
        for sender in self.senders:
            await sender.wait_ready(timeout=self.timeout if timeout is None else timeout)

    async def send(
        self, weights: Any, pipeline: AdapterLike | None, sends: Sends, *, sync_id: int
    ) -> SyncReport:
        """Sync ``sync_id`` of ``weights`` (as the cut streams them) over every route."""
        one = partial(
            sends.send,
            bucket_bytes=self.bucket_bytes,
            timeout=self.timeout,
            checksum=self.checksum,
            sync_id=sync_id,
        )
        return await self.cut.send(self, weights, pipeline, one, sends, sync_id)

    async def settle(self) -> bool:
        """Whether no call of a cancelled send still runs on the loop (see
        :meth:`HostedSender.settle`)."""
        return all([await sender.settle() for sender in self.senders])

    def drop_baselines(self) -> None:
        """Forget every route's delta baseline: the next sync is full everywhere."""
        for sender in self.senders:
            sender_state(sender).baseline.drop()

    async def close(self) -> None:
        """Close the senders (the loop thread keeps running; :meth:`open` reopens them)."""
        senders, self.routes = self.senders, {}
        try:
            for sender in senders:
                await sender.aclose()
        finally:
            self._open.clear()

    def stop(self) -> None:
        """Stop the loop thread (after :meth:`close`)."""
        loop, self._loop = self._loop, None
        if loop is not None:
            self._finalizer.detach()
            loop.stop()

    def is_current(self) -> bool:
        """Whether the caller runs on the fan-out's loop thread."""
        return self._loop is not None and self._loop.is_current()
