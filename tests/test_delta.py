"""Delta syncs (``send(..., delta=True)``): the choice between delta and full, the
self-healing cases (a restarted receiver, a failed delta, a receiver absent from a sync, a
sink that holds another version), the report, and the patch decoder's refusals.

Over ``memory://`` in one process, with a :class:`ModuleSink` into a bf16 module that is
compared bit for bit with the trainer's weights after every sync. The same syncs across
processes on every transport are in the conformance suite (``test_delta_syncs_are_bit_exact``).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import os
import subprocess
import sys
import weakref
from typing import Any

import hypothesis.strategies as st
import msgspec
import numpy as np
import pytest
import torch
from conftest import run_both
from hypothesis import given, settings

import streamsync as ss
from streamsync._channel import receiver_state, sender_state
from streamsync.adapters import cast
from streamsync.testing.buckets import pack_bucket
from streamsync.wire import patch as patches
from streamsync.wire.frames import BucketHeader, Layout
from streamsync.wire.pack import BucketBuilder
from streamsync.wire.unpack import Unpacker

_names = itertools.count()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 300))


def step(trainer: torch.nn.Module, seed: int, fraction: float = 0.03) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            chosen = torch.rand(p.shape, generator=gen) < fraction
            p.add_(torch.where(chosen, torch.randn(p.shape, generator=gen), 0.0))


def same(trainer: torch.nn.Module, engine: torch.nn.Module) -> bool:
    return all(
        torch.equal(a.to(torch.bfloat16).view(torch.int16), b.view(torch.int16))
        for a, b in zip(trainer.state_dict().values(), engine.state_dict().values(), strict=True)
    )


async def sync(tx: Any, rx: Any, trainer: torch.nn.Module, sink: Any, **kw: Any) -> Any:
    out = await run_both(
        receive=lambda: ss.receive(rx, sink, timeout=10),
        send=lambda: ss.send(trainer, tx, pipeline=cast(torch.bfloat16), timeout=10, **kw),
    )
    return out["send"], out["receive"]


async def test_a_delta_moves_only_what_changed_and_is_bit_exact() -> None:
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        reports = []
        for s in range(6):
            step(trainer, s)
            sent, got = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True)
            assert isinstance(got, ss.SyncReport), got
            assert same(trainer, engine)
            reports.append(sent)
        # Nothing changed: no tensor moves, and the model still holds it all.
        sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True)
    first, *deltas = reports
    assert first.delta.base is None and "no baseline" in first.delta.full_reason
    assert first.wire_bytes == first.nbytes or first.wire_bytes >= first.nbytes
    for report, before in zip(deltas, reports, strict=False):
        assert report.delta.base == before.sync_id and report.delta.full_reason is None
        assert report.delta.sparse == 4 and report.delta.dense == 0
        assert report.wire_bytes < first.wire_bytes / 5
        assert report.nbytes == first.nbytes  # the tensors it represents
        assert report.delta.baseline_bytes == first.nbytes
    assert sent.delta.unchanged == 4 and sent.wire_bytes == 0 and same(trainer, engine)


async def test_full_on_request_then_deltas_again() -> None:
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        for s, mode in enumerate([True, True, "full", True]):
            step(trainer, s)
            sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=mode)
            assert same(trainer, engine)
            if mode == "full":
                assert sent.delta.full_reason == "a full sync was asked for"
            elif s:
                assert sent.delta.full_reason is None
        # A plain sync drops the baseline (the receivers move past it): the next is full.
        step(trainer, 9)
        await sync(tx, rx, trainer, ss.ModuleSink(engine))
        sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True)
        assert "no baseline" in sent.delta.full_reason and same(trainer, engine)


async def test_a_restarted_receiver_gets_a_full_sync() -> None:
    trainer = model()
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx:
        async with ss.open_receiver(url) as rx:
            engine = model().to(torch.bfloat16)
            for s in range(2):
                step(trainer, s)
                await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True)
        # The engine restarts: a fresh model on a fresh channel, at another version.
        fresh = model().to(torch.bfloat16)
        async with ss.open_receiver(url) as rx:
            step(trainer, 5)
            sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(fresh), delta=True)
            assert "receiver 0 holds no known version" in sent.delta.full_reason
            assert same(trainer, fresh)
            step(trainer, 6)
            sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(fresh), delta=True)
            assert sent.delta.full_reason is None and same(trainer, fresh)


class FailingSink(ss.ModuleSink):
    """Fails on its second bucket, once."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.loads = 0

    def load(self, tensors: Any) -> None:
        self.loads += 1
        if self.loads == 2:
            raise RuntimeError("disk full")
        super().load(tensors)


