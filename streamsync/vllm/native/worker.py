"""The worker side of the ``streamsync`` backend: vLLM's ``WeightTransferEngine``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, Literal

import msgspec
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync._log import log, warn
from streamsync.engine.messages import Route, WorkerOptions, WorkerResult
from streamsync.engine.worker import WorkerReceivers
from streamsync.errors import ConfigError, StreamsyncError, describe
from streamsync.facts import EngineFacts, Versioned, WorkerFacts
from streamsync.vllm.sink import ModelInstance, WorkerModels, WorkerState
from streamsync.vllm.slices import worker_needs
from streamsync.vllm.worker_sink import worker_sink


class TransferInit(Versioned, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the trainer tells every worker at ``init_weight_transfer_engine`` (as builtins);
    each sync's update info is a :class:`~streamsync.engine.messages.WorkerOptions`."""

    what: ClassVar[str] = "streamsync init_info"
    invalid: ClassVar[type[StreamsyncError]] = ConfigError

    #: The transport URL the workers connect to (the trainer's sender is already bound).
    endpoint: str
    #: Keyword arguments of :func:`~streamsync.open_receiver` (``secret``, ``heartbeat``...).
    transport: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Seconds for the connect, and the default for each wait of a sync.
    timeout: float = DEFAULT_TIMEOUT
    #: A sharded trainer's: per worker rank, where it receives from (instead of ``endpoint``).
    routes: tuple[Route, ...] = ()
    #: Whether each worker says what it reads as it joins (a sharded trainer's first call).
    needs: bool = False

    def endpoint_of(self, rank: int) -> str:
        """Where worker ``rank`` connects."""
        return self.routes[rank].endpoint if rank < len(self.routes) else self.endpoint


