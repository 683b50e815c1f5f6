"""streamsync as a vLLM weight-transfer backend named ``streamsync``, driven through vLLM's own
API (``WeightTransferTrainerFactory``, ``VLLMWeightSyncClient``, the server's RL routes).

Usage is vLLM's::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from streamsync.vllm.native import StreamsyncInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        StreamsyncInitInfo(endpoint="zmq+tcp://127.0.0.1:0", rank=0),
        client=HTTPVLLMWeightSyncClient(url),
        source=ModuleSource(model),
    )
    engine.send_weights()  # each step, between /pause and /resume

with the server started with ``--weight-transfer-config '{"backend": "streamsync"}'``.

Both sides register the backend when this module is imported, and in every vLLM process
(the server's engine core and workers included) through the ``vllm.general_plugins`` entry
point :func:`register`.

The worker side (:class:`StreamsyncWeightTransferEngine`) keeps a
:class:`~streamsync.worker.WorkerReceivers` connected to the endpoint the trainer names at
``init_weight_transfer_engine``; each ``update_weights`` call runs one whole sync into a
:class:`~streamsync.vllm.sink.VllmSink` on the model vLLM targets (the main model, or the
drafter after ``start_draft_weight_update``): prepare, load per bucket, finalize. The trainer
side (:class:`StreamsyncTrainerEngine`) is a :class:`~streamsync.engine.WeightSync` whose
engine client is vLLM's ``VLLMWeightSyncClient``: ``update_weights`` runs beside the send.
Only JSON-native values cross the control plane (the init and update infos are versioned
msgspec structs as builtins); nothing is pickled. :func:`weight_source` goes the other way:
our adapters in front of vLLM's own backends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import anyio.to_thread
import msgspec
import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)

from streamsync._log import log, warn
from streamsync.adapter import AdapterLike
from streamsync.engine import BlockingWeightSync, WeightSync
from streamsync.errors import (
    ConfigError,
    PeerBrokenError,
    ProtocolVersionError,
    ReceiverFailedError,
    SenderAbortedError,
    StreamsyncError,
    SyncTimeoutError,
)
from streamsync.loops import EventLoopThread
from streamsync.report import SyncReport
from streamsync.sources import named_tensors
from streamsync.sync import DEFAULT_TIMEOUT
from streamsync.worker import WorkerReceivers
from streamsync.worker_messages import WORKER_PROTOCOL, WorkerOptions, WorkerResult

__all__ = [
    "BACKEND",
    "AsyncLLMWeightSyncClient",
    "StreamsyncInitInfo",
    "StreamsyncTrainerEngine",
    "StreamsyncWeightTransferEngine",
    "TransferInit",
    "register",
    "weight_source",
]

#: The name of the backend in vLLM's factories and in ``--weight-transfer-config``.
BACKEND = "streamsync"


def register() -> None:
    """Register the ``streamsync`` backend with vLLM's worker-side and trainer-side
    factories (idempotent): the ``vllm.general_plugins`` entry point, run by vLLM in every
    process it starts, and run when this module is imported."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in (
        (WeightTransferEngineFactory, "StreamsyncWeightTransferEngine"),
        (WeightTransferTrainerFactory, "StreamsyncTrainerEngine"),
    ):
        with contextlib.suppress(ValueError):  # already registered in this process
            factory.register_engine(BACKEND, __name__, cls)


class TransferInit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the trainer tells every worker at ``init_weight_transfer_engine`` (as builtins)."""

    version: int = WORKER_PROTOCOL
    #: The transport URL the workers connect to (the trainer's sender is already bound).
    endpoint: str
    #: Keyword arguments of :func:`~streamsync.open_receiver` (``secret``, ``heartbeat``...).
    transport: dict[str, Any] = {}
    #: Seconds for the connect, and the default for each wait of a sync.
    timeout: float = DEFAULT_TIMEOUT

    def to_wire(self) -> dict[str, Any]:
        """Plain values for the control plane (JSON over HTTP)."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_wire(cls, data: object) -> TransferInit:
        """The struct from a worker's ``init_info`` dict."""
        version = data.get("version", WORKER_PROTOCOL) if isinstance(data, Mapping) else None
        if version != WORKER_PROTOCOL:
            raise ProtocolVersionError(
                f"streamsync init_info of protocol version {version!r}; this streamsync "
                f"speaks {WORKER_PROTOCOL}: install the same streamsync on trainer and server"
            )
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            fields = ", ".join(f for f in cls.__struct_fields__ if f != "version")
            raise ConfigError(f"streamsync init_info: {exc}; valid fields: {fields}") from None


