"""Public fakes for testing code that uses streamsync, the way streamsync tests itself
(:mod:`streamsync.testing.fakes`), and the in-memory transport: ``"memory://NAME"`` URLs."""

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
