"""vLLM integration: the trainer-side :func:`update_weights` and :class:`WeightSync` (on the
engine clients of :mod:`streamsync.vllm.client`), and the worker-side
:class:`WorkerExtension` (``worker_extension_cls="streamsync.vllm.WorkerExtension"``).

vLLM itself is imported lazily, inside the functions that need it.
"""

from streamsync.vllm.client import WeightSync, update_weights
from streamsync.vllm.extension import WorkerExtension

__all__ = ["WeightSync", "WorkerExtension", "update_weights"]
