"""vLLM integration: the trainer-side :func:`update_weights` and :class:`WeightSync` (on the
engine clients of :mod:`streamsync.vllm.client`) with its blocking face
(:class:`BlockingVllmSync`, what ``with`` gives), the collective sync from trainer ranks
(:class:`Ranks`, :class:`RankPeer`), the options each worker is told (:class:`WorkerOptions`),
and the worker-side :class:`WorkerExtension`
(``worker_extension_cls="streamsync.vllm.WorkerExtension"``).

vLLM itself is imported lazily, inside the functions that need it.
"""

from streamsync.engine.clients import PauseMode
from streamsync.engine.collective import RankPeer, Ranks
from streamsync.engine.messages import WorkerOptions
from streamsync.vllm.client import BlockingVllmSync, WeightSync, update_weights
from streamsync.vllm.extension import WorkerExtension

__all__ = [
    "BlockingVllmSync",
    "PauseMode",
    "RankPeer",
    "Ranks",
    "WeightSync",
    "WorkerExtension",
    "WorkerOptions",
    "update_weights",
]
