"""The trainer side for vLLM: :class:`WeightSync` and ``update_weights`` on the engine
client of an ``LLM`` or ``AsyncLLM`` (:class:`VllmClient`).

The client runs the workers' receive through ``collective_rpc``, with plain values both
ways (msgpack when the engine core is another process), and resets the prefix cache after
a sync (its blocks hold what the old weights computed).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.to_thread

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync._log import warn
from streamsync.engine.blocking import forwarded
from streamsync.engine.channel import BlockingWeightSync, EngineChannel
from streamsync.engine.clients import EngineClient, PauseMode
from streamsync.engine.kept import update_engine
from streamsync.engine.messages import WorkerOptions, WorkerResult
from streamsync.engine.rounds import several
from streamsync.errors import ConfigError, LoraError
from streamsync.facts import EngineFacts, Needs
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport
from streamsync.vllm.extension import WorkerExtension
from streamsync.vllm.lora import lora_request
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from streamsync.vllm.ray import RayActor

_RECEIVE = "streamsync_receive"
_CLOSE = "streamsync_close"
_HELLO = "streamsync_hello"
_NEEDS = "streamsync_needs"
_STAGE = "streamsync_stage"
_STAGED = "streamsync_staged"
_COMMIT = "streamsync_commit"
_DROP = "streamsync_drop"


def _in_flight(engine: Any, name: str) -> int | None:
    """Requests of ``engine`` (an ``LLMEngine`` or ``AsyncLLM``) generating with adapter
    ``name``, or ``None`` where the engine does not say."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if not isinstance(states, Mapping):
        return None
    return sum(1 for state in states.values() if getattr(state, "lora_name", None) == name)


#: What an engine's ``worker_extension_cls`` must name (or a subclass of it).
EXTENSION = "streamsync.vllm.WorkerExtension"


def _vllm_config(llm: Any) -> Any:
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "vllm_config", None) or getattr(llm, "vllm_config", None)
    if config is None:
        raise ConfigError(f"{type(llm).__name__} is not a vLLM LLM or AsyncLLM (no vllm_config)")
    return config


def check_extension(llm: Any) -> None:
    """Raise :class:`~streamsync.ConfigError` unless ``llm``'s workers carry
    :class:`~streamsync.vllm.WorkerExtension` (its ``worker_extension_cls``, checked once
    when a channel is made, not after the engine's RPC fails in every worker)."""
    name = str(getattr(_vllm_config(llm).parallel_config, "worker_extension_cls", "") or "")
    if name == EXTENSION:
        return
    if name:
        module, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, WorkerExtension):
            return
    given = f"worker_extension_cls={name!r}" if name else "no worker_extension_cls"
    raise ConfigError(
        f"the vLLM engine was started with {given}, so its workers cannot receive: start it "
        f'with worker_extension_cls="{EXTENSION}" (the server: --worker-extension-cls '
        f"{EXTENSION})"
    )


class InProcess:
    """An ``LLM`` or ``AsyncLLM`` in this process, as a :class:`VllmClient` calls it:
    awaited on the engine's own loop for an ``AsyncLLM`` (it is then loop-bound), run in a
    worker thread for an ``LLM``. (A Ray actor that holds one is
    :class:`~streamsync.vllm.ray.RayActor`.)"""

    def __init__(self, llm: Any) -> None:
        check_extension(llm)
        self.llm = llm
        self.name = type(llm).__name__
        #: How many workers the engine has (tensor x pipeline parallel).
        self.workers = int(_vllm_config(llm).parallel_config.world_size)
        #: An ``AsyncLLM``: driven from the event loop that created it.
        self.loop_bound = inspect.iscoroutinefunction(getattr(llm, "collective_rpc", None))
        # What takes adapters and tells requests in flight: the AsyncLLM, or LLM's engine.
        self._engine = llm if self.loop_bound else llm.llm_engine

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.loop_bound:
            return await fn(*args)
        return await anyio.to_thread.run_sync(partial(fn, *args), abandon_on_cancel=True)

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """Each worker's answer to ``method`` of the worker extension, by rank."""
        return list(await self._call(partial(self.llm.collective_rpc, method, args=args)))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._call(partial(self.llm.reset_prefix_cache, True)))

    async def pause(self, mode: PauseMode) -> None:
        # An LLM serves no request while its caller commits: only an AsyncLLM pauses.
        if self.loop_bound:
            await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        if self.loop_bound:
            await self.llm.resume_generation()

    async def set_weight_version(self, version: str) -> None:
        if self.loop_bound:
            await self.llm.update_weight_version(version)
        else:
            await self._call(self._engine.set_weight_version, version)

    async def add_lora(self, name: str, lora_id: int, path: str) -> int | None:
        """Install adapter ``name``'s version at ``path``; the requests generating with it."""
        await self._call(
            self._engine.add_lora, lora_request(name, lora_id, path, load_inplace=True)
        )
        return _in_flight(self._engine, name)

    async def remove_lora(self, lora_id: int) -> None:
        await self._call(self._engine.remove_lora, lora_id)

    def check_lora(self) -> None:
        """Refuse, by name, an engine started without LoRA."""
        from streamsync.vllm.lora import NO_LORA

        if getattr(_vllm_config(self.llm), "lora_config", None) is None:
            raise LoraError(NO_LORA)


