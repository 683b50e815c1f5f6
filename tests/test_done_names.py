"""A receiver's ``Done`` tells what its sink loaded as the difference from the names its
sync carried (``skipped``, ``added``): the sender works the names out from what it sent,
and every report says the same names, per receiver and together."""

from __future__ import annotations

import contextlib
import os
from typing import Any, NamedTuple, TypeVar

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import streamsync as ss
from streamsync._channel import receiver_state, sorted_once
from streamsync.report import LoadResult
from streamsync.testing import FakeConfig, FakeVllmModel, LoadWeightsSink, fake_state_dict
from streamsync.transports.base import Incoming, Receiver
from streamsync.wire.frames import BucketHeader, Done, Failed

BUCKET = 4096
_State = TypeVar("_State")


def _model(extra: int = 0) -> torch.nn.Module:
    """Many small tensors (several per bucket, each bucket a plan) and one larger than a
    bucket (its name comes with each of its chunks)."""
    module = torch.nn.Module()
    for i in range(24 + extra):
        module.register_parameter(f"layer{i}_weight", torch.nn.Parameter(torch.zeros(64)))
    module.register_buffer("z_big", torch.zeros(3 * BUCKET // 4))
    return module


def _weights(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen) for n, t in module.state_dict().items()}


class Recording(Receiver):
    """A receiver that keeps each report it sends back, as it goes on the wire, and
    otherwise is the receiver it wraps."""

    def __init__(self, inner: Receiver) -> None:
        self.inner = inner
        self.replies: list[Done | Failed] = []

    @property
    def index(self) -> int:
        return self.inner.index

    def sync_state(self, kind: type[_State]) -> _State:
        return self.inner.sync_state(kind)

    async def receive(self, *, timeout: float) -> Incoming:
        return await self.inner.receive(timeout=timeout)

    async def release(self, header: BucketHeader) -> None:
        await self.inner.release(header)

    async def reply(self, report: Done | Failed) -> None:
        self.replies.append(report)
        await self.inner.reply(report)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Sync(NamedTuple):
    """One sync as both sides saw it."""

    sent: ss.SyncReport
    got: list[ss.SyncReport]
    #: The ``Done`` each receiver sent.
    dones: list[Done]
    #: What each receiver worked its last ``Done`` out from (``ReceiverState.carried``).
    worked_out: list[Any]


async def _syncs(url: str, weights: list[dict[str, torch.Tensor]], sinks: list[Any]) -> list[Sync]:
    """Send each of ``weights`` in turn to one receiver per sink over one channel; per
    sync, what each side saw."""
    out: list[Sync] = []
    async with contextlib.AsyncExitStack() as stack:
        sender = await stack.enter_async_context(ss.open_sender(f"{url}?receivers={len(sinks)}"))
        receivers = [
            Recording(await stack.enter_async_context(ss.open_receiver(url))) for _ in sinks
        ]
        for step in weights:
            got: dict[int, ss.SyncReport] = {}

            async def rx(k: int) -> None:
                got[k] = await ss.receive(receivers[k], sinks[k], timeout=5)  # noqa: B023

            async with anyio.create_task_group() as tg:
                for k in range(len(sinks)):
                    tg.start_soon(rx, k)
                sent = await ss.send(step, sender, bucket_bytes=BUCKET, timeout=5)
            dones = [r.replies[-1] for r in receivers]
            assert all(isinstance(d, Done) for d in dones), dones
            worked_out = [receiver_state(r).carried for r in receivers]
            out.append(Sync(sent, [got[k] for k in range(len(sinks))], dones, worked_out))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("scheme", ["memory", "shm"])
async def test_a_receiver_that_loaded_every_name_sent_leaves_them_to_the_sender(
    scheme: str,
) -> None:
    # Over the in-process fake and over shared memory, whose Done crosses the wire encoded.
    module = _model()
    steps = [_weights(module, seed) for seed in range(4)]
    steps.insert(2, {n: t for n, t in steps[2].items() if n != "layer5_weight"})
    url = f"{scheme}://done-all-{os.getpid()}"
    syncs = await _syncs(url, steps, [ss.ModuleSink(module)])
    for step, (sent, (got,), (done,), _) in zip(steps, syncs, strict=True):
        names = tuple(sorted(step))
        assert done.skipped == done.added == (), done
        assert got.loaded == names
        assert sent.loaded == names  # filled in by the sender, each name once
        missing = tuple(sorted(set(module.state_dict()) - set(step)))
        assert sent.instances == {"receiver0": LoadResult(loaded=names, missing=missing)}
    # Each side sorts a sync's names once, and again only when they changed: syncs 1, 3
    # (without layer5_weight) and 4 (with it again) sort; 2 and 5 repeat the sync before.
    # A sort makes a new tuple: the sender's names, and what the receiver worked its Done
    # out from, are the last sync's objects exactly where nothing was sorted again.
    for i in range(1, len(syncs)):
        before, now = syncs[i - 1], syncs[i]
        repeated = i in (1, 4)
        assert (now.sent.loaded is before.sent.loaded) is repeated, i
        assert (now.worked_out[0] is before.worked_out[0]) is repeated, i
    for name, want in steps[-1].items():
        assert torch.equal(module.state_dict()[name], want), name


async def test_a_change_of_names_or_of_the_sinks_answer_is_worked_out_again() -> None:
    module = _model(extra=3)
    full = _weights(module, 0)
    fewer = {n: t for n, t in full.items() if not n.startswith("layer2")}  # other buckets

    class Answers(ss.ModuleSink):
        """Reports, from the second sync on, one name less than it loaded."""

        syncs = 0

        def finalize(self) -> LoadResult:
            result = super().finalize()
            self.syncs += 1
            if self.syncs >= 2:
                return LoadResult(loaded=result.loaded[1:], unexpected=result.unexpected)
            return result

    sink = Answers(module, strict=False)
    syncs = await _syncs("memory://done-change", [full, full, fewer], [sink])
    (s1, (r1,), (d1,), _), (s2, (r2,), (d2,), _), (s3, (r3,), (d3,), _) = syncs
    assert d1.skipped == d1.added == () and s1.loaded == r1.loaded == tuple(sorted(full))
    # Same plans as the first sync, but the sink answered otherwise: the name it left out
    # travels, and the sender's report says what the sink did.
    assert d2.skipped == tuple(sorted(full))[:1] and d2.added == ()
    assert s2.loaded == r2.loaded == tuple(sorted(full))[1:]
    assert d3.skipped == tuple(sorted(fewer))[:1] and d3.added == ()
    assert s3.loaded == r3.loaded == tuple(sorted(fewer))[1:]


async def test_a_sink_with_more_names_or_other_names_than_the_wire() -> None:
    cfg = FakeConfig()
    weights = fake_state_dict(cfg)
    renamed = {name.replace(".", "_"): t for name, t in weights.items()}
    # A module with one tensor more than is sent: it loaded what was sent, and misses one.
    module = torch.nn.Module()
    for name, t in renamed.items():
        module.register_buffer(name, torch.zeros_like(t))
    module.register_buffer("unsent", torch.zeros(4))
    [(sent, (got,), (done,), _)] = await _syncs(
        "memory://done-more", [renamed], [ss.ModuleSink(module, strict=False)]
    )
    assert done.skipped == done.added == () and done.missing == ("unsent",)
    assert sent.loaded == got.loaded == tuple(sorted(renamed))
    assert sent.missing == got.missing == ("unsent",)
    # A sink whose names are not the wire's (vLLM's stacked parameters) sends its own.
    vllm = FakeVllmModel(cfg)
    [(sent, (got,), (done,), _)] = await _syncs(
        "memory://done-vllm", [weights], [LoadWeightsSink(vllm)]
    )
    assert got.loaded != ()
    assert done.added == tuple(sorted(set(got.loaded) - set(weights)))
    assert done.skipped == tuple(sorted(set(weights) - set(got.loaded)))
    assert "model.layers.0.self_attn.qkv_proj.weight" in done.added
    assert "model.layers.0.self_attn.q_proj.weight" in done.skipped
    assert sent.loaded == got.loaded


async def test_two_receivers_one_that_leaves_names_out_and_one_that_sends_them() -> None:
    module = _model()
    weights = _weights(module, 1)
    fewer = torch.nn.Module()  # lacks one name sent: it loads the others
    for name, t in module.state_dict().items():
        if name != "layer3_weight":
            fewer.register_buffer(name, torch.zeros_like(t))
    sinks = [ss.ModuleSink(module), ss.ModuleSink(fewer, strict=False)]
    [(sent, got, dones, _)] = await _syncs("memory://done-two", [weights], sinks)
    assert dones[0].skipped == dones[1].added == dones[0].added == ()
    assert dones[1].skipped == ("layer3_weight",)
    assert got[0].loaded == tuple(sorted(weights))
    assert got[1].loaded == tuple(sorted(set(weights) - {"layer3_weight"}))
    assert sent.instances == {
        "receiver0": LoadResult(loaded=got[0].loaded),
        "receiver1": LoadResult(loaded=got[1].loaded),
    }
    assert sent.loaded == tuple(sorted(weights))


@given(st.lists(st.text(alphabet="ab.0", max_size=4), max_size=30))
def test_sorted_once_is_the_sorted_set(names: list[str]) -> None:
    assert sorted_once(names) == tuple(sorted(set(names)))
