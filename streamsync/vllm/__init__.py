"""vLLM integration: the trainer-side :func:`update_weights` and the worker-side
:class:`WorkerExtension` (``worker_extension_cls="streamsync.vllm.WorkerExtension"``).

vLLM itself is imported lazily, inside the functions that need it.
"""

from streamsync.vllm.extension import WorkerExtension
from streamsync.vllm.update import WeightSync, update_weights, world_size

__all__ = ["WeightSync", "WorkerExtension", "update_weights", "world_size"]