# -- the worker side -------------------------------------------------------------------------


class StreamsyncWeightTransferEngine(WeightTransferEngine[Any, Any]):
    """vLLM's worker-side engine for the ``streamsync`` backend (one per worker).

    ``init_transfer_engine`` connects a receiver to the trainer's endpoint;
    ``start_weight_update`` takes the model vLLM targets (main or drafter);
    ``update_weights`` runs one sync into it (the sink's whole lifecycle, with the quirks
    and buffers of :class:`~streamsync.vllm.sink.VllmSink`) and raises the streamsync error
    that ended it, which leaves the server serving; ``shutdown`` closes the receiver.
    """

    init_info_cls = TransferInit
    update_info_cls = WorkerOptions
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receivers: WorkerReceivers | None = None
        self._init: TransferInit | None = None
        self._target: str | None = None  # "main" or "drafter", between start and finish
        self.last_result: WorkerResult | None = None

    @property
    def rank(self) -> int:
        return int(getattr(self.parallel_config, "rank", 0))

    def parse_init_info(self, init_dict: dict[str, Any]) -> TransferInit:
        return TransferInit.from_wire(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> WorkerOptions:
        return WorkerOptions.from_wire(update_dict)

    def init_transfer_engine(self, init_info: TransferInit) -> None:
        if self._receivers is not None:  # a new trainer replaces the old one
            self._receivers.shutdown()
        self._receivers = WorkerReceivers(f"streamsync-vllm-worker{self.rank}")
        self._init = init_info
        try:
            self._receivers.open(init_info.endpoint, init_info.transport, timeout=init_info.timeout)
        except BaseException:
            self._receivers.shutdown()
            self._receivers = self._init = None
            raise
        log("vllm.native.init", endpoint=init_info.endpoint, rank=self.rank)

    def start_weight_update(self) -> None:
        self._require()
        self._target = "main" if self.model is self._default_model else "drafter"
        self.last_result = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(); the sink's loads are
        # complete when the sync is, and CPU builds have no accelerator to synchronize.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: WorkerOptions) -> None:
        from streamsync.vllm.lifecycles import choose_lifecycle
        from streamsync.vllm.quirks import quirks_by_name
        from streamsync.vllm.sink import ModelInstance, VllmSink

        receivers, init = self._require()
        if self._target is None:
            raise ConfigError("streamsync update_weights before start_weight_update")
        options = msgspec.structs.replace(
            update_info,
            transport={**init.transport, **update_info.transport},
            timeout=update_info.timeout if update_info.timeout is not None else init.timeout,
        )
        quirks = options.quirks
        sink = VllmSink(
            [ModelInstance(self._target, self.model, self.model_config)],
            lifecycle=choose_lifecycle(options.lifecycle),
            vllm_config=self.vllm_config,
            quirks=quirks_by_name(quirks) if quirks is not None else None,
        )
        result = receivers.receive(init.endpoint, options, sink)
        self.last_result = result
        error = result.exception(self.rank)
        if error is not None:
            raise error

    def finish_weight_update(self) -> None:
        if self._target is not None and self.last_result is None:
            warn("vllm.native.finish_without_update", target=self._target, rank=self.rank)
        self._target = None

    def shutdown(self) -> None:
        if self._receivers is not None:
            self._receivers.shutdown()
        self._receivers = self._init = None

    def _require(self) -> tuple[WorkerReceivers, TransferInit]:
        if self._receivers is None or self._init is None:
            raise ConfigError(
                "the streamsync weight-transfer engine has no trainer: call "
                "init_weight_transfer_engine first (WeightTransferTrainerFactory.trainer_init)"
            )
        return self._receivers, self._init


# -- the trainer side ------------------------------------------------------------------------


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
    bucket_bytes: int = 64 << 20
    #: Seconds for each wait of a sync, and for the workers' connect.
    timeout: float = DEFAULT_TIMEOUT
    #: The channel's shared secret. It is sent to the workers in the init call (over the
    #: control plane, in clear); leave it ``None`` and set ``$STREAMSYNC_SECRET`` on both
    #: sides to keep it off the wire.
    secret: str | None = None
    #: How many workers the engine has (tensor x pipeline x data parallel size).
    receivers: int = 1
    #: :class:`~streamsync.engine.WorkerOptions` fields for every sync (``lifecycle``,
    #: ``quirks``, ``transport``).
    worker_options: Mapping[str, Any] | None = None


class _VllmClient:
    """The :class:`~streamsync.engine.EngineClient` over a ``VLLMWeightSyncClient``: the
    receive is vLLM's ``update_weights`` call (blocking, so in a thread)."""

    def __init__(self, client: VLLMWeightSyncClient, receivers: int) -> None:
        self.client = client
        self.receivers = receivers

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

    async def close_receivers(self, endpoint: str) -> int:
        shutdown = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if shutdown is None:
            return 0
        await anyio.to_thread.run_sync(shutdown, abandon_on_cancel=True)
        return self.receivers


def _rpc_error(call: str, exc: Exception) -> StreamsyncError:
    if isinstance(exc, StreamsyncError):
        return exc
    body = getattr(getattr(exc, "response", None), "text", "") or ""
    detail = f"{type(exc).__name__}: {exc}" + (f" ({body.strip()[:500]})" if body else "")
    return ReceiverFailedError(f"vLLM's {call} failed: {detail}")


def _start_draft(client: Any) -> None:
    """``start_draft_weight_update`` on ``client``; vLLM's ``HTTPVLLMWeightSyncClient`` has
    no method for the server's route, so it is posted to its ``base_url``."""
    method = getattr(client, "start_draft_weight_update", None)
    if method is not None:
        method()
        return
    base_url = getattr(client, "base_url", None)
    if base_url is None:
        raise ConfigError(
            f"{type(client).__name__} has no start_draft_weight_update method (nor a "
            "base_url to post /start_draft_weight_update to); draft=True needs one"
        )
    import requests

    timeout = getattr(client, "timeout", DEFAULT_TIMEOUT)
    requests.post(f"{base_url}/start_draft_weight_update", timeout=timeout).raise_for_status()


# Errors that only follow from another: the one that caused them is raised instead.
_CONSEQUENCES = (ReceiverFailedError, SyncTimeoutError, PeerBrokenError, SenderAbortedError)


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
        self.init_info = init_info
        transport: dict[str, Any] = {"connect_timeout": init_info.timeout}
        if init_info.secret is not None:
            transport["secret"] = init_info.secret
        self.channel = WeightSync(
            _VllmClient(client, init_info.receivers),
            init_info.endpoint,
            pipeline=init_info.pipeline,
            bucket_bytes=init_info.bucket_bytes,
            timeout=init_info.timeout,
            worker_options=init_info.worker_options,
            **transport,
        )
        self._sync: BlockingWeightSync | None = None
        #: The sender's report of the last :meth:`send_weights`.
        self.last_report: SyncReport | None = None

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
            engine._sync = engine.channel.__enter__()  # binds the endpoint (port 0 resolved)
            transport = {"secret": init_info.secret} if init_info.secret is not None else {}
            init = TransferInit(
                endpoint=engine.channel.url, transport=transport, timeout=init_info.timeout
            )
            try:
                engine.client.init_weight_transfer_engine(init.to_wire())
            except Exception as exc:
                engine._sync.close()
                raise _rpc_error("init_weight_transfer_engine", exc) from exc
            log("vllm.native.trainer_init", endpoint=engine.channel.url)
        return engine

    def send_weights(
        self, weights: Any = None, *, weight_version: str | None = None, draft: bool = False
    ) -> None:
        """Stream the source (or ``weights``: anything :func:`~streamsync.named_tensors`
        takes) into the workers, between ``start_weight_update`` (with ``draft=True``:
        ``start_draft_weight_update``, into the speculative drafter) and
        ``finish_weight_update(weight_version)``; the sender's report is then in
        :attr:`last_report`. Ranks other than the sender iterate the source (its gathers
        are collectives) and send nothing."""
        weights = self.source if weights is None else weights
        if weights is None:
            raise ConfigError(
                "send_weights: no weights; pass source= to trainer_init or weights= here"
            )
        if not self.is_sender:
            if isinstance(weights, WeightSource):
                for _ in weights:
                    pass
            return
        if self._sync is None:
            raise ConfigError("send_weights after shutdown(); call trainer_init again")
        start = "start_draft_weight_update" if draft else "start_weight_update"
        try:
            if draft:
                _start_draft(self.client)
            else:
                self.client.start_weight_update()
        except Exception as exc:
            raise _rpc_error(start, exc) from exc
        try:
            report = self._sync.update(weights)
        except ReceiverFailedError as exc:
            cause = exc.__cause__
            if isinstance(cause, StreamsyncError) and not isinstance(cause, _CONSEQUENCES):
                # The worker's own error, as the transport carried it to the sender.
                cause.add_note(str(exc))
                raise cause from None
            raise
        try:
            self.client.finish_weight_update(weight_version)
        except Exception as exc:
            raise _rpc_error("finish_weight_update", exc) from exc
        self.last_report = report

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


# -- the reverse direction: our adapters in front of vLLM's own backends ---------------------


class _PipelineSource(WeightSource):
    """A vLLM ``WeightSource`` over a streamsync stream through a pipeline (see
    :func:`weight_source`)."""

    def __init__(self, weights: Any, pipeline: AdapterLike | None, *, timeout: float) -> None:
        self._weights = weights
        self._pipeline = pipeline
        self._timeout = timeout
        self._meta: list[ParamMeta] | None = None

    def _stream(self) -> AsyncIterator[Any]:
        weights = self._weights
        if callable(weights) and not isinstance(weights, torch.nn.Module):
            weights = weights()
        stream = named_tensors(weights)
        return self._pipeline(stream) if self._pipeline is not None else stream

    def metadata(self) -> list[ParamMeta]:
        # What the pipeline yields is only known by running it (names, dtypes and shapes
        # change in MoE expansion and quantization): one pass, kept.
        if self._meta is None:
            for _ in self:
                pass
        assert self._meta is not None
        return list(self._meta)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        loop = EventLoopThread("streamsync-weight-source")
        meta: list[ParamMeta] = []
        try:
            stream = loop.run(self._open, timeout=self._timeout, what="opening the stream")
            try:
                while True:
                    item = loop.run(stream.__anext__, timeout=self._timeout, what="the next tensor")
                    name, tensor = _named_tensor(item)
                    meta.append(ParamMeta(name, tensor.dtype, tuple(tensor.shape)))
                    yield name, tensor
                    del item, tensor
            except StopAsyncIteration:
                pass
            finally:
                with contextlib.suppress(Exception):
                    loop.run(stream.aclose, timeout=self._timeout, what="closing the stream")
        finally:
            loop.stop()
        if self._meta is None:
            self._meta = meta
        elif [m.name for m in meta] != [m.name for m in self._meta]:
            raise ConfigError(
                "weight_source: this pass yielded other names than the first "
                f"({len(meta)} vs {len(self._meta)} tensors); the stream must be the same "
                "each round"
            )

    async def _open(self) -> Any:
        return self._stream()


def _named_tensor(item: Any) -> tuple[str, torch.Tensor]:
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
    ):
        return item
    raise ConfigError(
        f"weight_source: the pipeline yielded a {type(item).__name__}, not a (name, tensor) "
        "pair; leave bucketing out of a pipeline for vLLM's own backends"
    )


def weight_source(
    weights: Any,
    *,
    pipeline: AdapterLike | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> WeightSource:
    """A vLLM ``WeightSource`` that yields ``weights`` through streamsync's ``pipeline``
    (``expand_moe``, ``quantize_fp8``, ``split_buffers``, ...), for vLLM's own backends
    (``nccl``, ``ipc``, ``sparse_nccl``): ``trainer_init(..., source=weight_source(model,
    pipeline=expand_moe()))``.

    ``weights`` must give a fresh stream every round: an ``nn.Module``, a mapping of
    tensors, a vLLM ``WeightSource``, or a function returning anything
    :func:`~streamsync.named_tensors` takes. ``metadata()`` runs the pipeline once (what it
    yields is only known that way) and keeps the result. ``timeout`` bounds each step.
    """
    if isinstance(weights, Iterator | AsyncIterator):
        raise ConfigError(
            f"weight_source: a {type(weights).__name__} can be iterated only once, and vLLM "
            "reads a source every round; pass an nn.Module, a mapping, a WeightSource or a "
            "function returning a fresh stream"
        )
    return _PipelineSource(weights, pipeline, timeout=timeout)


register()
