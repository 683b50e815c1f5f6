"""The LoRA lifecycle of a channel (:class:`ChannelLoras`): stream an adapter to every
worker (which checks and stages it), then commit the staged version on every engine at
once (:func:`~streamsync.engine.staged.commit_everywhere`, as a staged sync of the weights
commits; at once, or when the trainer chooses); remember what serves under each name;
remove an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from streamsync._log import log, warn
from streamsync.engine.clients import LoraClient, able
from streamsync.engine.fanout import ADAPTER
from streamsync.engine.messages import LoraTarget, WorkerResult
from streamsync.engine.staged import commit_everywhere
from streamsync.errors import ConfigError, LoraError, StreamsyncError
from streamsync.lora import check_lora_name, lora_adapter, lora_id, version_path
from streamsync.pipeline import AdapterLike
from streamsync.report import LoraReport, SyncReport
from streamsync.sending import next_sync_id

if TYPE_CHECKING:
    from streamsync.engine.channel import EngineChannel


@dataclass(frozen=True)
class _Lora:
    """An adapter a channel installed: its serving version, that version's path, its rank."""

    version: int
    path: str
    rank: int


@dataclass(frozen=True)
class _Staged:
    """A version every worker holds and no engine serves yet: its place, and its report."""

    lora: _Lora
    report: SyncReport


class ChannelLoras:
    """The adapters one channel installed, and how it installs and removes them."""

    def __init__(self, channel: EngineChannel) -> None:
        self._channel = channel
        self._loras: dict[str, _Lora] = {}
        self._staged: dict[str, _Staged] = {}

    def _clients(self) -> list[LoraClient]:
        if self._channel.ranks is not None:
            raise ConfigError("a LoRA adapter syncs from one trainer, not from ranks")
        return able(self._channel.clients, LoraClient, "install LoRA adapters")

    async def update(
        self, name: str, adapter: Any, *, config: Any, pipeline: AdapterLike | None
    ) -> SyncReport:
        """``update_lora`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        await self.stage(name, adapter, config=config, pipeline=pipeline)
        return await self.commit(name)

    async def stage(
        self, name: str, adapter: Any, *, config: Any, pipeline: AdapterLike | None
    ) -> SyncReport:
        """``stage_lora`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        channel = self._channel
        self._clients()
        check_lora_name(name)
        lora = lora_adapter(adapter, config)
        current = self._loras.get(name)
        self._staged.pop(name, None)  # a version staged and not committed: replaced
        sync_id = next_sync_id()
        target = LoraTarget(
            name=name,
            version=sync_id,
            config=lora.config,
            keep=(current.version,) if current is not None else (),
        )
        path = version_path(name, sync_id)
        options = msgspec.structs.replace(channel.worker_options, lora=target)
        pipeline = pipeline if pipeline is not None else channel.pipeline
        report = await channel.sync_round(lora.tensors, options, pipeline, ADAPTER, sync_id=sync_id)
        self._staged[name] = _Staged(_Lora(sync_id, path, lora.rank), report)
        log("lora.staged", name=name, path=path)
        return report

    async def commit(self, name: str) -> SyncReport:
        """``commit_lora`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        staged = self._staged.pop(name, None)
        if staged is None:
            raise ConfigError(
                f"commit_lora({name!r}): no version of it is staged; stage_lora(name, "
                "adapter) first"
            )
        lora = staged.lora
        clients, channel = self._clients(), self._channel
        in_flight: list[int | None] = [None] * len(clients)

        async def install(e: int) -> list[WorkerResult]:
            try:
                in_flight[e] = await clients[e].install_lora(name, lora_id(name), lora.path)
            except StreamsyncError:
                raise
            except Exception as exc:
                where = "the engine" if not channel.fanout else f"engine {e}"
                raise LoraError(
                    f"{where} did not install LoRA adapter {name!r} ({lora.path}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            return [WorkerResult(pid=0)] * clients[e].receivers

        def settled(committed: list[int]) -> dict[int, int | None]:
            if len(committed) == len(clients):
                self._loras[name] = lora
            return {e: lora.version if e in committed else None for e in range(len(clients))}

        what = f"LoRA adapter {name!r} ({lora.path})"
        await commit_everywhere(channel, staged.report, install, what=what, settled=settled)
        counts = [n for n in in_flight if n is not None]
        running = sum(counts) if len(counts) == len(in_flight) else None
        if running:
            warn("lora.in_flight", name=name, path=lora.path, requests=running)
        log("lora.installed", name=name, path=lora.path, lora_id=lora_id(name), rank=lora.rank)
        return msgspec.structs.replace(
            staged.report,
            lora=LoraReport(name=name, path=lora.path, rank=lora.rank, in_flight=running),
        )

    def lora(self, name: str) -> tuple[int, str]:
        """``lora`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        state = self._loras.get(name)
        if state is None:
            known = ", ".join(map(repr, sorted(self._loras))) or "none"
            raise ConfigError(
                f"no LoRA adapter {name!r} on this channel (it installed: {known}); "
                "update_lora(name, adapter) first"
            )
        return lora_id(name), state.path

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters this channel installed and serves."""
        return tuple(self._loras)

    async def remove(self, name: str) -> None:
        """``remove_lora`` of :class:`~streamsync.engine.channel.EngineChannel`."""
        channel = self._channel
        clients = self._clients()
        check_lora_name(name)
        for client in clients:
            await client.remove_lora(name, lora_id(name))
        self._loras.pop(name, None)
        self._staged.pop(name, None)
        target = LoraTarget(name=name, version=0, remove=True)
        options = msgspec.structs.replace(channel.worker_options, lora=target)
        await channel.sync_round((), options, None, ADAPTER)
        log("lora.removed", name=name)
