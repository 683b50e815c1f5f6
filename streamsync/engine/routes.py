"""A sharded channel's routes: which workers receive which slices, from which sender.

::

    Needs, per worker and model instance (learned by the workers when the channel opens)
      -> slices_of: per worker, per checkpoint name, the box its instances read
      -> plan_routes: workers that read the same boxes share one route (DP replicas of one
         TP rank), one sender each, at the channel's endpoint or one derived from it
    every sync: the pipeline runs once; each tensor is cut to each route's box (a view)
      -> each route's own send (its bucketer, its transport, its delta baseline)

A tensor a worker reads whole, or that no need names (a name the engine's checkpoint does
not have, an unlearnable loader), goes whole to that route; the report names the second
kind (``SyncReport.unsliced``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import msgspec
import torch

from streamsync.adapters.bucket import Bucketer
from streamsync.boxes import Slices, slices_of
from streamsync.engine.messages import Route
from streamsync.errors import ShapeMismatchError, root_cause
from streamsync.facts import Box, Needs
from streamsync.pipeline import Adapter, AdapterLike, Chain, reading
from streamsync.report import SyncReport
from streamsync.sources import named_tensors
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

_TCP_SCHEMES = ("zmq+tcp", "torch+gloo", "torch+nccl")


@dataclass
class RoutePlan:
    """Workers (named as in a report: ``worker<w>`` or ``engine<e>.worker<w>``) that read
    the same slices, and so receive the same bytes from one sender."""

    workers: list[str]
    #: Per name, the box these workers receive; names absent go whole.
    slices: Slices
    #: Names these workers' needs say they read (whole or in part).
    read: frozenset[str]
    #: The layout digests of the workers' model instances the slices were cut for.
    layouts: tuple[str, ...]
    endpoint: str = ""
    #: Names this route carried whole for want of a learned slice, in the last sync.
    unsliced: set[str] = field(default_factory=set)

    def box(self, name: str, tensor: torch.Tensor) -> Box | None:
        """The box of ``tensor`` this route receives (``None``: all of it, noted in
        :attr:`unsliced` when no need names it); a trainer shape other than the one the
        workers learned against is refused by name."""
        found = self.slices.get(name)
        if found is None:
            if name not in self.read:
                self.unsliced.add(name)
            return None
        box, shape = found
        if tuple(tensor.shape) != shape:
            raise ShapeMismatchError(
                f"tensor {name!r}: the trainer's shape is {list(tensor.shape)}, but workers "
                f"{', '.join(self.workers)} learned their slices against the engine's "
                f"checkpoint shape {list(shape)}"
            )
        return box

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as this route receives it: its box (a view), or all of it."""
        box = self.box(name, tensor)
        if box is None:
            return tensor
        for d, (a, b) in enumerate(zip(box.start, box.stop, strict=True)):
            if b - a != tensor.shape[d]:
                tensor = tensor.narrow(d, a, b - a)
        return tensor


def plan_routes(workers: Iterable[str], needs: Mapping[str, Needs]) -> list[RoutePlan]:
    """Group ``workers`` by the slices their ``needs`` (keyed ``<worker>.<instance>``) give
    them; a worker with no needs (its engine did not say) receives everything whole."""
    per_worker: dict[str, list[Needs]] = {w: [] for w in workers}
    for instance, one in needs.items():
        found = per_worker.get(instance.rpartition(".")[0])
        if found is not None:  # a worker the channel does not count takes no part
            found.append(one)
    routes: dict[Any, RoutePlan] = {}
    for worker, found in per_worker.items():
        slices = slices_of(found)
        key = tuple(sorted(slices.items()))
        plan = routes.get(key)
        if plan is None:
            read = frozenset(n.name for one in found for n in one.needs)
            plan = routes[key] = RoutePlan([], slices, read, ())
        plan.workers.append(worker)
        plan.layouts = tuple(sorted({*plan.layouts, *(one.layout for one in found)}))
    return list(routes.values())


def derive_endpoint(endpoint: str, index: int) -> str:
    """Route ``index``'s endpoint: the channel's for the first, then one beside it (the next
    port over TCP, port 0 staying 0; a suffixed name otherwise)."""
    if index == 0:
        return endpoint
    parts = urlsplit(endpoint)
    query = f"?{parts.query}" if parts.query else ""
    if parts.scheme in _TCP_SCHEMES:
        host, _, port = parts.netloc.rpartition(":")
        shifted = 0 if int(port) == 0 else int(port) + index
        return f"{parts.scheme}://{host}:{shifted}{query}"
    target = endpoint.split("://", 1)[1].split("?", 1)[0]
    return f"{parts.scheme}://{target}.{index}{query}"


def split_cast(pipeline: AdapterLike | None) -> tuple[AdapterLike | None, AdapterLike | None]:
    """``pipeline`` as what runs once before the cut and what each route runs after it: a
    trailing stage that fuses into the bucketer's packing copy (a cast)."""
    if pipeline is None:
        return None, None
    parts = Chain(pipeline).parts
    last = parts[-1] if parts else None
    if isinstance(last, Adapter) and last.fuse(Bucketer(DEFAULT_BUCKET_BYTES)) is not None:
        return (Chain(*parts[:-1]) if len(parts) > 1 else None), last
    return pipeline, None


