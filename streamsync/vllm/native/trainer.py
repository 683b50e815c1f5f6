"""The trainer side of the ``streamsync`` backend: :class:`StreamsyncInitInfo`, vLLM's
``TrainerWeightTransferEngine`` on a :class:`~streamsync.engine.channel.EngineChannel`, and a
``VLLMWeightSyncClient`` for an in-process ``AsyncLLM``."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Self, TypeVar

import anyio.to_thread
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from streamsync import errors
from streamsync._channel import DEFAULT_TIMEOUT
from streamsync._log import log
from streamsync.engine.channel import BlockingWeightSync, EngineChannel
from streamsync.engine.clients import PauseMode
from streamsync.engine.messages import Route, WorkerOptions, WorkerResult
from streamsync.errors import (
    ConfigError,
    LoraError,
    PeerBrokenError,
    ReceiverFailedError,
    StreamsyncError,
    SyncTimeoutError,
    error_class,
)
from streamsync.facts import Needs
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport
from streamsync.vllm.native.worker import StagedStep, TransferInit
from streamsync.vllm.server import BACKEND, call
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

T = TypeVar("T")


@dataclass
class StreamsyncInitInfo(TrainerInitInfo):
    """The trainer's init info for the ``streamsync`` backend
    (``WeightTransferTrainerFactory.trainer_init(StreamsyncInitInfo(rank=...), ...)``)."""

    backend: ClassVar[str] = BACKEND

    #: The transport URL the trainer binds (port 0: a free one) and the workers connect to.
    endpoint: str = "zmq+tcp://127.0.0.1:0"
    #: Adapters applied to the source's stream on the trainer (MoE expansion, FP8, ...).
    pipeline: AdapterLike | None = None
    #: Bytes per bucket (the transport's slot size).
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    #: Seconds for each wait of a sync, and for the workers' connect.
    timeout: float = DEFAULT_TIMEOUT
    #: The channel's shared secret, sent to the workers in the init call, in clear; leave it
    #: ``None`` and set ``$STREAMSYNC_SECRET`` on both sides to keep it off the wire.
    secret: str | None = None
    #: How many workers receive (tensor x pipeline x data parallel size). ``None``: as the
    #: workers say when they connect; a number given is checked against what they say.
    receivers: int | None = None
    #: :class:`~streamsync.engine.channel.WorkerOptions` fields for every sync (``lifecycle``,
    #: ``quirks``, ``transport``).
    worker_options: Mapping[str, Any] | None = None
    #: Delta syncs (see :func:`streamsync.send`): each ``send_weights`` moves only what
    #: changed since the last.
    delta: bool = False
    #: Each worker says, when it connects, what it reads of each checkpoint tensor
    #: (:attr:`StreamsyncTrainerEngine.needs`), and then receives only the slices its
    #: loaders read (``docs/sharded.md``).
    sharded: bool = False
    #: Staged syncs (``docs/staged.md``): each ``send_weights`` stages the version on every
    #: worker while the server generates, then commits it in a pause of its own (``pause_mode``)
    #: that covers only the apply; do not ``/pause`` around it.
    staged: bool = False
    #: How requests in flight fare during a staged commit: ``keep``, ``wait`` or ``abort``.
    pause_mode: PauseMode = "keep"


class _VllmClient:
    """The :class:`~streamsync.engine.channel.EngineClient` over a ``VLLMWeightSyncClient``: the
    receive is vLLM's ``update_weights`` call (blocking, so in a thread)."""

    def __init__(
        self,
        client: VLLMWeightSyncClient,
        receivers: int | None,
        *,
        transport: dict[str, Any],
        timeout: float,
    ) -> None:
        if receivers is not None and (not isinstance(receivers, int) or receivers < 1):
            raise ConfigError(
                f"StreamsyncInitInfo(receivers={receivers!r}): use a count >= 1, or None"
            )
        self.client = client
        #: How many workers the engine has, as they said when they joined (0 before).
        self.receivers = 0
        self._given = receivers
        self._transport, self._timeout = transport, timeout
        #: Whether the next staged receive goes into the speculative drafter.
        self.draft = False

    async def connect(self, endpoint: str, routes: tuple[Route, ...], *, needs: bool) -> None:
        """vLLM's ``init_weight_transfer_engine``: every worker connects to ``endpoint``
        (its route's, sharded) and introduces itself
        (:class:`~streamsync.facts.WorkerFacts`)."""
        init = TransferInit(
            endpoint=endpoint,
            transport=self._transport,
            timeout=self._timeout,
            routes=routes,
            needs=needs,
        )
        try:
            await anyio.to_thread.run_sync(
                self.client.init_weight_transfer_engine, init.to_wire(), abandon_on_cancel=True
            )
        except Exception as exc:
            import requests

            base_url = getattr(self.client, "base_url", None)
            if base_url is not None and isinstance(exc, requests.ConnectionError):
                raise PeerBrokenError(
                    f"the vLLM server at {base_url} cannot be reached (init_weight_transfer_"
                    f"engine: {type(exc).__name__}: {exc}); check that it runs and that this "
                    "machine reaches it"
                ) from exc
            raise _rpc_error("init_weight_transfer_engine", exc) from exc

    def introduced(self, workers: int) -> None:
        if self._given is not None and self._given != workers:
            raise ConfigError(
                f"StreamsyncInitInfo(receivers={self._given}) but the engine's workers say "
                f"they are {workers} (tensor x pipeline x data parallel); leave receivers "
                "unset: the workers say how many they are"
            )
        self.receivers = workers

    async def _staged_step(
        self, step: StagedStep, *, draft: bool = False, version: str | None = None
    ) -> list[WorkerResult]:
        """``step`` on every worker, in one of vLLM's weight-update sessions (``draft``:
        the drafter's) that ends with ``version``; each worker's result."""
        try:
            await anyio.to_thread.run_sync(
                partial(_in_session, self.client, step.to_wire(), draft, version),
                abandon_on_cancel=True,
            )
        except Exception as exc:
            error = _rpc_error(f"update_weights ({step.staged} step)", exc)
            return [WorkerResult.failed(error) for _ in range(self.receivers)]
        return [WorkerResult(pid=0) for _ in range(self.receivers)]

    async def start_stage(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        _can_pause(self.client)  # before anything moves: the commit needs a pause
        step = StagedStep(staged="stage", sync_id=options.sync_id, options=options)
        return await self._staged_step(step, draft=self.draft)

    async def staged(self, sync_id: int, *, wait: bool = True) -> list[WorkerResult]:
        return await self._staged_step(
            StagedStep(staged="wait" if wait else "poll", sync_id=sync_id)
        )

    async def pause(self, mode: PauseMode) -> None:
        """The server's ``/pause?mode=`` (its cache kept: the commit resets it)."""
        pause = partial(_control, self.client, "pause", mode=mode)
        await anyio.to_thread.run_sync(pause, abandon_on_cancel=True)

    async def apply_staged(self, sync_id: int, *, version: str) -> list[WorkerResult]:
        """The commit step in one of vLLM's weight-update sessions, which labels the
        server's weight version ``version`` as it ends."""
        return await self._staged_step(
            StagedStep(staged="commit", sync_id=sync_id), version=version
        )

    async def reset_prefix_cache(self) -> None:
        reset = partial(_control, self.client, "reset_prefix_cache")
        await anyio.to_thread.run_sync(reset, abandon_on_cancel=True)

    async def resume(self) -> None:
        resume = partial(_control, self.client, "resume")
        await anyio.to_thread.run_sync(resume, abandon_on_cancel=True)

    async def drop(self) -> None:
        failed = [r for r in await self._staged_step(StagedStep(staged="drop")) if not r.ok]
        if failed:
            raise failed[0].exception(0) or ReceiverFailedError("drop failed")

    async def start_receive(self, endpoint: str, options: WorkerOptions) -> list[WorkerResult]:
        # The workers receive from the endpoint of init_weight_transfer_engine.
        try:
            await anyio.to_thread.run_sync(
                self.client.update_weights, options.to_wire(), abandon_on_cancel=True
            )
        except Exception as exc:
            # The server says little (HTTP 500); the worker's own error, by class, reached
            # the sender over the transport and is raised from StreamsyncTrainerEngine.
            error = _rpc_error("update_weights", exc)
            return [WorkerResult.failed(error) for _ in range(self.receivers)]
        return [WorkerResult(pid=0) for _ in range(self.receivers)]

    async def after_sync(self) -> None:
        # vLLM's /pause and /resume own the caches (pause(clear_cache=...)).
        pass

    async def install_lora(self, name: str, lora_id: int, path: str) -> int | None:
        # vLLM's own routes: the engine picks its id; the name and path are what count.
        await anyio.to_thread.run_sync(
            _lora_route, self.client, "load", name, path, abandon_on_cancel=True
        )
        return None

    async def remove_lora(self, name: str, lora_id: int) -> None:
        await anyio.to_thread.run_sync(
            _lora_route, self.client, "unload", name, None, abandon_on_cancel=True
        )

    async def close_receivers(self, endpoint: str) -> int:
        shutdown = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if shutdown is None:
            return 0
        await anyio.to_thread.run_sync(shutdown, abandon_on_cancel=True)
        return self.receivers


def _own_error(call: Callable[[Any], T], weights: Any) -> T:
    """``call(weights)``, raising the worker's own error where the transport carried it to
    the sender (vLLM's server says only that its call failed)."""
    try:
        return call(weights)
    except ReceiverFailedError as exc:
        cause = exc.__cause__
        if isinstance(cause, StreamsyncError) and not isinstance(
            cause, (ReceiverFailedError, *errors.CONSEQUENCES)
        ):
            cause.add_note(str(exc))
            raise cause from None
        raise


def _in_session(client: Any, update_info: dict[str, Any], draft: bool, version: str | None) -> None:
    """``update_weights(update_info)`` between vLLM's ``start_weight_update`` (``draft``:
    ``start_draft_weight_update``) and ``finish_weight_update(version)``."""
    _start_draft(client) if draft else client.start_weight_update()
    try:
        client.update_weights(update_info)
    except BaseException:
        with contextlib.suppress(Exception):  # a failed update ended it on the workers
            client.finish_weight_update(None)
        raise
    client.finish_weight_update(version)


#: What a staged commit asks of the engine, by the ``VLLMWeightSyncClient`` method that
#: does it (:class:`AsyncLLMWeightSyncClient`'s), else the server's route and its query.
_CONTROLS: dict[str, tuple[str, dict[str, Any]]] = {
    "pause": ("pause", {"clear_cache": "false"}),
    "reset_prefix_cache": ("reset_prefix_cache", {"reset_running_requests": "true"}),
    "resume": ("resume", {}),
}


def _can_pause(client: Any) -> None:
    """Refuse, by name, a client that cannot pause its engine for a staged commit."""
    if not callable(getattr(client, "pause", None)) and getattr(client, "base_url", None) is None:
        raise ConfigError(
            f"{type(client).__name__} cannot pause its engine (no pause() method, no "
            "base_url to post /pause to), so it cannot commit a staged sync; use "
            "staged=False and pause around send_weights"
        )


def _control(client: Any, what: str, **query: Any) -> None:
    """``what`` (pause, reset_prefix_cache, resume) on the engine behind ``client``: the
    client's method of that name, else the server's route."""
    method = getattr(client, what, None)
    if callable(method):
        method(**query)
        return
    route, fixed = _CONTROLS[what]
    _http(client, "POST", route, params={**fixed, **query})


def _rpc_error(call: str, exc: Exception) -> StreamsyncError:
    """A failed control-plane call as a streamsync error: the worker's own error where the
    text that came back carries its result (its kind, message and partial report, as data:
    :meth:`~streamsync.engine.messages.WorkerResult.from_text`), else
    :class:`ReceiverFailedError`."""
    if isinstance(exc, StreamsyncError):
        return exc
    body = getattr(getattr(exc, "response", None), "text", "") or ""
    result = WorkerResult.from_text(f"{exc} {body}")
    if result is not None and result.error is not None:
        error = error_class(result.error, ReceiverFailedError)(
            f"vLLM's {call} failed: worker (pid {result.pid}): {result.message}"
        )
        error.report = result.report
        return error
    detail = f"{type(exc).__name__}: {exc}" + (f" ({body.strip()[:1000]})" if body else "")
    return ReceiverFailedError(f"vLLM's {call} failed: {detail}")


def _http(client: Any, method: str, route: str, **kwargs: Any) -> Any:
    """``method /route`` (:func:`~streamsync.vllm.server.call`) on the server at
    ``client``'s ``base_url``, bounded by the client's ``timeout``; ``None`` where it has no
    ``base_url``."""
    base_url = getattr(client, "base_url", None)
    if base_url is None:
        return None
    timeout = getattr(client, "timeout", DEFAULT_TIMEOUT)
    return call(str(base_url).rstrip("/"), method, route, timeout=timeout, **kwargs)


def _lora_route(client: Any, action: str, name: str, path: str | None) -> None:
    """``load`` (in place) or ``unload`` LoRA adapter ``name`` through ``client``: its own
    ``load_lora_adapter`` / ``unload_lora_adapter`` where it has them, else the server's
    ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``."""
    method = getattr(client, f"{action}_lora_adapter", None)
    if method is not None:
        method(name, path) if action == "load" else method(name)
        return
    body: dict[str, Any] = {"lora_name": name}
    if action == "load":
        body.update(lora_path=path, load_inplace=True)
    route = f"v1/{action}_lora_adapter"
    needs = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (and --enable-lora)"
    what = f"to {action} LoRA adapter {name!r} (POST /{route})"
    if _http(client, "POST", route, json=body, needs=needs, error=LoraError, what=what) is None:
        raise ConfigError(
            f"{type(client).__name__} has no {action}_lora_adapter method (nor a base_url "
            f"to post /{route} to): it cannot install LoRA adapters"
        )


def _start_draft(client: Any) -> None:
    """``start_draft_weight_update`` on ``client``; vLLM's ``HTTPVLLMWeightSyncClient`` has
    no method for the server's route, so it is posted to its ``base_url``."""
    method = getattr(client, "start_draft_weight_update", None)
    if method is not None:
        method()
    elif _http(client, "POST", "start_draft_weight_update") is None:
        raise ConfigError(
            f"{type(client).__name__} has no start_draft_weight_update method (nor a "
            "base_url to post /start_draft_weight_update to); draft=True needs one"
        )


class StreamsyncTrainerEngine(TrainerWeightTransferEngine[StreamsyncInitInfo]):
    """vLLM's trainer-side engine for the ``streamsync`` backend.

    ``trainer_init`` binds the transport on the sender (rank 0) and tells the workers to
    connect (``init_weight_transfer_engine``); each :meth:`send_weights` drives
    ``start_weight_update``, runs ``update_weights`` beside the streamsync send of the source
    through the pipeline, then ``finish_weight_update``. Failures raise streamsync's errors.
    """

    init_info_cls = StreamsyncInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        init_info: StreamsyncInitInfo,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        transport: dict[str, Any] = {"connect_timeout": init_info.timeout}
        if init_info.secret is not None:
            transport["secret"] = init_info.secret
        self._client = _VllmClient(
            client,
            init_info.receivers,
            transport={"secret": init_info.secret} if init_info.secret is not None else {},
            timeout=init_info.timeout,
        )
        #: ``StreamsyncInitInfo.staged``: each :meth:`send_weights` stages, then commits.
        self.staged = init_info.staged
        #: ``StreamsyncInitInfo.pause_mode``: the staged commit's pause.
        self.pause_mode: PauseMode = init_info.pause_mode
        self.channel = EngineChannel(
            self._client,
            init_info.endpoint,
            pipeline=init_info.pipeline,
            bucket_bytes=init_info.bucket_bytes,
            timeout=init_info.timeout,
            worker_options=init_info.worker_options,
            delta=init_info.delta,
            sharded=init_info.sharded,
            **transport,
        )
        self._sync: BlockingWeightSync | None = None
        #: The sender's report of the last :meth:`send_weights`.
        self.last_report: SyncReport | None = None

    @property
    def receivers(self) -> int:
        """How many workers receive each sync, as they said when they joined."""
        return self._client.receivers

    @property
    def needs(self) -> Mapping[str, Needs]:
        """What each worker's model instance reads of each checkpoint tensor, as
        :attr:`EngineChannel.needs <streamsync.engine.channel.EngineChannel.needs>` gives
        it (empty without ``StreamsyncInitInfo(sharded=True)``)."""
        return self.channel.needs

    @classmethod
    def trainer_init(
        cls,
        init_info: StreamsyncInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, init_info=init_info
        )
        if engine.is_sender:
            # Binds the endpoint, tells the workers to connect, and learns from them how
            # many they are, their vLLM and (sharded) what each reads.
            engine._sync = engine.channel.__enter__()
            log("vllm.native.trainer_init", endpoint=engine.channel.url)
        return engine

    def send_weights(
        self, weights: Any = None, *, weight_version: str | None = None, draft: bool = False
    ) -> None:
        """Stream the source (or ``weights``: anything :func:`~streamsync.named_tensors`
        takes) into the workers, between ``start_weight_update`` (with ``draft=True``:
        ``start_draft_weight_update``, into the speculative drafter) and
        ``finish_weight_update(weight_version)`` (default: the sync's id); the sender's
        report is then in :attr:`last_report`. Ranks other than the sender iterate the
        source (its gathers are collectives) and send nothing.

        With ``StreamsyncInitInfo(staged=True)``: :meth:`stage_weights` while the engine
        generates, then :meth:`commit_weights` in a pause of its own."""
        if self.staged:
            if self.stage_weights(weights, draft=draft) is not None:
                self.commit_weights(weight_version, mode=self.pause_mode)
            return
        weights = self._weights(weights)
        if not self.is_sender:
            return
        report: SyncReport | None = self._session(
            "send_weights",
            lambda sync: _own_error(sync.update, weights),
            draft,
            lambda report: weight_version or str(report.sync_id),
        )
        if report is not None:
            self.last_report = report

    def stage_weights(self, weights: Any = None, *, draft: bool = False) -> SyncReport | None:
        """Stage the source (or ``weights``) on every worker while the engine generates on
        the weights it serves (``docs/staged.md``); returns once every worker holds the
        whole version, checked. Nothing is applied: a failure leaves every worker serving
        as before, and raises by name. :meth:`commit_weights` applies it. Returns the
        sender's report (``None`` on ranks other than the sender)."""
        weights = self._weights(weights)
        if not self.is_sender:
            return None
        sync = self._open("stage_weights")
        self._client.draft = draft
        try:
            return _own_error(sync.stage, weights)
        finally:
            self._client.draft = False

    def commit_weights(
        self, weight_version: str | None = None, *, mode: PauseMode = "keep"
    ) -> SyncReport | None:
        """Apply the staged version: the engine pauses (``mode``: ``keep``, ``wait`` or
        ``abort``, as vLLM's ``/pause`` takes it), applies it, sets its weight version
        (default: the sync's id), resets its prefix cache, and resumes. Returns the report,
        also in :attr:`last_report`."""
        if not self.is_sender:
            return None
        self.last_report = self._open("commit_weights").commit(mode=mode, version=weight_version)
        return self.last_report

    def drop_weights(self) -> None:
        """Drop the staged version on every worker (the engine never served it)."""
        if self.is_sender:
            self._open("drop_weights").drop()

    def _weights(self, weights: Any) -> Any:
        """``weights``, else the source; ranks other than the sender iterate it (its
        gathers are collectives) and get ``None``."""
        weights = self.source if weights is None else weights
        if weights is None:
            raise ConfigError(
                "send_weights: no weights; pass source= to trainer_init or weights= here"
            )
        if not self.is_sender:
            if isinstance(weights, WeightSource):
                for _ in weights:
                    pass
            return None
        return weights

    def _open(self, what: str) -> BlockingWeightSync:
        if self._sync is None:
            raise ConfigError(f"{what} after shutdown(); call trainer_init again")
        return self._sync

    def _session(
        self,
        what: str,
        run: Callable[[BlockingWeightSync], Any],
        draft: bool = False,
        weight_version: Callable[[Any], str | None] = lambda _: None,
    ) -> Any:
        """``run`` on the channel inside one of vLLM's weight-update sessions (``draft``:
        the drafter's), which ``finish_weight_update(weight_version(result))`` ends."""
        if not self.is_sender:
            return None
        sync = self._open(what)
        start = "start_draft_weight_update" if draft else "start_weight_update"
        try:
            _start_draft(self.client) if draft else self.client.start_weight_update()
        except Exception as exc:
            raise _rpc_error(start, exc) from exc
        try:
            result = run(sync)
        except BaseException:
            # A failed update_weights ends the session on the worker; one that failed on
            # this side (before the workers were asked) still needs it closed.
            with contextlib.suppress(Exception):
                self.client.finish_weight_update(None)
            raise
        try:
            self.client.finish_weight_update(weight_version(result))
        except Exception as exc:
            raise _rpc_error("finish_weight_update", exc) from exc
        return result

    def send_lora(
        self,
        name: str,
        adapter: Any,
        *,
        config: Any = None,
        pipeline: AdapterLike | None = None,
    ) -> SyncReport | None:
        """Stream LoRA adapter ``adapter`` (a ``peft.PeftModel``, or named LoRA tensors with
        ``config``) into every worker and install it as ``name`` through the server's
        ``/v1/load_lora_adapter`` (the server runs with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``); nothing touches a disk. Generation then
        names it as vLLM's server does: ``"model": name``. A new version replaces the one
        serving; a bad adapter fails by name with the previous one still serving (see
        :meth:`~streamsync.engine.channel.EngineChannel.update_lora`). Returns the sender's
        report (``None`` on ranks other than the sender)."""
        report: SyncReport | None = self._session(
            "send_lora",
            lambda sync: sync.update_lora(name, adapter, config=config, pipeline=pipeline),
        )
        if report is not None:
            self.last_report = report
        return report

    def remove_lora(self, name: str) -> None:
        """Stop serving LoRA adapter ``name`` (``/v1/unload_lora_adapter``) and drop its
        tensors on every worker."""
        self._session("remove_lora", lambda sync: sync.remove_lora(name))

    def shutdown(self) -> None:
        """Close the transport and the workers' receivers (``shutdown_weight_transfer_engine``
        where the client has it)."""
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()


class AsyncLLMWeightSyncClient:
    """A ``VLLMWeightSyncClient`` on a vLLM ``AsyncLLM`` in this process (vLLM ships HTTP and
    Ray clients only). Made on the event loop that owns the engine; its blocking methods
    run the engine's coroutines there, so call them (``trainer_init``, ``send_weights``)
    from another thread: ``await anyio.to_thread.run_sync(engine.send_weights)``."""

    def __init__(self, llm: Any, *, timeout: float = 300.0) -> None:
        import anyio.lowlevel

        self.llm = llm
        self.timeout = timeout
        try:
            self._token = anyio.lowlevel.current_token()
        except RuntimeError:
            raise ConfigError(
                "AsyncLLMWeightSyncClient(llm) is made on the event loop that runs the "
                "AsyncLLM (it drives the engine there)"
            ) from None

    def _run(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        import anyio.from_thread

        async def bounded() -> Any:
            with anyio.fail_after(self.timeout):
                return await fn()

        try:
            return anyio.from_thread.run(bounded, token=self._token)
        except TimeoutError:
            raise SyncTimeoutError(
                f"AsyncLLM {what} did not finish within {self.timeout:g} s"
            ) from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)
        self._run("init", lambda: self.llm.init_weight_transfer_engine(request))

    def shutdown_weight_transfer_engine(self) -> None:
        self._run("shutdown", self.llm.shutdown_weight_transfer_engine)

    def start_weight_update(self) -> None:
        self._run("start_weight_update", self.llm.start_weight_update)

    def start_draft_weight_update(self) -> None:
        self._run("start_draft_weight_update", self.llm.start_draft_weight_update)

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        self._run("update_weights", lambda: self.llm.update_weights(request=request))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run("finish_weight_update", lambda: self.llm.finish_weight_update(weight_version))

    def pause(self, mode: PauseMode = "keep") -> None:
        """Pause generation (the server's ``/pause?mode=``), keeping the caches."""
        self._run("pause", lambda: self.llm.pause_generation(mode=mode, clear_cache=False))

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache; requests in flight recompute what they hold."""
        self._run("reset_prefix_cache", lambda: self.llm.reset_prefix_cache(True))

    def resume(self) -> None:
        """Resume generation (the server's ``/resume``)."""
        self._run("resume", self.llm.resume_generation)
