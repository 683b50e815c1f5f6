"""Public fakes for testing code that uses streamsync, the way streamsync tests itself.

- :func:`fake_state_dict` / :func:`fake_named_tensors`: small state dicts in real
  Transformers naming (dense Qwen3, and Qwen3-MoE with Transformers-5 packed experts).
- :class:`FakeVllmModel`: a vLLM-style model whose ``load_weights`` stacks q/k/v and
  gate/up into fused parameters, and :class:`LoadWeightsSink` to sync into it.
- The in-memory transport: ``"memory://NAME"`` URLs.
"""

from streamsync.testing.fakes import (
    FakeConfig,
    FakeVllmModel,
    LoadWeightsSink,
    fake_named_tensors,
    fake_state_dict,
)

__all__ = [
    "FakeConfig",
    "FakeVllmModel",
    "LoadWeightsSink",
    "fake_named_tensors",
    "fake_state_dict",
]