class VllmClient:
    """A vLLM engine as an engine client, wherever it lives (its ``host``: an
    :class:`InProcess` ``LLM`` or ``AsyncLLM``, or a Ray actor,
    :class:`~streamsync.vllm.ray.RayActor`): the workers' calls go through the engine's
    ``collective_rpc`` into :class:`~streamsync.vllm.WorkerExtension`, the engine's own
    through the host."""

    def __init__(self, host: InProcess | RayActor) -> None:
        self.host = host
        self.receivers = host.workers
        self.loop_bound = host.loop_bound

    async def _results(self, method: str, *args: Any) -> list[WorkerResult]:
        raw = await self.host.rpc(method, *args)
        return [WorkerResult.from_wire(r, rank=rank) for rank, r in enumerate(raw)]

    async def hello(self) -> EngineFacts:
        """The engine's facts, as its first worker tells them."""
        return EngineFacts.from_wire((await self.host.rpc(_HELLO))[0])

    async def needs(self) -> list[list[Needs]]:
        """What each worker's model instances read of each checkpoint tensor, by rank."""
        raw = await self.host.rpc(_NEEDS)
        return [[Needs.from_wire(n, rank=rank) for n in one] for rank, one in enumerate(raw)]

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        return await self._results(_RECEIVE, endpoint, options.to_wire())

    async def after_sync(self) -> None:
        await self.reset_prefix_cache()

    async def reset_prefix_cache(self) -> None:
        # With the requests in flight preempted (they recompute what they hold), so the
        # reset cannot fail for blocks they hold and leave the old weights' KV cached.
        if not await self.host.reset_prefix_cache():
            warn("vllm.prefix_cache_kept", engine=self.host.name)

    async def set_weight_version(self, version: str) -> None:
        """What each output's ``weight_versions`` spans carry from now on."""
        await self.host.set_weight_version(version)

    async def start_stage(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        return await self._results(_STAGE, endpoint, options.to_wire())

    async def staged(self, sync_id: int, *, wait: bool = True) -> list[WorkerResult]:
        return await self._results(_STAGED, sync_id, wait)

    async def pause(self, mode: PauseMode) -> None:
        await self.host.pause(mode)

    async def apply_staged(self, sync_id: int, *, version: str) -> list[WorkerResult]:
        return await self._results(_COMMIT, sync_id)

    async def resume(self) -> None:
        await self.host.resume()

    async def drop(self) -> None:
        await self.host.rpc(_DROP)

    async def close_receivers(self, endpoint: str) -> int:
        return sum(await self.host.rpc(_CLOSE, endpoint))

    async def install_lora(self, name: str, lora_id: int, path: str) -> int | None:
        return await self.host.add_lora(name, lora_id, path)

    async def remove_lora(self, name: str, lora_id: int) -> None:
        await self.host.remove_lora(lora_id)


def host_of(llm: Any) -> InProcess | RayActor:
    """Where engine ``llm`` lives: a Ray actor handle's actor, or this process."""
    if type(llm).__module__.startswith("ray."):
        from streamsync.vllm.ray import RayActor

        return RayActor(llm)
    return InProcess(llm)


def _in_process(llm: Any) -> bool:
    """Whether ``llm``'s engine core (and so its workers) runs in this process."""
    engine = getattr(llm, "llm_engine", llm)
    return type(getattr(engine, "engine_core", None)).__name__ == "InprocClient"


def _clients(llm: Any) -> EngineClient | list[EngineClient]:
    if not several(llm):
        return VllmClient(host_of(llm))
    local = [e for e, one in enumerate(llm) if _in_process(one)]
    if len(local) > 1:
        # vLLM keeps the current config in a process-wide global that every weight load
        # sets, so two engines' workers in one process cannot load at the same time.
        raise ConfigError(
            f"engines {local} run their engine core in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0): their workers cannot load concurrently, "
            "so one channel cannot feed them; start them with multiprocessing (vLLM's "
            "default), or in processes of their own"
        )
    return [VllmClient(host_of(one)) for one in llm]


class WeightSync(EngineChannel):
    """A persistent channel into one vLLM engine, or into several from one stream
    (:class:`streamsync.engine.channel.EngineChannel` on their :class:`VllmClient`).

    From synchronous code (an ``LLM``)::

        with WeightSync(llm, endpoint) as sync:
            for step in ...:
                sync.update(ss.named_tensors(model))

    From an event loop (required for an ``AsyncLLM``, from its loop)::

        async with WeightSync(llm, endpoint) as sync:
            await sync.update(ss.named_tensors(model))

    ``llm`` may be a list of engines (data-parallel replicas): every worker of every one
    receives the same stream, and the report names ``engine<e>.worker<w>.<instance>``.
    """

    def __init__(self, llm: Any, endpoint: str, **options: Any) -> None:
        """``options``: those of :class:`~streamsync.engine.channel.EngineChannel`."""
        super().__init__(_clients(llm), endpoint, **options)
        self.llm = llm

    def __enter__(self) -> BlockingVllmSync:
        return BlockingVllmSync(super().__enter__().channel)

    def lora_request(self, name: str) -> Any:
        """The vLLM ``LoRARequest`` that generates with adapter ``name``'s installed version
        (``llm.generate(..., lora_request=sync.lora_request(name))``)."""
        lora_id, path = self.lora(name)
        return lora_request(name, lora_id, path)

    async def stage_lora(
        self,
        name: str,
        adapter: Any,
        *,
        config: Any = None,
        pipeline: AdapterLike | None = None,
    ) -> SyncReport:
        for client in self.clients:
            cast("VllmClient", client).host.check_lora()
        return await super().stage_lora(name, adapter, config=config, pipeline=pipeline)


class BlockingVllmSync(BlockingWeightSync):
    """What ``with WeightSync(llm, ...)`` gives: the blocking face of :class:`WeightSync`."""

    channel: WeightSync

    lora_request: forwarded[Callable[[str], Any]] = forwarded()


async def update_weights(
    llm: Any,
    weights: Any,
    *,
    endpoint: str,
    pipeline: AdapterLike | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
    worker_options: WorkerOptions | Mapping[str, Any] | None = None,
    **options: Any,
) -> SyncReport:
    """Sync ``weights`` into every worker (and model instance) of ``llm``: an ``LLM`` or
    ``AsyncLLM``, or a list of them (data-parallel replicas fed from one stream and one
    sender; the report names ``engine<e>.worker<w>.<instance>``).

    The channel for (``llm``, ``endpoint``) is kept open for later calls, so its slots and
    sockets are reused, and any event loop may call it, a fresh one per step included (a
    synchronous trainer that runs each call in a new loop). Synchronous code can also hold
    the channel itself:
    ``with WeightSync(llm, endpoint) as sync: sync.update(weights)``.
    """
    return await update_engine(
        llm,
        weights,
        client=lambda one: VllmClient(host_of(one)),
        endpoint=endpoint,
        pipeline=pipeline,
        bucket_bytes=bucket_bytes,
        timeout=timeout,
        worker_options=worker_options,
        **options,
    )
