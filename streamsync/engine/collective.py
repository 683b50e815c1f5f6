"""Collective sharded syncs from a DTensor-sharded trainer (FSDP2): every rank sends the
routes it owns, and no rank gathers a whole tensor.

::

    rank 0 (drives the engine: WeightSync(..., sharded=True, ranks=Ranks()))   other ranks
      learns each worker's needs, plans the routes                        (RankPeer)
      ── Plans (broadcast) ─────────────────────────────> the routes, the engines' facts
      route g is owned by rank g % M; each rank opens the senders of its own routes
      <──────────────────── endpoints (all-gather) ─────────────────────────>
    every sync, every rank, tensor by tensor in the same order:
      DTensor's local shard ∩ each route's box ──point to point──> the route's owner,
      which assembles the box (at most one box at a time) and streams it on its route
      after: each rank's Outcome (all-gather): a failure anywhere fails it everywhere

Each route is fed by one sender, so a worker receives its boxes as from a plain trainer.
Bytes between trainer ranks: of each box, the parts other ranks hold, (M - 1)/M of it for an
even split. Placements: ``Shard(d)`` on a one-dimensional mesh (FSDP2's), ``Replicate``,
and plain tensors (held whole by every rank); anything else is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Literal, TypeVar

import anyio
import anyio.to_thread
import msgspec
import torch

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync.adapters import cast, expand_moe, quantize_fp8, rename, select, split_buffers
from streamsync.boxes import Sharded, box_meet, narrowed
from streamsync.engine.fanout import FanOut, RouteCut, Sends
from streamsync.engine.routes import (
    RoutePlan,
    send_routes,
    split_cast,
)
from streamsync.errors import ConfigError, PeerBrokenError, error_class, root_cause
from streamsync.facts import Box, EngineFacts, Versioned
from streamsync.pipeline import AdapterLike, Chain, Operator, Stage
from streamsync.report import SyncReport
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

T = TypeVar("T")


class _RouteMessage(msgspec.Struct, frozen=True, array_like=True):
    workers: list[str]
    slices: dict[str, tuple[Box, tuple[int, ...]]]
    read: list[str]
    layouts: tuple[str, ...]


class Plans(Versioned, frozen=True, kw_only=True):
    """Rank 0's routes, for the other ranks of a collective sharded channel."""

    what: ClassVar[str] = "rank 0's routes"
    routes: tuple[_RouteMessage, ...]
    #: The facts of the engines rank 0's channel feeds, which every rank's pipeline decides
    #: from alike (``expand_moe("auto")``), whatever is installed beside it.
    engines: tuple[EngineFacts, ...] = ()


class Outcome(Versioned, frozen=True, kw_only=True):
    """One rank's outcome of one collective sync."""

    what: ClassVar[str] = "rank {rank}'s outcome"
    rank: int
    wire_bytes: int = 0
    #: Class name and message of the error the rank hit; empty: it succeeded.
    error: str = ""
    message: str = ""


#: The adapters that work on each rank's shards as on whole tensors: elementwise, by name,
#: by indexing a :class:`~streamsync.boxes.Sharded` (``expand_moe`` takes each expert's
#: slice of the shards), or block by block on each rank (``quantize_fp8``, which refuses by
#: name a shard that cuts a block).
SHARD_ADAPTERS: tuple[Operator[Any], ...] = (
    cast,
    expand_moe,
    quantize_fp8,
    rename,
    select,
    split_buffers,
)


def check_pipeline(pipeline: AdapterLike | None) -> None:
    """Refuse, by name, a pipeline stage that needs whole tensors (your own) in a
    collective sync, where each rank holds shards."""
    if pipeline is None:
        return
    for stage in Chain(pipeline).parts:
        if not (isinstance(stage, Stage) and stage.op in SHARD_ADAPTERS):
            names = sorted(op.fn.__name__ for op in SHARD_ADAPTERS)
            raise ConfigError(
                f"pipeline stage {stage!r} runs on whole tensors; in a collective sharded "
                f"sync each rank holds shards, so only {', '.join(names)} may run there"
            )


