"""Send/receive over ``memory://``: round trip, backpressure, fan-out, timeouts, failures."""

from __future__ import annotations

from functools import partial

import anyio
import pytest
import torch
from conftest import run_both

import streamsync as ss
from streamsync.testing import FakeConfig, FakeVllmModel, LoadWeightsSink, fake_state_dict
from streamsync.wire.frames import Abort, Failed


class Recorder:
    """A sink that keeps copies and can be slowed down."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.items: list[tuple[str, torch.Tensor]] = []
        self.phases: list[str] = []

    async def prepare(self) -> None:
        self.phases.append("prepare")

    async def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.phases.append("load")
        if self.delay:
            await anyio.sleep(self.delay)
        self.items.extend((n, t.clone()) for n, t in tensors)

    def finalize(self) -> None:
        self.phases.append("finalize")


async def run_pair(
    weights: object, url: str, sink: object, **send_kw: object
) -> tuple[ss.SyncReport, ss.SyncReport]:
    out: dict[str, ss.SyncReport] = {}

    async def rx() -> None:
        out["rx"] = await ss.receive(url, sink, timeout=5)  # type: ignore[arg-type]

    async def tx() -> None:
        out["tx"] = await ss.send(weights, url, timeout=5, **send_kw)  # type: ignore[arg-type]

    async with anyio.create_task_group() as tg:
        tg.start_soon(rx)
        tg.start_soon(tx)
    return out["tx"], out["rx"]


async def test_round_trip_reports_and_phases() -> None:
    weights = fake_state_dict()
    sink = Recorder()
    tx, rx = await run_pair(weights, "memory://rt", sink, bucket_bytes=8192)
    assert [n for n, _ in sink.items] == list(weights)
    for name, t in sink.items:
        assert torch.equal(t, weights[name])
    assert sink.phases[0] == "prepare" and sink.phases[-1] == "finalize"
    assert sink.phases.count("load") == tx.buckets == rx.buckets > 1
    assert tx.nbytes == rx.nbytes and tx.tensors == rx.tensors == len(weights)
    assert tx.complete and rx.complete


async def test_into_a_vllm_style_model_stacks_qkv() -> None:
    cfg = FakeConfig()
    weights = fake_state_dict(cfg)
    model = FakeVllmModel(cfg)
    _, rx = await run_pair(weights, "memory://vllm", LoadWeightsSink(model), bucket_bytes=4096)
    assert rx.missing == ()
    qkv = model.named_weights()["model.layers.0.self_attn.qkv_proj.weight"]
    want = torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, want)


async def test_slow_receiver_applies_backpressure() -> None:
    # 2 slots: the sender can be at most 2 buckets ahead of the receiver's releases. While
    # the sink dawdles over bucket k (its slot not yet released), the sender has published
    # at most buckets 0..k+1, and does publish k+1: it is exactly 2 ahead.
    weights = {f"t{i}": torch.full((200,), float(i)) for i in range(10)}  # 800 B each
    ahead: list[int] = []
    sender = ss.open_sender("memory://bp?slots=2&slot_bytes=1024")

    class Dawdler(Recorder):
        async def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
            await super().load(tensors)  # sleeps: the sender runs ahead meanwhile
            stats = sender.statistics()
            assert stats is not None
            ahead.append(stats.buckets - len(ahead))

    sink = Dawdler(delay=0.02)

    async def rx() -> None:
        async with ss.open_receiver("memory://bp") as receiver:
            await ss.receive(receiver, sink, timeout=5)

    async def tx() -> None:
        async with sender:
            await ss.send(weights, sender, timeout=5)

    async with anyio.create_task_group() as tg:
        tg.start_soon(rx)
        tg.start_soon(tx)
    assert len(ahead) == 10 and len(sink.items) == 10
    assert ahead[:-1] == [2] * 9 and ahead[-1] == 1, ahead  # the last bucket has no successor


async def test_fan_out_to_two_receivers() -> None:
    weights = fake_state_dict()
    sinks = [Recorder(), Recorder(delay=0.001)]
    reports: list[ss.SyncReport] = []

    async def rx(sink: Recorder) -> None:
        reports.append(await ss.receive("memory://fan", sink, timeout=5))

    async def tx() -> None:
        reports.append(
            await ss.send(weights, "memory://fan?receivers=2", bucket_bytes=4096, timeout=5)
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(rx, sinks[0])
        tg.start_soon(rx, sinks[1])
        tg.start_soon(tx)
    for sink in sinks:
        assert [n for n, _ in sink.items] == list(weights)
        assert all(torch.equal(t, weights[n]) for n, t in sink.items)
    send_report = next(r for r in reports if r.side == "send")
    assert send_report.receivers == 2


async def test_persistent_channel_reuses_slots_and_refuses_stale_syncs() -> None:
    async with (
        ss.open_sender("memory://persist", slot_bytes=4096) as sender,
        ss.open_receiver("memory://persist") as receiver,
    ):
        slots_before = [sender.slot(i).data_ptr() for i in range(2)]
        for step in range(3):
            sink = Recorder()
            weights = {"w": torch.full((10,), float(step))}
            out = await run_both(
                rx=lambda s=sink: ss.receive(receiver, s, timeout=5),
                tx=lambda w=weights: ss.send(w, sender, timeout=5),
            )
            assert out["rx"].complete
            assert torch.equal(sink.items[0][1], weights["w"])
        assert [sender.slot(i).data_ptr() for i in range(2)] == slots_before
        # A sync id older than the last applied one is refused by the receiver...
        out = await run_both(
            rx=lambda: ss.receive(receiver, Recorder(), timeout=5),
            tx=lambda: ss.send({"w": torch.ones(1)}, sender, timeout=5, sync_id=1),
        )
        assert isinstance(out["rx"], ss.StaleSyncError)
        assert isinstance(out["tx"], ss.ReceiverFailedError) and "StaleSyncError" in str(out["tx"])
        # ...and the channel still works for the next, newer sync.
        sink = Recorder()
        out = await run_both(
            rx=lambda: ss.receive(receiver, sink, timeout=5),
            tx=lambda: ss.send({"w": torch.ones(1)}, sender, timeout=5),
        )
        assert out["rx"].complete and torch.equal(sink.items[0][1], torch.ones(1))


async def test_receiver_times_out_on_silent_sender() -> None:
    async with ss.open_sender("memory://silent"), ss.open_receiver("memory://silent") as receiver:
        with anyio.fail_after(5):
            with pytest.raises(ss.SyncTimeoutError, match=r"within 0\.2 s"):
                await ss.receive(receiver, Recorder(), timeout=0.2)


async def test_sender_times_out_when_receiver_never_acks() -> None:
    async with (
        ss.open_sender("memory://noack", slots=1, slot_bytes=1024) as sender,
        ss.open_receiver("memory://noack"),
    ):
        with anyio.fail_after(5), pytest.raises(ss.SyncTimeoutError, match="free slot"):
            await ss.send({f"t{i}": torch.ones(200) for i in range(3)}, sender, timeout=0.2)


async def test_sender_times_out_when_no_receiver_joins() -> None:
    with anyio.fail_after(5), pytest.raises(ss.SyncTimeoutError, match="0 of 1 receivers"):
        await ss.send({"w": torch.ones(1)}, "memory://nobody", timeout=0.2)


async def test_source_error_aborts_the_receiver() -> None:
    async def bad_source():  # type: ignore[no-untyped-def]
        yield "ok", torch.ones(300)
        yield "ok2", torch.ones(300)
        raise RuntimeError("trainer exploded")

    errors: dict[str, BaseException] = {}

    async def rx() -> None:
        try:
            await ss.receive("memory://abort", Recorder(), timeout=5)
        except ss.StreamsyncError as exc:
            errors["rx"] = exc

    async def tx() -> None:
        try:
            await ss.send(bad_source(), "memory://abort", bucket_bytes=1024, timeout=5)
        except RuntimeError as exc:
            errors["tx"] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(rx)
        tg.start_soon(tx)
    assert isinstance(errors["rx"], ss.SenderAbortedError)
    assert "trainer exploded" in str(errors["rx"])
    assert errors["rx"].report is not None and not errors["rx"].report.complete
    assert "trainer exploded" in str(errors["tx"])


async def test_closed_by_me_differs_from_broken_by_peer() -> None:
    sender = ss.open_sender("memory://close")
    receiver = ss.open_receiver("memory://close")
    async with receiver:
        async with sender:
            pass
        # The sender closed cleanly: the receiver's stream ends.
        with pytest.raises(ss.EndOfStream):
            await receiver.receive(timeout=1)
    with pytest.raises(ss.ClosedError):
        await receiver.receive(timeout=1)

    sender2 = ss.open_sender("memory://broken")
    async with sender2:
        r2 = ss.open_receiver("memory://broken")
        await r2.open()
        await r2.aclose()  # the receiver goes away between syncs...
        # ...so the next sync waits for a replacement (and says so when none comes)...
        with pytest.raises(ss.SyncTimeoutError, match="0 of 1 receivers"):
            await ss.send({"w": torch.ones(1)}, sender2, timeout=0.2)
        # ...and one that comes gets it, on the same channel.
        async with ss.open_receiver("memory://broken") as r3:
            model = torch.nn.Linear(1, 1, bias=False)
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(ss.receive, r3, ss.ModuleSink(model), timeout=5))
                report = await ss.send({"weight": torch.ones(1, 1)}, sender2, timeout=5)
        assert r3.index == 0 and report.receivers == 1
        assert torch.equal(model.weight.detach(), torch.ones(1, 1))


async def test_receiver_receives_messages_in_order() -> None:
    async with (
        ss.open_sender("memory://iter", slot_bytes=4096) as sender,
        ss.open_receiver("memory://iter") as receiver,
    ):

        async def tx() -> None:
            await ss.send({"w": torch.ones(4)}, sender, timeout=5)

        kinds = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(tx)
            while True:
                incoming = await receiver.receive(timeout=5)
                kinds.append(type(incoming.message).__name__)
                if kinds[-1] == "BucketHeader":
                    await receiver.release(incoming.message)
                else:
                    from streamsync.wire.frames import Done

                    await receiver.reply(Done(incoming.message.sync_id, 0, 1, 16))
                    break
        assert kinds == ["BucketHeader", "End"]


@pytest.mark.parametrize("require_all", [True, False])
async def test_a_sync_whose_only_receiver_leaves_after_its_end_fails(require_all: bool) -> None:
    # The receiver reads the whole sync, End included, and closes instead of reporting: the
    # sender hears its goodbye while it waits for the reports. With no receiver left to
    # report, the sync is not a success, even when it may go on without some of them.
    async with ss.open_sender(
        "memory://leaves", slot_bytes=4096, require_all=require_all
    ) as sender:
        receiver = ss.open_receiver("memory://leaves")
        await receiver.open()
        got: dict[str, object] = {}

        async def tx() -> None:
            try:
                got["report"] = await ss.send({"w": torch.ones(4)}, sender, timeout=5)
            except ss.StreamsyncError as exc:
                got["error"] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(tx)
            while True:
                incoming = await receiver.receive(timeout=5)
                if type(incoming.message).__name__ == "BucketHeader":
                    await receiver.release(incoming.message)
                    continue
                assert type(incoming.message).__name__ == "End"
                await receiver.aclose()
                break
        assert "report" not in got, got
        assert isinstance(got["error"], ss.PeerBrokenError), got
        assert "closed the channel" in str(got["error"])


async def test_unknown_scheme_lists_valid_ones() -> None:
    with pytest.raises(ss.ConfigError, match="memory"):
        await ss.send({}, "carrier-pigeon://x")


async def test_a_receiver_failing_on_the_last_bucket_aborts_the_others() -> None:
    # Bucket 1 (the last) fails on one receiver before the sender ends the sync: the other
    # receiver must hear that the sync is abandoned, not wait out its timeout for an End.
    from streamsync.wire.pack import BucketBuilder

    failed = anyio.Event()

    class FailsOnW1(Recorder):
        async def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
            if any(name == "w1" for name, _ in tensors):
                failed.set()
                raise ss.UnknownTensorError("w1 is not a parameter here")
            await super().load(tensors)

    async def buckets():  # type: ignore[no-untyped-def]
        for name in ("w0", "w1"):
            builder = BucketBuilder(1024)
            assert not list(builder.add(name, torch.ones(256)))
            yield builder.flush()
        await failed.wait()  # end the sync only once the failure is in

    errors: dict[str, BaseException] = {}

    async def rx(tag: str, sink: Recorder) -> None:
        try:
            await ss.receive("memory://lastfail", sink, timeout=30)
        except ss.StreamsyncError as exc:
            errors[tag] = exc

    async def tx() -> None:
        try:
            await ss.send(buckets(), "memory://lastfail?receivers=2", bucket_bytes=1024, timeout=30)
        except ss.StreamsyncError as exc:
            errors["tx"] = exc

    with anyio.fail_after(10):  # well inside the 30 s timeout: nobody waits it out
        async with anyio.create_task_group() as tg:
            tg.start_soon(rx, "healthy", Recorder())
            tg.start_soon(rx, "failing", FailsOnW1())
            tg.start_soon(tx)
    assert isinstance(errors["failing"], ss.UnknownTensorError)
    assert isinstance(errors["tx"], ss.ReceiverFailedError)
    assert isinstance(errors["healthy"], ss.SenderAbortedError), errors["healthy"]


@pytest.mark.parametrize(
    ("survivor_error", "raised"),
    [("SyncTimeoutError", ss.PeerBrokenError), ("ShapeMismatchError", ss.ReceiverFailedError)],
)
async def test_a_survivors_timeout_is_not_blamed_for_a_lost_receiver(
    survivor_error: str, raised: type[ss.StreamsyncError]
) -> None:
    """One receiver dies mid-sync and the other's receive times out: the sender raises the
    death (PeerBrokenError), in whichever order it hears the two. A survivor that failed
    for a reason of its own is still named (ReceiverFailedError)."""
    for lost_first in (True, False):
        url = f"memory://blame-{lost_first}?receivers=2"
        async with ss.open_sender(url) as tx, ss.open_receiver(url), ss.open_receiver(url):
            assert await tx.begin(7, timeout=5) == {0: None, 1: None}
            lose = partial(tx.on_left, 0, ss.PeerBrokenError("receiver 0 went away"))
            fail = partial(tx.on_reply, Failed(7, 1, survivor_error, "waiting for bucket 3"))
            for step in (lose, fail) if lost_first else (fail, lose):
                step()
            with pytest.raises(raised) as caught:
                await tx.wait_ready(timeout=5)
            wanted = "receiver 0 went away" if raised is ss.PeerBrokenError else "receiver 1 failed"
            assert wanted in str(caught.value)


async def test_a_send_cancelled_while_receivers_join_tells_the_ones_waiting() -> None:
    # WeightSync cancels its send when an engine fails, perhaps while the sender still
    # waits for every receiver. A receiver already waiting for that sync must hear it is
    # off: unheard, it would take the next sync's buckets for its own (an engine worker's
    # stale receive did, under load), and the next receive would find none.
    weights = {"w": torch.ones(4)}
    async with (
        ss.open_sender("memory://cancelled-join?receivers=2") as tx,
        ss.open_receiver("memory://cancelled-join") as first,
    ):
        outcome: dict[str, BaseException | ss.SyncReport] = {}

        async def waiting() -> None:
            try:
                outcome["rx"] = await ss.receive(first, Recorder(), timeout=30, sync_id=7)
            except ss.StreamsyncError as exc:
                outcome["rx"] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting)
            with anyio.move_on_after(0.3):  # the second receiver never comes
                await ss.send(weights, tx, timeout=30, sync_id=7)
        assert isinstance(outcome["rx"], ss.SenderAbortedError), outcome
        assert "sync 7" in str(outcome["rx"])
        async with ss.open_receiver("memory://cancelled-join") as second:
            sinks = [Recorder(), Recorder()]
            async with anyio.create_task_group() as tg:
                for rx, sink in zip((first, second), sinks, strict=True):
                    tg.start_soon(partial(ss.receive, rx, sink, timeout=10, sync_id=8))
                report = await ss.send(weights, tx, timeout=10, sync_id=8)
            assert report.complete and report.receivers == 2
            assert [[n for n, _ in s.items] for s in sinks] == [["w"], ["w"]]


async def test_an_abort_after_every_receiver_closed_mid_sync_is_not_an_index_error() -> None:
    # The last receiver to close clears the channel's roster; the sender's sync still counted
    # it, and the abort that followed indexed the empty list (a race the overlapped send
    # made likely: test_sink's partial-report test). The abort finds it gone and says why.
    async with ss.open_sender("memory://roster") as tx, ss.open_receiver("memory://roster") as rx:
        await tx.wait_ready(timeout=5)
        await tx.begin(7, timeout=5)
        # It failed the sync (a member that reported stays one), then closed.
        tx.on_reply(Failed(7, 0, "ShapeMismatchError", "tensor 'c'"))
        await rx.aclose()
        with pytest.raises(ss.ReceiverFailedError, match="'c'"):
            await tx.abort(Abort(7, "receiver 0 failed"))


async def test_a_receive_before_any_sender_is_bounded_by_both_timeouts() -> None:
    # It opens at once (one task may open both sides); its receive waits for a sender
    # within its own timeout, and never past connect_timeout after it opened.
    async with ss.open_receiver("memory://before-any", connect_timeout=60) as receiver:
        with pytest.raises(ss.SyncTimeoutError, match=r"nothing from the sender within 0.2 s"):
            await ss.receive(receiver, None, timeout=0.2)  # type: ignore[arg-type]
    async with ss.open_receiver("memory://before-any", connect_timeout=0.2) as receiver:
        with pytest.raises(ss.SyncTimeoutError, match=r"no sender answered within 0.2 s"):
            await ss.receive(receiver, None, timeout=60)  # type: ignore[arg-type]
