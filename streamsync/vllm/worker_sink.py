"""The sink a vLLM worker receives one sync into, chosen in one place for both worker entry
points (``WorkerExtension`` and the ``streamsync`` weight-transfer backend).
"""

from __future__ import annotations

from streamsync.boxes import Slices, slices_of
from streamsync.engine.messages import Route, WorkerOptions
from streamsync.errors import ConfigError, LoraError
from streamsync.sink import Sink
from streamsync.vllm.lifecycles import choose_lifecycle
from streamsync.vllm.lora import LoraEngine, LoraSink
from streamsync.vllm.quirks import quirks_by_name
from streamsync.vllm.sink import VllmSink, WorkerModels


def worker_sink(models: WorkerModels, options: WorkerOptions, route: Route | None = None) -> Sink:
    """The sink for one sync into ``models``: a :class:`~streamsync.vllm.lora.LoraSink` on the
    main model for an adapter sync, else a :class:`~streamsync.vllm.sink.VllmSink` on the
    instances ``options`` target, with the lifecycle, quirks and delta it names, and the
    slices ``route`` (a sharded sync's) brings them."""
    if options.lora is not None:
        main = next((inst for inst in models.instances if inst.name == "main"), None)
        if main is None:
            raise LoraError(
                "a LoRA adapter sync goes to the main model: start it with "
                "start_weight_update, not start_draft_weight_update"
            )
        engine = LoraEngine.of_model(main.model, models.vllm_config)
        return LoraSink(engine, options.lora, models.state)
    found = models.instances
    if options.instances is not None:
        found = [inst for inst in found if inst.name in options.instances]
    return VllmSink(
        list(found),
        lifecycle=choose_lifecycle(options.lifecycle),
        vllm_config=models.vllm_config,
        quirks=quirks_by_name(options.quirks) if options.quirks is not None else None,
        delta=options.delta,
        state=models.state,
        slices=None if route is None else _slices(models, route),
    )


def _slices(models: WorkerModels, route: Route) -> Slices:
    """What a sharded sync brings this worker: the slices of the needs it told the trainer,
    refused if the worker's layout changed since (a reload, another quantization)."""
    found = [models.state.needs.get(inst.name) for inst in models.instances]
    for inst, needs in zip(models.instances, found, strict=True):
        if needs is None or needs.layout not in route.layouts:
            raise ConfigError(
                f"model instance {inst.name!r}: the trainer cut this sync's slices for a "
                "layout this worker no longer has (or never told it); reopen the channel so "
                "it learns the worker's needs again"
            )
    return slices_of(n for n in found if n is not None)
