"""What users' tests use, the way streamsync tests itself: fakes of a model, a state dict
and a vLLM-style loader (:mod:`streamsync.testing.fakes`), :func:`sync` (one sync over the
in-memory transport, ``memory://NAME``, raising the root cause under its own class), and
the conformance suite every transport passes
(:class:`~streamsync.testing.conformance.TransportConformance`)."""

from streamsync.testing.conformance import TransportConformance
from streamsync.testing.fakes import (
    FakeConfig,
    FakeVllmModel,
    LoadWeightsSink,
    fake_named_tensors,
    fake_state_dict,
)
from streamsync.testing.in_process import sync

__all__ = [
    "FakeConfig",
    "FakeVllmModel",
    "LoadWeightsSink",
    "TransportConformance",
    "fake_named_tensors",
    "fake_state_dict",
    "sync",
]
