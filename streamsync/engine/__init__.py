"""The engine seam: how a trainer-side channel drives the workers of an inference engine.

- :mod:`streamsync.engine.channel` (trainer side): ``EngineChannel`` into one engine or
  several, on the ``EngineClient`` protocols of :mod:`streamsync.engine.clients`; one
  sync's outcome (:mod:`~streamsync.engine.rounds`), the LoRA lifecycle
  (:mod:`~streamsync.engine.loras`), the blocking face (:mod:`~streamsync.engine.blocking`),
  the channels ``update_weights`` keeps (:mod:`~streamsync.engine.kept`).
- :mod:`streamsync.engine.worker` (worker side): ``WorkerReceivers``, the receivers an engine
  worker keeps across syncs, and the one handler every engine's RPC runs.
- :mod:`streamsync.engine.messages`: ``WorkerOptions`` / ``WorkerResult``, the versioned
  structs that cross the engine's RPC as plain values (with what an engine tells of itself,
  ``EngineFacts`` and ``Needs``, in :mod:`streamsync.facts`).
- :mod:`streamsync.engine.loops`: event loops the channel and the workers own.

This module imports nothing, so the worker side never loads the trainer side.
"""