class StagedStep(Versioned, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One step of a staged sync (:mod:`streamsync.staging`), sent as the ``update_info`` of
    ``update_weights`` (vLLM's only call that reaches the workers with data): ``stage``
    starts a staged receive and returns once it runs, so the server serves while the bytes
    land; ``poll`` fails if the staging failed and returns at once otherwise; ``wait``
    returns when it ends, or raises its error; ``commit`` applies it to the model; ``drop``
    frees it."""

    what: ClassVar[str] = "a staged step from the trainer"
    invalid: ClassVar[type[StreamsyncError]] = ConfigError

    staged: Literal["stage", "poll", "wait", "commit", "drop"]
    #: The staged sync's id (every step but ``drop``).
    sync_id: int | None = None
    #: The receive's options (``stage``).
    options: WorkerOptions | None = None


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
        self._state = WorkerState()  # what this worker keeps between syncs for its models
        self._main_model = model  # vLLM targets the drafter by swapping ``self.model``
        self._init: TransferInit | None = None
        self._target: str | None = None  # "main" or "drafter", between start and finish
        self.last_result: WorkerResult | None = None

    @property
    def rank(self) -> int:
        """This worker's rank in its engine (named in its errors)."""
        return int(getattr(self.parallel_config, "rank", 0))

    def parse_init_info(self, init_dict: dict[str, Any]) -> TransferInit:
        return TransferInit.from_wire(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> WorkerOptions | StagedStep:
        if isinstance(update_dict, dict) and "staged" in update_dict:
            return StagedStep.from_wire(update_dict)
        return WorkerOptions.from_wire(update_dict)

    def init_transfer_engine(self, init_info: TransferInit) -> None:
        if self._receivers is not None:  # a new trainer replaces the old one
            self._receivers.shutdown()
        self._receivers = WorkerReceivers(
            f"streamsync-vllm-worker{self.rank}", device=self.device, rank=self.rank
        )
        self._init = init_info
        try:
            facts = self._facts(needs=init_info.needs)
            self._receivers.open(
                init_info.endpoint_of(self.rank),
                {
                    **init_info.transport,
                    "group": facts.workers,
                    "team": facts.engine_id,
                    "facts": facts.to_bytes(),
                },
                timeout=init_info.timeout,
            )
        except BaseException as exc:
            self._receivers.shutdown()
            self._receivers = self._init = None
            if isinstance(exc, StreamsyncError):
                raise _named(exc, WorkerResult.failed(exc)) from exc
            raise
        log("vllm.native.init", endpoint=init_info.endpoint, rank=self.rank)

    def _facts(self, *, needs: bool) -> WorkerFacts:
        """What this worker tells the trainer as it joins: its rank among the engine's
        workers (data parallel included), their count, the engine's facts and, if
        ``needs``, what its model reads."""
        parallel = self.parallel_config
        within = int(getattr(parallel, "world_size", 1))
        dp_rank = int(getattr(parallel, "data_parallel_rank", 0))
        read = worker_needs(self._models("main")) if needs else []
        return WorkerFacts(
            engine_id=str(getattr(self.vllm_config, "instance_id", "")),
            rank=dp_rank * within + self.rank,
            workers=int(getattr(parallel, "world_size_across_dp", within)),
            engine=EngineFacts.here(),
            needs=tuple(read),
        )

    def _models(self, target: str) -> WorkerModels:
        """The session's model (``target``: main or drafter) with this worker's state."""
        return WorkerModels(
            [ModelInstance(target, self.model, self.model_config)], self.vllm_config, self._state
        )

    def start_weight_update(self) -> None:
        self._require()
        self._target = "main" if self.model is self._main_model else "drafter"
        self.last_result = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        parsed = self.parse_update_info(update_info)
        if isinstance(parsed, StagedStep):
            self.staged_step(parsed)
            return
        self.receive_weights(parsed)
        # As the base class does (the next step must see the new weights), where there is
        # an accelerator: CPU builds have none to synchronize.
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WorkerOptions) -> None:
        """One sync into the session's model, applied as the bytes land."""
        receivers, init = self._require()
        options, sink = self._receive(update_info)
        self._raise(receivers.handle(init.endpoint, options, sink))

    def staged_step(self, step: StagedStep) -> None:
        """One step of a staged sync (:class:`StagedStep`); raises the staging's error."""
        receivers, init = self._require()
        if step.staged == "drop":
            receivers.drop()
            self.last_result = WorkerResult(pid=0)
            return
        if step.sync_id is None:
            raise ConfigError(f"streamsync staged step {step.staged!r} without a sync_id")
        if step.staged == "stage":
            if step.options is None:
                raise ConfigError("streamsync staged step 'stage' without its options")
            options, sink = self._receive(step.options)
            result = receivers.stage(init.endpoint, options, sink)
        elif step.staged == "commit":
            result = receivers.commit(step.sync_id)
        else:
            result = receivers.staged(step.sync_id, wait=step.staged == "wait")
        self._raise(result)

    def _receive(
        self, update_info: WorkerOptions
    ) -> tuple[WorkerOptions, Callable[[WorkerOptions, Route | None], Any]]:
        """The options of one receive into the session's model, and its sink's maker."""
        _, init = self._require()
        if self._target is None:
            raise ConfigError("streamsync update_weights before start_weight_update")
        options = msgspec.structs.replace(
            update_info,
            transport={**init.transport, **update_info.transport},
            timeout=update_info.timeout if update_info.timeout is not None else init.timeout,
        )
        models = self._models(self._target)
        if options.routes:  # a sharded sync: the slices this worker's loaders read
            worker_needs(models)
        return options, partial(worker_sink, models)

    def _raise(self, result: WorkerResult) -> None:
        self.last_result = result
        error = result.exception(self.rank)
        if error is not None:
            raise _named(error, result)

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


def _named(exc: StreamsyncError, result: WorkerResult) -> StreamsyncError:
    """``exc`` with its class name leading its message and ``result`` (its kind, message
    and partial report as data) ending it: over HTTP only the message reaches the trainer,
    which re-creates the error from ``result``
    (:meth:`~streamsync.engine.messages.WorkerResult.from_text`)."""
    named = type(exc)(f"{describe(exc)} {result.to_text()}")
    named.report = exc.report
    return named
