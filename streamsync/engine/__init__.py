"""The engine seam: how a trainer-side channel drives the workers of an inference engine.

- :mod:`streamsync.engine.channel` (trainer side): the ``EngineClient`` protocol and
  ``WeightSync``, the engine-agnostic channel into one engine or several.
- :mod:`streamsync.engine.worker` (worker side): ``WorkerReceivers``, the receivers an engine
  worker keeps across syncs, and the one handler every engine's RPC runs.
- :mod:`streamsync.engine.messages`: ``WorkerOptions`` / ``WorkerResult``, the versioned
  structs that cross the engine's RPC as plain values.
- :mod:`streamsync.engine.loops`: event loops the channel and the workers own.

This module imports nothing, so the worker side never loads the trainer side.
"""
