"""streamsync inside other projects' trainers, one module per project; each imports its
project lazily and is installed with the extra of the same name.

- :mod:`streamsync.integrations.trl`: ``WeightTransfer``, the ``weight_transfer`` of TRL's
  ``AsyncGRPOTrainer`` (``pip install 'streamsync[trl,vllm]'``): full, delta and
  adapter-only syncs into a vLLM server that runs the ``streamsync`` backend.
"""