class Ranks:
    """The trainer ranks of a collective sharded sync: the ranks of the default
    ``torch.distributed`` group, whose rank 0 drives the engine. Every rank makes one (a
    collective: it makes a gloo group of its own, whose every wait is bounded by
    ``timeout`` seconds, so a rank that died fails the others' sync rather than hanging
    it) and calls every step in the same order."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "Ranks(): a collective sharded sync runs on a torch.distributed process "
                "group; initialise the default group first"
            )
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        #: Per tensor, the most elements this rank assembled of it at once (a route's box):
        #: what the exchange held beyond the rank's own shards.
        self.assembled: dict[str, int] = {}

    def owner(self, route: int) -> int:
        """The rank that sends route ``route``."""
        return route % self.size

    def owns(self, route: int) -> bool:
        return self.owner(route) == self.rank

    # -- control plane: msgspec bytes over the group (never pickle) --------------------

    async def broadcast(self, data: bytes | None) -> bytes:
        """``data`` from rank 0, on every rank."""

        def run() -> bytes:
            dist = torch.distributed
            size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
            dist.broadcast(size, src=self._global(0), group=self.group)
            buf = torch.empty(int(size), dtype=torch.uint8)
            if data is not None:
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            dist.broadcast(buf, src=self._global(0), group=self.group)
            return buf.numpy().tobytes()

        return await anyio.to_thread.run_sync(self._bounded, run, "a broadcast from rank 0")

    async def gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, on every rank."""

        def run() -> list[bytes]:
            dist = torch.distributed
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.empty_like(size) for _ in range(self.size)]
            dist.all_gather(sizes, size, group=self.group)
            most = max(int(s) for s in sizes)
            mine = torch.zeros(most, dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            bufs = [torch.empty(most, dtype=torch.uint8) for _ in range(self.size)]
            dist.all_gather(bufs, mine, group=self.group)
            return [b[: int(s)].numpy().tobytes() for b, s in zip(bufs, sizes, strict=True)]

        return await anyio.to_thread.run_sync(self._bounded, run, "a gather of every rank")

    def _bounded(self, fn: Callable[..., T], what: str, *args: Any) -> T:
        """``fn(*args)``, a call on the group: a rank gone (its connection closed, or no
        answer within the group's timeout) is a :class:`PeerBrokenError` naming ``what``."""
        try:
            return fn(*args)
        except RuntimeError as exc:  # gloo's DistBackendError and its timeouts
            raise PeerBrokenError(
                f"trainer rank {self.rank} of {self.size}: {what} failed, a rank is gone: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc

    def _global(self, rank: int) -> int:
        return int(torch.distributed.get_global_rank(self.group, rank))

    async def share_plans(
        self, plans: list[RoutePlan] | None, engines: tuple[EngineFacts, ...] = ()
    ) -> tuple[list[RoutePlan], tuple[EngineFacts, ...]]:
        """Rank 0's ``plans`` and the facts of the ``engines`` it feeds, on every rank."""
        wire = None
        if plans is not None:
            routes = tuple(
                _RouteMessage(p.workers, dict(p.slices), sorted(p.read), p.layouts) for p in plans
            )
            wire = msgspec.msgpack.encode(Plans(routes=routes, engines=engines).to_wire())
        told = Plans.from_wire(msgspec.msgpack.decode(await self.broadcast(wire)))
        shared = [
            RoutePlan(list(r.workers), dict(r.slices), frozenset(r.read), r.layouts)
            for r in told.routes
        ]
        return shared, told.engines

    async def share_endpoints(self, plans: list[RoutePlan]) -> None:
        """Each route's endpoint, from the rank that opened it, on every rank."""
        mine = {g: p.endpoint for g, p in enumerate(plans) if self.owns(g)}
        for told in await self.gather(msgspec.msgpack.encode(mine)):
            for g, endpoint in msgspec.msgpack.decode(told, type=dict[int, str]).items():
                plans[g].endpoint = endpoint

    async def sync_id(self, sync_id: int | None) -> int:
        """Rank 0's id for this sync, on every rank: each worker refuses another sync's."""
        told = await self.broadcast(None if sync_id is None else sync_id.to_bytes(8, "little"))
        return int.from_bytes(told, "little")

    async def outcome(self, wire_bytes: int, error: BaseException | None) -> dict[int, int]:
        """Every rank's outcome of this sync: raises the root cause of any rank's failure
        (as its own class, named by rank) on every rank; else each rank's bytes sent."""
        mine = Outcome(
            rank=self.rank,
            wire_bytes=wire_bytes,
            error="" if error is None else type(error).__name__,
            message="" if error is None else str(error),
        )
        try:
            gathered = await self.gather(msgspec.msgpack.encode(mine.to_wire()))
        except PeerBrokenError as gone:
            raise (error or gone) from None if error is not None else gone
        told = [
            Outcome.from_wire(msgspec.msgpack.decode(b), rank=r) for r, b in enumerate(gathered)
        ]
        failures: list[BaseException | None] = []
        for one in told:
            if one.rank == self.rank and error is not None:
                failures.append(error)
            elif one.error:
                failures.append(
                    error_class(one.error)(f"trainer rank {one.rank}: {one.error}: {one.message}")
                )
        cause = root_cause(failures)
        if cause is not None:
            raise cause
        return {one.rank: one.wire_bytes for one in told}

    # -- data plane ---------------------------------------------------------------------

    def exchange(self, plans: list[RoutePlan]) -> Exchange:
        """This sync's collective cut (see :class:`Exchange`)."""
        return Exchange(self, plans)

    def _exchange(
        self, name: str, tensor: torch.Tensor, plans: list[RoutePlan]
    ) -> list[torch.Tensor | None]:
        if isinstance(tensor, Sharded):
            local, boxes = tensor.local, tensor.boxes
        else:
            local, boxes = tensor, None
        whole = Box((0,) * tensor.dim(), tuple(tensor.shape))
        out: list[torch.Tensor | None] = []
        for g, plan in enumerate(plans):
            box = plan.box(name, tensor) or whole
            owner = self.owner(g)
            if boxes is None:  # every rank holds all of it
                out.append(narrowed(local, whole, box) if owner == self.rank else None)
                continue
            out.append(self._assemble(local, boxes, box, owner))
            if out[-1] is not None:
                self.assembled[name] = max(self.assembled.get(name, 0), out[-1].numel())
        return out

    def _assemble(
        self, local: torch.Tensor, boxes: list[Box | None], box: Box, owner: int
    ) -> torch.Tensor | None:
        """``box`` of a sharded tensor, on ``owner``: its own part, the others' by message."""
        dist = torch.distributed
        held = boxes[self.rank]
        mine = None if held is None else box_meet(held, box)
        if owner != self.rank:
            if mine is not None and held is not None:
                part = narrowed(local, held, mine).contiguous()
                dist.send(part, dst=self._global(owner), group=self.group)
            return None
        out = torch.empty(box.shape, dtype=local.dtype)
        for r, held_by in enumerate(boxes):
            part_box = None if held_by is None else box_meet(held_by, box)
            if part_box is None:
                continue
            into = narrowed(out, box, part_box)
            if r == self.rank:
                assert held is not None
                into.copy_(narrowed(local, held, part_box))
            else:
                part = torch.empty(part_box.shape, dtype=local.dtype)
                dist.recv(part, src=self._global(r), group=self.group)
                into.copy_(part)
        return out


def sharded(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor | Sharded:
    """``tensor`` as a collective sync streams it: a DTensor of ``Shard(d)`` as
    :class:`Sharded`, a replicated or plain tensor as its (whole) local data."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor.detach()
    placements = tensor.placements
    local = tensor.to_local().detach()
    if len(placements) != 1 or tensor.device_mesh.ndim != 1:
        raise ConfigError(
            f"tensor {name!r}: placements {placements} on a {tensor.device_mesh.ndim}-D mesh; "
            "a collective sharded sync takes Shard(d) or Replicate on a one-dimensional mesh"
        )
    placement = placements[0]
    if isinstance(placement, Replicate):
        return local
    if type(placement) is not Shard:
        raise ConfigError(f"tensor {name!r}: placement {placement} is not Shard(d) or Replicate")
    dim, n = placement.dim, tensor.shape[placement.dim]
    chunk = math.ceil(n / size)
    boxes: list[Box | None] = []
    for r in range(size):
        start, stop = min(r * chunk, n), min((r + 1) * chunk, n)
        lo = [0] * tensor.dim()
        hi = list(tensor.shape)
        lo[dim], hi[dim] = start, stop
        boxes.append(Box(tuple(lo), tuple(hi)) if stop > start else None)
    return Sharded(name, local, boxes, tuple(tensor.shape), rank)


class Exchange:
    """One sync's collective cut, a :data:`~streamsync.engine.routes.Cut`: per tensor, on
    every rank at once, each route's box assembled on its owner from the ranks' shards
    (``None`` on the others). Every rank must run it over the whole stream, once per sync,
    whatever else fails (:meth:`drain` when its sends never started)."""

    def __init__(self, ranks: Ranks, plans: list[RoutePlan]) -> None:
        self.ranks, self.plans = ranks, plans
        self.started = False

    async def __call__(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor | None]:
        self.started = True
        return await anyio.to_thread.run_sync(
            self.ranks._bounded,
            self.ranks._exchange,
            f"the exchange of {name!r}",
            name,
            tensor,
            self.plans,
        )

    async def drain(self, weights: Any, pipeline: AdapterLike | None) -> None:
        """Run the exchange over ``weights`` sending nothing (this rank's sends failed
        before it began), so that no other rank waits for this one's parts."""
        if self.started:
            return

        async def nothing(route: int, stream: AsyncIterable[Any]) -> SyncReport:
            raise AssertionError("no route is sent while draining")

        with anyio.CancelScope(shield=True):
            await send_routes(weights, self.plans, pipeline, nothing, cut=self, routes=())


async def shard_stream(weights: Any, ranks: Ranks) -> AsyncIterator[tuple[str, Any]]:
    """``weights`` (an ``nn.Module``, or a mapping of names to tensors) as named tensors,
    DTensors as :func:`sharded` makes them (each rank's shard, never gathered)."""
    items = (
        weights.state_dict(keep_vars=True).items()
        if isinstance(weights, torch.nn.Module)
        else weights.items()
        if isinstance(weights, Mapping)
        else None
    )
    if items is None:
        raise ConfigError(
            f"a collective sharded sync takes an nn.Module or a mapping of names to tensors, "
            f"not {type(weights).__name__}"
        )
    for name, tensor in items:
        yield name, sharded(name, tensor, ranks.rank, ranks.size)


class CollectiveCut(RouteCut):
    """Each trainer rank its own shards of the routes it owns (route ``g`` is rank
    ``g % M``'s): rank 0's routes, shared with every rank when the fan-out opens; per sync,
    rank 0's id, each route's box assembled on its owner (:class:`Exchange`), and every
    rank's outcome agreed, so that a failure anywhere fails the sync everywhere."""

    peers = True

    def __init__(self, ranks: Ranks, plans: list[RoutePlan] | None = None) -> None:
        """``plans``: rank 0's routes; ``None`` on the other ranks (told when it opens)."""
        super().__init__(plans or ())
        self.ranks = ranks
        self._exchange: Exchange | None = None

    def owned(self) -> list[int]:
        return [g for g in range(len(self.plans)) if self.ranks.owns(g)]

    async def agree(self, engines: tuple[EngineFacts, ...]) -> tuple[EngineFacts, ...]:
        mine = self.plans if self.ranks.rank == 0 else None
        self.plans, told = await self.ranks.share_plans(mine, engines)
        return told

    async def opened(self) -> None:
        await self.ranks.share_endpoints(self.plans)

    async def begin(self, sync_id: int) -> int:
        told = await self.ranks.sync_id(sync_id if self.ranks.rank == 0 else None)
        self._exchange = self.ranks.exchange(self.plans)
        return told

    def check(self, pipeline: AdapterLike | None) -> None:
        check_pipeline(pipeline)

    def stream(self, weights: Any) -> Any:
        return shard_stream(weights, self.ranks)

    def pieces(self) -> Exchange | None:
        return self._exchange

    async def end(
        self,
        weights: Any,
        pipeline: AdapterLike | None,
        conclude: Callable[[], Awaitable[SyncReport]],
    ) -> SyncReport:
        assert self._exchange is not None  # made by begin
        await self._exchange.drain(weights, split_cast(pipeline)[0])
        try:
            report = await conclude()
        except BaseException as exc:
            await self.ranks.outcome(0, exc)  # raises the root cause over every rank
            raise
        sent = await self.ranks.outcome(report.wire_bytes, None)
        return msgspec.structs.replace(report, rank_bytes=sent)


class RankPeer:
    """A trainer rank other than 0 in a collective sharded sync, beside rank 0's
    ``WeightSync(engine, endpoint, sharded=True, ranks=Ranks())``: a fan-out with no engine
    attached, which opens the senders of the routes it owns (at ``endpoint``, its own
    address, derived per route) and sends them at every :meth:`update`, which every rank
    calls with its own shards. Options as rank 0's channel takes them (``pipeline``,
    ``bucket_bytes``, ``timeout``, ``checksum``, ``delta``, the transport's); give every
    rank the same."""

    def __init__(
        self,
        ranks: Ranks,
        endpoint: str,
        *,
        pipeline: AdapterLike | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        checksum: bool = False,
        delta: bool = False,
        **transport_options: Any,
    ) -> None:
        if ranks.rank == 0:
            raise ConfigError("RankPeer: rank 0 drives the engine with WeightSync(ranks=...)")
        check_pipeline(pipeline)
        self.ranks, self.endpoint, self.pipeline = ranks, endpoint, pipeline
        self.delta = delta
        self._fan = FanOut(
            endpoint,
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            checksum=checksum,
            transport_options=transport_options,
            name=f"rank{ranks.rank}",
        )

    @property
    def plans(self) -> list[RoutePlan]:
        """Rank 0's routes, as this rank was told them when it opened."""
        return self._fan.cut.plans

    @property
    def facts(self) -> tuple[EngineFacts, ...]:
        """The facts of the engines rank 0's channel feeds (told with its routes)."""
        return self._fan.engines

    async def __aenter__(self) -> RankPeer:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Take rank 0's routes, open this rank's senders, tell every rank where (a
        collective: rank 0 does the same when its channel opens)."""
        await self._fan.open(CollectiveCut(self.ranks), 0)

    async def update(
        self, weights: Any, *, pipeline: AdapterLike | None = None, delta: bool | None = None
    ) -> SyncReport:
        """This rank's part of one sync (a collective: every rank calls it, rank 0 through
        its channel's ``update``): its shards of ``weights`` (an ``nn.Module`` or a mapping)
        to its routes. Raises any rank's failure, by name; returns this rank's report, with
        every rank's bytes in ``rank_bytes``."""
        check_pipeline(pipeline)
        pipeline = self._fan.told(pipeline if pipeline is not None else self.pipeline)
        mode: bool | Literal["full"] = self.delta and ("full" if delta is False else True)
        cut = self._fan.cut
        sync_id = await cut.begin(0)
        stream = cut.stream(weights)
        sends = Sends.weights(mode)
        sent: SyncReport | BaseException
        try:
            sent = await self._fan.send(stream, pipeline, sends, sync_id=sync_id)
        except Exception as exc:
            sent = exc

        async def concluded() -> SyncReport:
            if isinstance(sent, BaseException):
                raise sent
            return sent

        return await cut.end(stream, pipeline, concluded)

    async def aclose(self) -> None:
        """Close this rank's senders and their loop."""
        try:
            await self._fan.close()
        finally:
            await anyio.to_thread.run_sync(self._fan.stop)