async def test_a_failed_delta_leaves_the_baseline_and_the_next_sync_is_full() -> None:
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}?slot_bytes=4096"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        step(trainer, 0)
        await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True, bucket_bytes=4096)
        step(trainer, 1, fraction=0.2)
        sent, got = await sync(tx, rx, trainer, FailingSink(engine), delta=True, bucket_bytes=4096)
        assert isinstance(sent, ss.ReceiverFailedError) and isinstance(got, RuntimeError)
        assert ss.ModuleSink(engine).version is None  # part of a delta: no known version
        assert receiver_state(rx).held is None and receiver_state(rx).version_of(engine) is None
        sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True, bucket_bytes=4096)
        assert "receiver 0 holds no known version" in sent.delta.full_reason
        assert same(trainer, engine)


async def test_a_failed_full_sync_over_the_old_storage_leaves_no_baseline() -> None:
    """A full sync overwrites the old baseline's storage: failed, it leaves no baseline, and
    the next sync is full, then deltas on it, all bit-exact."""
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}?slot_bytes=4096"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        step(trainer, 0)
        await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True, bucket_bytes=4096)
        step(trainer, 1, fraction=0.2)
        sent, _ = await sync(tx, rx, trainer, FailingSink(engine), delta="full", bucket_bytes=4096)
        assert isinstance(sent, ss.ReceiverFailedError)
        assert sender_state(tx).baseline.version is None and not sender_state(tx).baseline.tensors
        for s in (2, 3):
            step(trainer, s)
            sent, _ = await sync(
                tx, rx, trainer, ss.ModuleSink(engine), delta=True, bucket_bytes=4096
            )
            assert same(trainer, engine)
            assert (sent.delta.base is None) == (s == 2), sent.delta


async def test_a_receiver_absent_from_a_sync_gets_a_full_one_when_back() -> None:
    trainer = model()
    engines = [model().to(torch.bfloat16) for _ in range(2)]
    url = f"memory://delta-{next(_names)}?receivers=2&require_all=false"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx0:
        async with ss.open_receiver(url) as rx1:
            for s in range(2):
                step(trainer, s)
                out = await run_both(
                    a=lambda: ss.receive(rx0, ss.ModuleSink(engines[0]), timeout=10),
                    b=lambda: ss.receive(rx1, ss.ModuleSink(engines[1]), timeout=10),
                    send=lambda: ss.send(trainer, tx, pipeline=cast(torch.bfloat16), delta=True),
                )
                assert all(isinstance(v, ss.SyncReport) for v in out.values()), out
        # Receiver 1 is away for one sync (a delta for receiver 0 alone)...
        step(trainer, 2)
        sent, _ = await sync(tx, rx0, trainer, ss.ModuleSink(engines[0]), delta=True)
        assert sent.delta.full_reason is None and sent.absent
        # ...and comes back holding the version before: that sync is full, for both.
        async with ss.open_receiver(url) as rx1:
            step(trainer, 3)
            out = await run_both(
                a=lambda: ss.receive(rx0, ss.ModuleSink(engines[0]), timeout=10),
                b=lambda: ss.receive(rx1, ss.ModuleSink(engines[1]), timeout=10),
                send=lambda: ss.send(trainer, tx, pipeline=cast(torch.bfloat16), delta=True),
            )
    assert "no known version" in out["send"].delta.full_reason
    assert same(trainer, engines[0]) and same(trainer, engines[1])