async def _stream(weights: Any) -> AsyncIterator[Any]:
    source = weights if isinstance(weights, AsyncIterable) else named_tensors(weights)
    async for item in source:
        yield item


#: Per tensor, each route's piece (``None``: not sent from this process).
Cut = Callable[[str, torch.Tensor], Awaitable[list[torch.Tensor | None]]]


async def send_routes(
    weights: Any,
    plans: list[RoutePlan],
    pipeline: AdapterLike | None,
    send_one: Callable[[int, AsyncIterable[Any]], Awaitable[SyncReport]],
    *,
    sliced: bool = True,
    cut: Cut | None = None,
    routes: Sequence[int] | None = None,
) -> list[SyncReport]:
    """One sync over ``routes`` (default: all): ``pipeline`` runs once on ``weights``; each
    tensor is cut per route (unless not ``sliced``: an adapter goes whole to every route)
    and handed to ``send_one(route index, that route's stream)``, all at once. A route that
    fails cancels the others (each aborts its sync on its receivers).

    ``cut``: a collective cut (:meth:`~streamsync.engine.collective.Ranks.cutter`), which every
    rank runs for every tensor in one order: it runs to the end of the stream whatever
    fails, so that no other rank waits for this one."""
    routes = range(len(plans)) if routes is None else routes
    streams = {g: anyio.create_memory_object_stream[Any](1) for g in routes}
    collective = cut is not None
    for plan in plans:
        plan.unsliced = set()

    async def local(name: str, tensor: torch.Tensor) -> list[torch.Tensor | None]:
        return [plan.cut(name, tensor) if sliced else tensor for plan in plans]

    async def produce() -> None:
        chain = Chain(pipeline) if pipeline is not None else Chain()
        pieces_of = cut or local
        try:
            with anyio.CancelScope(shield=collective):
                async with reading(chain(_stream(weights))) as items:
                    async for name, tensor in items:
                        pieces = await pieces_of(name, tensor)
                        for g, (tx, _) in streams.items():
                            if pieces[g] is not None:
                                # A route whose send failed is gone: the others go on.
                                with contextlib.suppress(
                                    anyio.BrokenResourceError, anyio.ClosedResourceError
                                ):
                                    await tx.send((name, pieces[g]))
        finally:
            for tx, _ in streams.values():
                tx.close()

    reports: list[SyncReport | None] = [None] * len(plans)

    async def route(r: int) -> None:
        async def items() -> AsyncIterator[Any]:
            async with streams[r][1] as rx:
                async for item in rx:
                    yield item

        reports[r] = await send_one(r, items())

    errors: list[BaseException] = []

    async def guarded(fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # the first failure cancels the rest; raised below
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(guarded, produce)
        for r in routes:
            tg.start_soon(guarded, route, r)
    cause = root_cause(errors)
    if cause is not None:
        raise cause
    return [report for report in reports if report is not None]


def combined(reports: list[SyncReport], plans: list[RoutePlan]) -> SyncReport:
    """The routes' reports as one sender's: bytes summed, the slowest route's seconds, and
    the tensors carried whole for want of a slice (none: this side sent no route)."""
    if not reports:
        return SyncReport(sync_id=0, side="send", tensors=0, nbytes=0, buckets=0, seconds=0.0)
    first = reports[0]
    phases: dict[str, float] = {}
    for report in reports:
        for phase, seconds in report.phases.items():
            phases[phase] = max(phases.get(phase, 0.0), seconds)
    unsliced = sorted(set().union(*(plan.unsliced for plan in plans)))
    nbytes = sum(r.nbytes for r in reports)
    return msgspec.structs.replace(
        first,
        tensors=max(r.tensors for r in reports),
        nbytes=nbytes,
        wire_bytes=sum(r.wire_bytes for r in reports),
        buckets=sum(r.buckets for r in reports),
        seconds=max(r.seconds for r in reports),
        phases=phases,
        receivers=sum(r.receivers for r in reports),
        absent=tuple(a for r in reports for a in r.absent),
        refused=tuple(a for r in reports for a in r.refused),
        unsliced=tuple(unsliced),
        rank_bytes={0: sum(r.wire_bytes for r in reports)},
        delta=_deltas(reports),
    )


def _deltas(reports: list[SyncReport]) -> Any:
    """The routes' delta reports as one (counts summed; the first route's reason)."""
    found = [r.delta for r in reports if r.delta is not None]
    if not found:
        return None
    first = found[0]
    return msgspec.structs.replace(
        first,
        unchanged=sum(d.unchanged for d in found),
        sparse=sum(d.sparse for d in found),
        dense=sum(d.dense for d in found),
        scan_seconds=math.fsum(d.scan_seconds for d in found),
        baseline_bytes=sum(d.baseline_bytes for d in found),
    )


def routes_for(plans: list[RoutePlan], workers: list[str]) -> tuple[Route, ...]:
    """Per worker of ``workers`` (one engine's, by rank), its :class:`Route`."""
    where = {w: plan for plan in plans for w in plan.workers}
    return tuple(Route(where[w].endpoint, where[w].layouts) for w in workers)
