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
point :func:`register`. Only JSON-native values cross the control plane. Modules:
``worker``, ``trainer``, and ``source`` (:func:`weight_source`: our adapters in front of
vLLM's own backends).
"""

from __future__ import annotations

import contextlib

from streamsync.vllm.native.source import weight_source
from streamsync.vllm.native.trainer import AsyncLLMWeightSyncClient, StreamsyncInitInfo
from streamsync.vllm.server import BACKEND

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
