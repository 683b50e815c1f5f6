"""How a channel reaches an inference engine: the :class:`EngineClient` protocol, and the
protocols of clients that can do more (:class:`LoopBoundClient`, :class:`FactsClient`,
:class:`NeedsClient`, :class:`ConnectingClient`, :class:`LoraClient`,
:class:`StagingClient`). vLLM's clients are in
:mod:`streamsync.vllm.client`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from streamsync.engine.messages import Route, WorkerOptions, WorkerResult
from streamsync.errors import ConfigError
from streamsync.facts import EngineFacts, Needs

__all__ = ["EngineClient"]


def able(clients: Sequence[EngineClient], kind: Any, cannot: str) -> list[Any]:
    """``clients``, each a ``kind`` (a runtime-checkable protocol); else a
    :class:`~streamsync.ConfigError` naming the first that is not and what it ``cannot``."""
    for client in clients:
        if not isinstance(client, kind):
            raise ConfigError(f"{type(client).__name__} cannot {cannot}")
    return list(clients)


@runtime_checkable
class EngineClient(Protocol):
    """The trainer's handle on one inference engine (see :mod:`streamsync.vllm.client`).
    A client whose engine is bound to one event loop is a :class:`LoopBoundClient`."""

    @property
    def receivers(self) -> int:
        """How many receivers (workers) a sync reaches."""

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        """Run one receive from ``endpoint`` on every worker (started beside the send);
        returns each worker's result, by rank."""

    async def after_sync(self) -> None:
        """After a sync that every worker applied: drop what the old weights computed."""

    async def close_receivers(self, endpoint: str) -> int:
        """Close the workers' receivers for ``endpoint``; returns how many were open."""


@runtime_checkable
class LoopBoundClient(EngineClient, Protocol):
    """A client whose engine can only be driven from the event loop that created it (vLLM's
    ``AsyncLLM``): a channel refuses its blocking form, and the async form runs the
    client's calls on the caller's loop."""

    #: Whether it is bound now (one client class may serve both kinds of engine).
    loop_bound: bool


@runtime_checkable
class FactsClient(EngineClient, Protocol):
    """A client whose engine says what it is (its hello): the channel asks once when it
    opens, and the adapters of each sync decide from the answers (the channel tells them,
    :meth:`~streamsync.pipeline.Adapter.for_engines`), not from what is installed beside
    the trainer."""

    async def hello(self) -> EngineFacts:
        """The engine's facts."""


@runtime_checkable
class ConnectingClient(EngineClient, Protocol):
    """A client whose engine's workers connect to the trainer when told where (vLLM's
    ``init_weight_transfer_engine``) and introduce themselves as they join
    (:class:`~streamsync.facts.WorkerFacts`): the channel opens for as many workers as the
    first says, tells them where, and learns from their introductions how many they are,
    the engine's facts and, sharded, what each reads. Nothing is asked of the client, so a
    client with only the calls of vLLM's weight-sync protocol serves (its ``receivers`` is
    0 until the workers said)."""

    async def connect(self, endpoint: str, routes: tuple[Route, ...], *, needs: bool) -> None:
        """Tell every worker to connect to ``endpoint`` (worker ``r`` to ``routes[r]``
        where given), saying what it reads if ``needs``; returns once each has joined or
        failed to."""

    def introduced(self, workers: int) -> None:
        """The workers said the engine has ``workers`` of them."""


@runtime_checkable
class NeedsClient(EngineClient, Protocol):
    """A client whose workers say what they read of each checkpoint tensor: a channel
    opened with ``sharded=True`` asks once when it opens."""

    async def needs(self) -> list[list[Needs]]:
        """Per worker (by rank), the :class:`~streamsync.facts.Needs` of each of
        its model instances."""


@runtime_checkable
class LoraClient(EngineClient, Protocol):
    """A client whose engine serves LoRA adapters: a channel's ``update_lora`` streams an
    adapter to every worker (which checks and stages it), then asks the engine to install
    the staged version."""

    async def install_lora(self, name: str, lora_id: int, path: str) -> int | None:
        """Install the version every worker staged under ``path`` as adapter ``name``
        (``lora_id``: the engine's id for it, stable across versions), replacing the one
        serving; returns how many requests were generating with ``name`` (they go on with
        the new version), or ``None`` if the engine cannot say."""

    async def remove_lora(self, name: str, lora_id: int) -> None:
        """Stop serving adapter ``name`` (its staged versions are dropped separately)."""


@runtime_checkable
class VersionClient(EngineClient, Protocol):
    """A client whose engine labels its outputs with a weight version: after every sync
    every engine applied, the channel sets it to the sync's id (a staged commit sets it
    inside its pause)."""

    async def set_weight_version(self, version: str) -> None:
        """Label what the engine generates from now on with ``version``."""


PauseMode = Literal["keep", "wait", "abort"]
PauseMode.__doc__ = """How requests in flight fare while a staged version is committed (vLLM's
pause modes): ``keep`` freezes them and they go on with the new weights, ``wait`` lets them
finish first, ``abort`` ends them."""


@runtime_checkable
class StagingClient(EngineClient, Protocol):
    """A client whose workers can stage a sync while the engine serves, and whose engine
    can commit it in a short pause (:mod:`streamsync.staging`): the primitive calls that
    :func:`~streamsync.engine.staged.commit_paused` runs in order."""

    async def start_stage(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        """Start a staged receive from ``endpoint`` on every worker; returns once each has
        started (or failed to), by rank."""

    async def staged(self, sync_id: int, *, wait: bool = True) -> list[WorkerResult]:
        """Each worker's end of staged sync ``sync_id`` (after the send ended), by rank;
        ``wait=False``: at once, a started result for a worker still receiving (the RPC
        fails if the engine is gone)."""

    async def pause(self, mode: PauseMode) -> None:
        """Pause the engine's generation (``mode``) for a commit; an engine that serves no
        request while its caller commits (vLLM's ``LLM``) does nothing."""

    async def apply_staged(self, sync_id: int, *, version: str) -> list[WorkerResult]:
        """Apply staged sync ``sync_id`` on every worker, by rank (an engine whose API labels
        the weight version as the apply ends, as vLLM's server session does, labels it
        ``version`` there)."""

    async def reset_prefix_cache(self) -> None:
        """Drop the prefix cache; requests in flight recompute what they hold."""

    async def resume(self) -> None:
        """Resume generation after :meth:`pause`."""

    async def drop(self) -> None:
        """Drop every worker's staged version, if any."""