async def test_a_sink_on_another_version_refuses_the_delta_and_nothing_is_applied() -> None:
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        for s in range(2):
            step(trainer, s)
            await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True)
        # The receiver hands the channel another model (at no known version).
        other = model().to(torch.bfloat16)
        before = {k: v.clone() for k, v in other.state_dict().items()}
        step(trainer, 2)
        sent, got = await sync(tx, rx, trainer, ss.ModuleSink(other), delta=True)
        assert isinstance(got, ss.DeltaBaseError) and "no known version" in str(got)
        assert got.report.loaded == ()
        assert isinstance(sent, ss.ReceiverFailedError) and "DeltaBaseError" in str(sent)
        assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
        sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(other), delta=True)
        assert sent.delta.full_reason is not None and same(trainer, other)


async def test_delta_needs_an_open_sender() -> None:
    with pytest.raises(ss.ConfigError, match="delta needs an open sender"):
        await ss.send({"w": torch.ones(2)}, "memory://nowhere", delta=True)
    async with ss.open_sender("memory://nowhere") as tx:
        with pytest.raises(ss.ConfigError, match="delta='sometimes'"):
            await ss.send({"w": torch.ones(2)}, tx, delta="sometimes")  # type: ignore[arg-type]


# -- the patch format ------------------------------------------------------------------
_DTYPES = [torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.bool]


