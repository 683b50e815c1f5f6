"""A report's one-line summary says what a sync did not reach."""

from __future__ import annotations

import torch

from streamsync import ModuleSink
from streamsync.report import LoadResult, SyncReport
from streamsync.testing.in_process import sync


async def test_a_sync_that_leaves_tensors_untouched_says_how_many() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    partial = {"0.weight": torch.ones(4, 4), "0.bias": torch.ones(4)}  # not layer 1
    report = await sync(partial, ModuleSink(model))
    assert report.complete and len(report.missing) == 2
    assert report.summary().endswith("[ok, 2 missing]"), report.summary()
    whole = {n: torch.zeros_like(p) for n, p in model.state_dict().items()}
    report = await sync(whole, ModuleSink(model))
    assert report.summary().endswith("[ok]"), report.summary()


def test_the_receiver_that_missed_the_most_counts() -> None:
    report = SyncReport(
        sync_id=1,
        side="send",
        tensors=3,
        nbytes=12,
        buckets=1,
        seconds=0.1,
        missing=("b",),
        instances={
            "receiver0": LoadResult(missing=("b",)),
            "receiver1": LoadResult(missing=("a", "b", "c")),
        },
        absent=("receiver 2 is not there",),
    )
    assert report.summary().endswith("[ok, 3 missing, 1 absent]"), report.summary()
