"""The synchronous face of a channel (:class:`BlockingWeightSync`, what ``with`` gives): each
call runs the async one in a short-lived event loop on the caller's thread, so the weights
are read, and CUDA work issued, where the trainer runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel

from streamsync.engine.clients import EngineClient, LoopBoundClient, PauseMode
from streamsync.errors import ConfigError
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport

if TYPE_CHECKING:
    from streamsync.engine.channel import EngineChannel
    from streamsync.facts import Needs

T = TypeVar("T")


def run_blocking(
    clients: Sequence[EngineClient],
    form: str,
    call: Callable[[], Awaitable[T]],
    *,
    instead: str | None = None,
) -> T:
    """``call()`` in an event loop of its own on this thread, for the blocking ``form`` of a
    channel into ``clients``; refused, naming the async form (``instead``; default
    ``await <form>``), where an event loop runs already, or where an engine is driven from
    the loop that created it."""
    instead = instead if instead is not None else f"await {form}"
    try:
        anyio.lowlevel.current_token()
    except RuntimeError:
        pass
    else:
        raise ConfigError(
            f"{form} blocks, and an event loop is running in this thread; use '{instead}'"
        )
    for client in clients:
        if isinstance(client, LoopBoundClient) and client.loop_bound:
            raise ConfigError(
                f"{form}: {type(client).__name__} is driven from the event loop that "
                f"created its engine; use '{instead}' on that loop"
            )
    return anyio.run(call)


class BlockingWeightSync:
    """The synchronous face of a channel, what ``with WeightSync(...)`` gives: its calls
    block until done, with no event loop in the caller (the channel runs the transport on
    its own loop thread). Not for ``AsyncLLM``: use ``async with``."""

    def __init__(self, channel: EngineChannel) -> None:
        self.channel = channel

    def __enter__(self) -> BlockingWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def needs(self) -> Mapping[str, Needs]:
        """:attr:`EngineChannel.needs <streamsync.engine.channel.EngineChannel.needs>`."""
        return self.channel.needs

    def _run(self, form: str, call: Callable[[], Awaitable[T]], instead: str | None = None) -> T:
        return run_blocking(self.channel.clients, form, call, instead=instead)

    def update(
        self, weights: Any, *, pipeline: AdapterLike | None = None, delta: bool | None = None
    ) -> SyncReport:
        """:meth:`EngineChannel.update <streamsync.engine.channel.EngineChannel.update>`,
        blocking."""
        call = partial(self.channel.update, weights, pipeline=pipeline, delta=delta)
        return self._run("sync.update(weights)", call)

    def stage(
        self, weights: Any, *, pipeline: AdapterLike | None = None, delta: bool | None = None
    ) -> SyncReport:
        """:meth:`EngineChannel.stage <streamsync.engine.channel.EngineChannel.stage>`,
        blocking."""
        call = partial(self.channel.stage, weights, pipeline=pipeline, delta=delta)
        return self._run("sync.stage(weights)", call)

    def commit(self, *, mode: PauseMode = "keep", version: str | None = None) -> SyncReport:
        """:meth:`EngineChannel.commit <streamsync.engine.channel.EngineChannel.commit>`,
        blocking."""
        call = partial(self.channel.commit, mode=mode, version=version)
        return self._run("sync.commit()", call)

    def drop(self) -> None:
        """:meth:`EngineChannel.drop <streamsync.engine.channel.EngineChannel.drop>`,
        blocking."""
        self._run("sync.drop()", self.channel.drop)

    @property
    def versions(self) -> dict[int, int | None]:
        """:attr:`EngineChannel.versions <streamsync.engine.channel.EngineChannel.versions>`."""
        return self.channel.versions

    @property
    def staged_version(self) -> int | None:
        """:attr:`EngineChannel.staged_version
        <streamsync.engine.channel.EngineChannel.staged_version>`."""
        return self.channel.staged_version

    def update_lora(
        self,
        name: str,
        adapter: Any,
        *,
        config: Any = None,
        pipeline: AdapterLike | None = None,
    ) -> SyncReport:
        """:meth:`EngineChannel.update_lora
        <streamsync.engine.channel.EngineChannel.update_lora>`, blocking."""
        call = partial(self.channel.update_lora, name, adapter, config=config, pipeline=pipeline)
        return self._run("sync.update_lora(...)", call)

    def stage_lora(
        self,
        name: str,
        adapter: Any,
        *,
        config: Any = None,
        pipeline: AdapterLike | None = None,
    ) -> SyncReport:
        """:meth:`EngineChannel.stage_lora
        <streamsync.engine.channel.EngineChannel.stage_lora>`, blocking."""
        call = partial(self.channel.stage_lora, name, adapter, config=config, pipeline=pipeline)
        return self._run("sync.stage_lora(...)", call)

    def commit_lora(self, name: str) -> SyncReport:
        """:meth:`EngineChannel.commit_lora
        <streamsync.engine.channel.EngineChannel.commit_lora>`, blocking."""
        return self._run("sync.commit_lora(name)", partial(self.channel.commit_lora, name))

    def remove_lora(self, name: str) -> None:
        """:meth:`EngineChannel.remove_lora
        <streamsync.engine.channel.EngineChannel.remove_lora>`, blocking."""
        self._run("sync.remove_lora(name)", partial(self.channel.remove_lora, name))

    def wait_ready(self, timeout: float | None = None) -> None:
        """:meth:`EngineChannel.wait_ready
        <streamsync.engine.channel.EngineChannel.wait_ready>`, blocking."""
        self._run("sync.wait_ready()", partial(self.channel.wait_ready, timeout))

    def close(self) -> None:
        """:meth:`EngineChannel.aclose <streamsync.engine.channel.EngineChannel.aclose>`,
        blocking: the transport, the workers' receivers and the channel's loop thread."""
        self._run("sync.close()", self.channel.aclose, "await sync.aclose()")

    def __repr__(self) -> str:
        return f"BlockingWeightSync({self.channel!r})"