def _diff_finds_exactly_the_changed_bits(dtype: torch.dtype) -> None:
    """Diff random bytes against a copy with 1% of them flipped; the patch names exactly the
    elements whose bits differ (computed here with plain torch), and applied to the baseline
    gives the new bytes. Self-contained: the fallback test runs its source in a subprocess."""
    gen = torch.Generator().manual_seed(1)
    for numel in (1, 5, 33, 4099, 3 << 20):
        base = torch.randint(0, 256, (numel * dtype.itemsize,), generator=gen, dtype=torch.uint8)
        new = base.clone()
        hits = torch.randint(0, new.numel(), (max(1, new.numel() // 100),), generator=gen)
        new[hits] ^= torch.randint(1, 256, hits.shape, generator=gen, dtype=torch.uint8)
        found = patches.diff(new, base, dtype.itemsize)
        width = dtype.itemsize
        changed = (new.view(-1, width) != base.view(-1, width)).any(1).nonzero().squeeze(1)
        if found is None:  # only where a patch would not be smaller
            k = changed.numel()
            assert patches.patch_nbytes(k, numel, width) >= numel * width, (numel, k)
            continue
        pos, vals = found
        assert pos.tolist() == changed.tolist()
        patched = base.clone()
        patches.apply(patched, (pos, vals), width)
        assert torch.equal(patched, new)


@pytest.mark.parametrize("dtype", _DTYPES)
def test_diff_finds_exactly_the_changed_bits(dtype: torch.dtype) -> None:
    if patches.kernel() != "c":
        pytest.fail("the C kernel is not built here (pip install -e . builds it)")
    _diff_finds_exactly_the_changed_bits(dtype)


@pytest.mark.slow  # a fresh interpreter: make test, not the edit loop
def test_diff_finds_exactly_the_changed_bits_without_the_compiled_kernel() -> None:
    # The same checks in a process where the extension does not import, as where it was not
    # built: the torch fallback runs.
    script = "\n".join(
        [
            "import sys",
            'sys.modules["streamsync._kernel"] = None',
            "import torch",
            "from streamsync.wire import patch as patches",
            'assert patches.kernel() == "torch"',
            inspect.getsource(_diff_finds_exactly_the_changed_bits),
            f"for dtype in ({', '.join(str(d) for d in _DTYPES)},):",
            "    _diff_finds_exactly_the_changed_bits(dtype)",
            'print("fallback ok")',
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "fallback ok"


def test_nan_and_negative_zero_are_bits() -> None:
    base = torch.tensor([float("nan"), 0.0, 1.0] * 40, dtype=torch.float32)
    new = base.clone()
    new[1] = -0.0  # equal as floats, not as bits
    found = patches.diff(new.view(torch.uint8), base.view(torch.uint8), 4)
    assert found is not None and found[0].tolist() == [1]  # the NaNs did not "change"


def _patch_bucket(name: str, numel: int, positions: list[int]) -> tuple[BucketHeader, torch.Tensor]:
    pos = np.array(positions, dtype=np.int32)
    vals = np.arange(len(positions), dtype=np.uint16) + 7
    buf = torch.empty(patches.patch_nbytes(len(positions), numel, 2), dtype=torch.uint8)
    patches.encode((pos, vals), numel, 2, buf)
    builder = BucketBuilder(1 << 20)
    assert not list(builder.add_patch(name, torch.bfloat16, (numel,), [(len(positions), buf)]))
    bucket = builder.flush()
    assert bucket is not None
    packed = pack_bucket(bucket)
    return BucketHeader(
        1, 0, 0, packed.data.numel(), Layout.of(packed.entries), base=5
    ), packed.data


@pytest.mark.parametrize(
    ("positions", "why"),
    [
        ([3, 9, 400], "position 400 is outside its 300 elements"),
        ([3, 9, 9, 20], "position 9 is given twice"),
        ([3, 20, 9], "position 9 follows position 20"),
        ([-1, 4], "position -1 is outside"),
    ],
)
def test_bad_positions_are_named_and_nothing_is_applied(positions: list[int], why: str) -> None:
    held = {
        "a": torch.zeros(300, dtype=torch.bfloat16),
        "b": torch.zeros(300, dtype=torch.bfloat16),
    }
    good_header, good_data = _patch_bucket("a", 300, [1, 2])
    bad_header, bad_data = _patch_bucket("b", 300, positions)
    # One bucket: a good patch of "a", then the bad one of "b".
    entries = (good_header.entries[0], bad_header.entries[0])
    offset = good_data.numel() + (-good_data.numel()) % 64
    data = torch.zeros(offset + bad_data.numel(), dtype=torch.uint8)
    data[: good_data.numel()] = good_data
    data[offset:] = bad_data
    entries = (entries[0], msgspec.structs.replace(entries[1], offset=offset))
    header = BucketHeader(1, 0, 0, data.numel(), Layout.of(entries), base=5)
    unpacker = Unpacker()
    unpacker.begin(1)
    with pytest.raises(ss.WireFormatError, match=f"patch of tensor 'b': {why}"):
        unpacker.feed(header, data, target=lambda n, d, s: held[n])
    assert not held["a"].any() and not held["b"].any()  # neither patch was applied


def test_a_patch_outside_a_delta_sync_is_refused() -> None:
    header, data = _patch_bucket("a", 300, [1, 2])
    unpacker = Unpacker()
    unpacker.begin(1)
    with pytest.raises(ss.WireFormatError, match="not a delta"):
        unpacker.feed(msgspec.structs.replace(header, base=None), data, target=lambda *a: None)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.binary(min_size=0, max_size=512),
    k=st.integers(-3, 200),
    numel=st.integers(0, 300),
    nbytes=st.integers(-8, 600),
)
def test_fuzzed_patch_entries_fail_only_as_wire_errors(
    raw: bytes, k: int, numel: int, nbytes: int
) -> None:
    """Random bytes and counts under a patch entry: a WireFormatError (or DeltaBaseError)
    or a patch applied within the tensor; never another exception, a write outside the
    tensor's own bytes, or an allocation (every view is of the received buffer)."""
    from streamsync.wire.frames import Entry

    guard = torch.zeros(numel + 64, dtype=torch.bfloat16)  # the tensor, then a fence
    tensor = guard[:numel]
    data = torch.frombuffer(bytearray(raw.ljust(640, b"\0")), dtype=torch.uint8)
    entry = Entry("t", "bfloat16", (numel,), 0, nbytes, 0, 1, 0, None, k)
    header = BucketHeader(1, 0, 0, len(raw), Layout.of([entry]), base=5)
    unpacker = Unpacker()
    unpacker.begin(1)
    with contextlib.suppress(ss.WireFormatError, ss.DeltaBaseError):
        unpacker.feed(header, data, target=lambda n, d, s: tensor)
    assert not guard[numel:].view(torch.int16).any()  # nothing written past the tensor


def test_the_fused_cast_gives_torchs_bf16_bits() -> None:
    """fp32 -> bf16 inside the comparison: the same bits as ``tensor.to(torch.bfloat16)``
    for every number (ties to even, subnormals, infinities, signed zeros, the largest
    finite values that round to infinity); a NaN leaves the tensor to torch."""
    if patches.kernel() != "c":
        pytest.fail("the C kernel did not build on this machine (a C compiler is expected)")
    special = torch.tensor(
        [
            *(0.0, -0.0, 1.0, -1.0, 1e-40, -1e-42, 1.17e-38, float("inf"), float("-inf")),
            *(3.4e38, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 2.0**-130),
        ],
        dtype=torch.float32,
    )
    gen = torch.Generator().manual_seed(3)
    source = torch.cat([special, torch.randn(100_000, generator=gen) * 0.02, special])
    bits = torch.randint(0, 1 << 32, (5000,), generator=gen, dtype=torch.int64)
    source = torch.cat([source, bits.to(torch.int32).view(torch.float32)])
    source = source[~source.isnan()]
    want = source.to(torch.bfloat16)
    # The baseline is torch's conversion with every 50th element stale: a conversion that
    # differed anywhere from torch's would show as a change, and patch in its own bits.
    base = want.clone()
    base[::50] = 7.0
    found = patches.diff_cast(source, base.view(torch.uint8))
    assert isinstance(found, tuple)
    patched = base.clone()
    patches.apply(patched, found, 2)
    assert torch.equal(patched.view(torch.int16), want.view(torch.int16))
    with_nan = source.clone()
    with_nan[7] = float("nan")
    assert patches.diff_cast(with_nan, base.view(torch.uint8)) == patches.UNCAST


def test_a_sync_costs_its_whole_seconds_delta_or_dense() -> None:
    from streamsync._delta import sync_cost

    report = ss.SyncReport(
        sync_id=1,
        side="send",
        tensors=1,
        nbytes=1 << 20,
        buckets=1,
        seconds=0.4,
        phases={"source": 0.1, "send": 0.25, "end": 0.05},
    )
    assert sync_cost(report, True) == sync_cost(report, False) == 0.4


def costs(deltas: list[float], dense: float = 1.0, **kw: Any) -> Any:
    """A verdict whose syncs cost as scripted: each plain dense one ``dense`` seconds, the
    deltas ``deltas`` in turn (every sync counts, however small)."""
    from streamsync._delta import Verdict

    left = iter(deltas)
    kw.setdefault("min_bytes", 0)
    return Verdict(cost=lambda report, delta: next(left) if delta else dense, **kw)


async def delta_syncs(
    tx: Any, rx: Any, trainer: torch.nn.Module, engine: torch.nn.Module, seeds: range, **kw: Any
) -> list[Any]:
    """Train and sync with ``delta=True`` once per seed; each sync bit-exact; the reports."""
    out = []
    for s in seeds:
        step(trainer, s)
        sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True, **kw)
        assert same(trainer, engine)
        out.append(sent)
    return out


def fulls(sent: list[Any]) -> list[int]:
    return [i for i, r in enumerate(sent) if r.delta.base is None]


#: A new channel: a full sync, a cold delta, two warm ones; then a dense sync timed, a full
#: one recording a baseline again, a cold delta; the next delta is judged.
TIMED, REBASED, JUDGED = 4, 5, 7


async def test_cold_syncs_are_not_judged() -> None:
    """The first delta on each baseline (here five times a dense sync) is not counted, nor
    is a full sync that records a baseline: the channel times a plain dense one. The warm
    deltas pay, after the first full sync and after one asked for."""
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        script = [5.0, 0.5, 0.85, 5.0, 0.85, 0.85, 5.0, 0.5, 0.5]
        sender_state(tx).baseline.verdict = costs(script)
        sent = await delta_syncs(tx, rx, trainer, engine, range(9))
        assert fulls(sent) == [0, TIMED, REBASED]
        assert sent[TIMED].delta.full_reason == "timing a dense sync to judge deltas against"
        assert sent[TIMED].delta.dense == 4
        assert sent[REBASED].delta.full_reason == (
            "recording a baseline again after a dense sync timed"
        )
        assert all(r.delta.full_reason is None for r in sent[1:TIMED] + sent[REBASED + 1 :])
        sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta="full")
        assert sent.delta.full_reason == "a full sync was asked for"
        sent = await delta_syncs(tx, rx, trainer, engine, range(9, 12))
        assert all(r.delta.base is not None and r.delta.full_reason is None for r in sent)
        assert sender_state(tx).baseline.verdict.declined is None


def storage(tx: Any) -> dict[str, tuple[torch.Tensor, int]]:
    """Each tensor of the sender's baseline: its bytes and where they live."""
    held = sender_state(tx).baseline.tensors.items()
    return {name: (raw, raw.data_ptr()) for name, (_, _, raw) in held}


def same_storage(now: dict[str, Any], before: dict[str, Any]) -> bool:
    return now.keys() == before.keys() and all(
        now[name][0] is raw and now[name][1] == ptr for name, (raw, ptr) in before.items()
    )


async def test_a_full_sync_records_its_baseline_into_the_old_ones_storage() -> None:
    """A full sync that replaces a baseline records into its storage (no fresh memory to
    fault in), also across the dense sync timed before a baseline is recorded again, and
    holds no more than one baseline (a declined channel frees it: the test below)."""
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        sender_state(tx).baseline.verdict = costs([5.0, 0.5, 0.85, 5.0, 0.85, 0.85])
        sent = await delta_syncs(tx, rx, trainer, engine, range(1))
        first, size = storage(tx), sent[0].nbytes
        assert len(first) == 4 and sender_state(tx).baseline.nbytes == size
        sent += await delta_syncs(tx, rx, trainer, engine, range(1, TIMED + 1))
        assert fulls(sent) == [0, TIMED] and sent[TIMED].delta.dense == 4
        assert sender_state(tx).baseline.nbytes == size  # the timed dense sync kept the storage
        sent = await delta_syncs(tx, rx, trainer, engine, range(TIMED + 1, REBASED + 1))
        assert sent[0].delta.full_reason == "recording a baseline again after a dense sync timed"
        assert same_storage(storage(tx), first) and sender_state(tx).baseline.nbytes == size
        for s in (10, 11):
            step(trainer, s)
            sent, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta="full")
            assert sent.delta.base is None and same(trainer, engine)
            assert same_storage(storage(tx), first) and sender_state(tx).baseline.nbytes == size


def test_a_full_sync_on_a_new_layout_frees_the_old_storage_first() -> None:
    """Tensors that fit their old storage (name, dtype, shape) are recorded into it, bit
    exact; the first that does not frees the rest, so two baselines are never held."""
    from streamsync._delta import Baseline, DeltaRun

    def raw(numel: int) -> torch.Tensor:
        return torch.zeros(numel * 2, dtype=torch.uint8)

    kept, other, gone = raw(8), raw(8), raw(16)
    baseline = Baseline(version=3)
    baseline.tensors = {
        "kept": (torch.bfloat16, (8,), kept),
        "other": (torch.bfloat16, (8,), other),
        "gone": (torch.bfloat16, (16,), gone),
    }
    refs = [weakref.ref(t) for t in (other, gone)]
    del other, gone
    run = DeltaRun(baseline, None, 1 << 20, cast=lambda name, dtype: torch.bfloat16)
    assert baseline.version is None and not baseline.tensors
    builder = BucketBuilder(1 << 20, cast=run.cast)
    source = torch.randn(8)
    run.place(builder, "kept", source)
    assert all(ref() is not None for ref in refs)
    run.place(builder, "new", torch.randn(4))
    gc.collect()
    assert all(ref() is None for ref in refs)
    run.commit(4)
    got = baseline.tensors["kept"][2]
    assert got is kept
    assert torch.equal(got.view(torch.int16), source.to(torch.bfloat16).view(torch.int16))
    assert baseline.version == 4 and baseline.nbytes == (8 + 4) * 2


async def test_a_channel_declines_deltas_that_cost_more_in_steady_state() -> None:
    """Warm deltas over 0.9 of a dense sync: the delta that tips the median carries the
    reason, with both figures, and the syncs after it go dense and untracked. Syncs under
    16 MiB are not judged."""
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        sender_state(tx).baseline.verdict = costs([0.2, 0.95, 0.95, 0.2, 0.95], probe_after=3)
        sent = await delta_syncs(tx, rx, trainer, engine, range(11))
        assert fulls(sent) == [0, TIMED, REBASED, 8, 9, 10]
        why = sent[JUDGED].delta.full_reason
        assert why is not None and "do not pay" in why, why
        assert "0.950 s" in why and "1.000 s" in why and "next 3 syncs" in why
        assert sent[JUDGED - 1].delta.full_reason is None
        for r in sent[JUDGED + 1 :]:
            assert r.delta.full_reason == why and r.delta.dense == 4
            assert r.wire_bytes >= r.nbytes
        assert sender_state(tx).baseline.nbytes == 0  # declined: no copy kept
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        sender_state(tx).baseline.verdict = costs([9.0] * 5, min_bytes=16 << 20)
        sent = await delta_syncs(tx, rx, trainer, engine, range(6))
        assert fulls(sent) == [0]


async def test_a_declined_channel_probes_again_after_a_back_off() -> None:
    """Declined, a channel sends ``probe_after`` dense syncs, then a full one that records a
    baseline and deltas on it; a probe that does not pay doubles the wait, one that pays
    keeps deltas on and resets it."""
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        script = [0.2, 0.95, 0.95, 0.2, 0.95, 3.0, 2.0, 2.0, 3.0, 0.3, 0.3, 0.3]
        verdict = costs(script, probe_after=2)
        sender_state(tx).baseline.verdict = verdict
        sent = await delta_syncs(tx, rx, trainer, engine, range(23))
        assert fulls(sent) == [0, TIMED, REBASED, 8, 9, 10, 14, 15, 16, 17, 18]
        assert "next 2 syncs" in str(sent[JUDGED].delta.full_reason)
        assert sent[10].delta.full_reason == "trying deltas again after 2 dense syncs"
        assert "next 4 syncs" in str(sent[13].delta.full_reason)
        assert "2.000 s" in str(sent[13].delta.full_reason)
        assert sent[18].delta.full_reason == "trying deltas again after 4 dense syncs"
        assert all(r.delta.full_reason is None for r in sent[19:])
        assert verdict.backoff == 2 and verdict.declined is None


async def test_a_declined_channel_sends_dense_syncs_until_a_full_one_is_asked_for() -> None:
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        sender_state(tx).baseline.verdict = costs([2.0] * 5 + [0.1] * 3, probe_after=100)
        sent = await delta_syncs(tx, rx, trainer, engine, range(10))
        declined = sent[JUDGED].delta.full_reason
        assert declined is not None and "do not pay" in declined
        for r in sent[JUDGED + 1 :]:
            assert r.delta.full_reason == declined and r.delta.dense == 4
        step(trainer, 10)
        got, _ = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta="full")
        assert got.delta.full_reason == "a full sync was asked for"
        sent = await delta_syncs(tx, rx, trainer, engine, range(11, 14))
        assert all(r.delta.full_reason is None and r.delta.base is not None for r in sent)


async def test_the_receiver_keeps_its_models_version_and_not_the_model() -> None:
    trainer, engine = model(), model().to(torch.bfloat16)
    url = f"memory://delta-{next(_names)}"
    async with ss.open_sender(url) as tx, ss.open_receiver(url) as rx:
        sent, got = await sync(tx, rx, trainer, ss.ModuleSink(engine), delta=True)
        assert receiver_state(rx).version_of(engine) == got.sync_id == sent.sync_id
        assert receiver_state(rx).version_of(model()) is None
        # Nothing outside the receiver knows it: another receiver's sync would be full.
        assert ss.ModuleSink(engine).version is None
        gone = weakref.ref(engine)
        del engine
        gc.collect()
        assert gone() is None and receiver_state(rx).version_of(gone) is None
