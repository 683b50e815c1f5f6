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
:class:`~streamsync.engine.worker.WorkerReceivers` connected to the endpoint the trainer names at
``init_weight_transfer_engine``; each ``update_weights`` call runs one whole sync into a
:class:`~streamsync.vllm.sink.VllmSink` on the model vLLM targets (the main model, or the
drafter after ``start_draft_weight_update``): prepare, load per bucket, finalize. The trainer
side (:class:`StreamsyncTrainerEngine`) is a :class:`~streamsync.engine.channel.EngineChannel` whose
engine client is vLLM's ``VLLMWeightSyncClient``: ``update_weights`` runs beside the send.
Only JSON-native values cross the control plane (the init and update infos are versioned
msgspec structs as builtins); nothing is pickled. :func:`weight_source` goes the other way:
our adapters in front of vLLM's own backends.

Modules: ``messages`` (what crosses the control plane), ``worker``, ``trainer``, ``source``.
"""

from __future__ import annotations

import contextlib

from streamsync.vllm.native.messages import BACKEND
from streamsync.vllm.native.source import weight_source
from streamsync.vllm.native.trainer import AsyncLLMWeightSyncClient, StreamsyncInitInfo

__all__ = ["AsyncLLMWeightSyncClient", "StreamsyncInitInfo", "register", "weight_source"]


def register() -> None:
    """Register the ``streamsync`` backend with vLLM's worker-side and trainer-side
    factories (idempotent): the ``vllm.general_plugins`` entry point, run by vLLM in every
    process it starts, and run when this package is imported."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(
            BACKEND, f"{__name__}.worker", "StreamsyncWeightTransferEngine"
        )
    with contextlib.suppress(ValueError):
        WeightTransferTrainerFactory.register_engine(
            BACKEND, f"{__name__}.trainer", "StreamsyncTrainerEngine"
        )


register()
