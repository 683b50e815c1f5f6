"""The worker side: ``worker_extension_cls="streamsync.vllm.WorkerExtension"``.

vLLM mixes this class into every worker. Its methods are called through ``collective_rpc``
with plain values in and out (an endpoint URL and :class:`~streamsync.engine.channel.WorkerOptions`
as builtins; a :class:`~streamsync.engine.channel.WorkerResult` as builtins back): vLLM serialises
them with msgpack when the engine core is another process, and nothing is pickled. The
weights themselves arrive over the transport. Method names carry the ``streamsync_`` prefix
because vLLM refuses extension attributes that clash with the worker's own
(``update_weights``, ``reload_weights``, ...).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from streamsync.engine.messages import Route, WorkerOptions
from streamsync.engine.worker import WorkerReceivers
from streamsync.facts import EngineFacts
from streamsync.sink import Sink

if TYPE_CHECKING:
    from streamsync.vllm.sink import WorkerModels, WorkerState


class WorkerExtension:
    """Methods vLLM adds to each worker (main model and drafter live in the same worker)."""

    @functools.cached_property
    def streamsync_receivers(self) -> WorkerReceivers:
        """This worker's receivers, kept across syncs; they load on the worker's device."""
        device = getattr(self, "device", None)
        return WorkerReceivers(
            device=device if isinstance(device, torch.device) else None,
            rank=int(getattr(self, "rank", 0)),
        )

    @functools.cached_property
    def streamsync_state(self) -> WorkerState:
        """What this worker keeps between syncs for its models (versions, delta copies)."""
        from streamsync.vllm.sink import WorkerState

        return WorkerState()

    def streamsync_receive(self, endpoint: str, options: Any = None) -> dict[str, Any]:
        """Receive one sync from ``endpoint`` into every model instance of this worker.

        Returns a :class:`~streamsync.engine.channel.WorkerResult` as plain values; a failure is in
        it (by class name, with the partial report), so a failed sync never takes the
        engine down and the trainer re-raises it.
        """
        from streamsync.vllm.worker_sink import worker_sink

        def sink(opts: WorkerOptions, route: Route | None) -> Sink:
            return worker_sink(_models(self), opts, route)

        return self.streamsync_receivers.handle(endpoint, options, sink).to_wire()

    def streamsync_stage(self, endpoint: str, options: Any = None) -> dict[str, Any]:
        """Start staging one sync from ``endpoint`` (:mod:`streamsync.staging`): returns
        once the receive is started, and the engine serves on while the bytes land."""
        from streamsync.vllm.worker_sink import worker_sink

        def sink(opts: WorkerOptions, route: Route | None) -> Sink:
            return worker_sink(_models(self), opts, route)

        return self.streamsync_receivers.stage(endpoint, options, sink).to_wire()

    def streamsync_staged(self, sync_id: int, wait: bool = True) -> dict[str, Any]:
        """The end of staged sync ``sync_id``: a
        :class:`~streamsync.engine.messages.WorkerResult` in plain values."""
        return self.streamsync_receivers.staged(sync_id, wait=wait).to_wire()

    def streamsync_commit(self, sync_id: int) -> dict[str, Any]:
        """Apply staged sync ``sync_id`` to every model instance of this worker."""
        return self.streamsync_receivers.commit(sync_id).to_wire()

    def streamsync_drop(self) -> bool:
        """Drop this worker's staged version; whether there was one."""
        return self.streamsync_receivers.drop()

    def streamsync_hello(self) -> dict[str, Any]:
        """This engine's :class:`~streamsync.facts.EngineFacts` as plain values
        (asked once when a trainer's channel opens)."""
        return EngineFacts.here().to_wire()

    def streamsync_needs(self) -> list[dict[str, Any]]:
        """What each model instance of this worker reads of each checkpoint tensor, as
        :class:`~streamsync.facts.Needs` in plain values (asked once when a
        sharded channel opens; learned at the first ask and when the layout changes)."""
        from streamsync.vllm.slices import worker_needs

        return [needs.to_wire() for needs in worker_needs(_models(self))]

    def streamsync_close(self, endpoint: str | None = None) -> int:
        """Close this worker's receivers (all, or the one for ``endpoint``); returns how many."""
        return self.streamsync_receivers.close(endpoint)


def _models(extension: WorkerExtension) -> WorkerModels:
    """What the worker ``extension`` is mixed into serves, with its state."""
    from streamsync.vllm.sink import WorkerModels, model_instances

    worker: Any = extension  # vLLM's worker, which the extension is mixed into
    return WorkerModels(model_instances(worker), worker.vllm_config, extension.streamsync_state)
