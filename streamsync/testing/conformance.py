"""The conformance suite every transport passes: ours, and users' own.

Subclass :class:`TransportConformance` in a test module and say how to name a fresh
channel; pytest collects the ``test_*`` methods::

    from streamsync.testing.conformance import TransportConformance

    class TestMyTransport(TransportConformance):
        def make_url(self, tag: str) -> str:
            return f"my://{tag}-{os.getpid()}"

The tests run their own event loop (no async test plugin needed). Cross-process tests run
each side in a fresh interpreter (:class:`streamsync.testing.peers.Peers`) that reports
plain data, never tensors; the SIGKILL tests are skipped for in-process transports.

What is checked: bit-exact round trip across processes (every wire dtype, a tensor larger
than a bucket, two syncs on one channel), order, fan-out to two receivers, backpressure (a
receiver that does not release stops a two-slot sender at exactly two buckets in flight),
close versus broken peer, timeouts on a silent peer, a sync that fails before its first
bucket ending at once for the receivers there (:class:`~streamsync.SenderAbortedError`),
SIGKILL of either side mid-sync (the survivor raises :class:`~streamsync.PeerBrokenError`
within twice the timeout), and no
resources left behind (file descriptors, ``/dev/shm`` entries, the paths ``resource_paths``
names; a SIGKILLed sender's rendezvous file is exempt: nothing can remove it), and
membership: a receiver that left is replaced on the open channel, a late joiner takes part
from the next sync (with ``require_all=False`` the sync in progress completes without it
and names the absent one), and a SIGKILLed receiver's place goes to a new process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import anyio
import torch

import streamsync as ss
from streamsync.testing import conformance_sides as sides
from streamsync.testing.conformance_sides import (
    _BUCKET_BYTES,
    _CONNECT_S,
    _both,
    _caught,
    _expected,
    _HashingSink,
    _open_fds,
    _raises,
    _shm_entries,
    conformance_weights,
    digest,
)
from streamsync.testing.peers import Peers, held_elsewhere
from streamsync.transports import open_receiver, open_sender
from streamsync.wire.frames import Abort
from streamsync.wire.pack import BucketBuilder


class TransportConformance:
    """Subclass and define :meth:`make_url`; every ``test_*`` method checks one behaviour."""

    #: Sender and receivers can live in different processes (``False`` for in-process
    #: transports: the cross-process tests are skipped and the rest run in one loop).
    cross_process: bool = True
    #: The transport tells a dead peer from a silent one (``PeerBrokenError``).
    detects_peer_death: bool = True
    #: Module each spawned child imports first (one that registers a user's transport).
    setup_module: str = ""
    #: Seconds of every wait in the suite's syncs.
    timeout: float = 5.0
    #: Options that give a sender a ring of two slots (see :attr:`max_in_flight`).
    two_slots: dict[str, Any] = {"slots": 2}  # noqa: RUF012 - read-only default
    #: Buckets a sender opened with :attr:`two_slots` has in flight to a receiver that never
    #: releases: exactly this many, no fewer, no more. A transport whose ring differs (say,
    #: a slot held back for itself) overrides it with its own exact number, saying why.
    max_in_flight: int = 2
    #: How children start: a fresh interpreter either way; "forkserver" (with torch and
    #: streamsync preloaded) starts them in a fraction of the time "spawn" takes.
    start_method: str = "forkserver"
    #: Receivers may leave and be replaced while the sender's channel stays open (``False``
    #: for a transport whose group of receivers is fixed when it forms: the membership
    #: tests are skipped, with this reason in their message).
    replaces_receivers: bool = True
    #: Extra keyword arguments for the sender and receivers (``secret=...``).
    sender_options: dict[str, Any] = {}  # noqa: RUF012 - read-only defaults
    receiver_options: dict[str, Any] = {}  # noqa: RUF012

    def make_url(self, tag: str) -> str:
        """A URL naming a fresh channel (``tag`` is unique per test)."""
        raise NotImplementedError("define make_url(tag) to return a fresh channel URL")

    def with_receivers(self, url: str, receivers: int) -> str:
        """``url`` asking for ``receivers`` receivers (override if your URL differs)."""
        return f"{url}{'&' if '?' in url else '?'}receivers={receivers}"

    def resource_paths(self, url: str) -> list[str]:
        """Paths that must not exist once both sides are closed or killed (socket files)."""
        return []

    # -- harness ---------------------------------------------------------------------
    def _peers(self) -> Peers:
        """The children of one test: fresh interpreters with this suite and the user's
        ``setup_module`` preloaded; leaving the ``with`` block joins them (kills them if
        the test failed)."""
        return Peers(sides.__name__, self.setup_module, start_method=self.start_method)

    def _spawn(self, peers: Peers, role: str, **args: Any) -> Any:
        options = self.receiver_options if role == "receiver" else self.sender_options
        args = {"timeout": self.timeout, "syncs": 1, "options": options, **args}
        return peers.spawn(sides._child, role, self.setup_module, args)

    def _tx(self, url: str, **options: Any) -> Any:
        """This suite's sender on ``url`` (:attr:`sender_options`, then ``options``)."""
        return open_sender(url, connect_timeout=_CONNECT_S, **{**self.sender_options, **options})

    def _rx(self, url: str, **options: Any) -> Any:
        """This suite's receiver on ``url`` (:attr:`receiver_options` and ``options``)."""
        return open_receiver(url, **self.receiver_options, **options)

    async def _send(self, tx: Any, seed: int = 0, bucket_bytes: int = _BUCKET_BYTES) -> Any:
        weights = conformance_weights(seed)
        return await ss.send(weights, tx, bucket_bytes=bucket_bytes, timeout=self.timeout)

    @staticmethod
    def _reached(peers: Peers, event: str, timeout: float = _CONNECT_S) -> None:
        """Wait until a child reports ``event``; a child failing first fails the test."""
        item = peers.get(
            lambda i: i.get("event") == event or i.get("ok") is False, timeout, f"{event!r} event"
        )
        if item.get("ok") is False:
            raise AssertionError(f"a child failed: {item}")

    @staticmethod
    def _outcomes(peers: Peers, count: int, timeout: float) -> list[dict[str, Any]]:
        """The final reports of ``count`` children, in the order they finished."""
        return [
            peers.get(lambda i: "role" in i, timeout, "a child's outcome") for _ in range(count)
        ]

    def _check_gone(self, url: str, shm_before: set[str], *, paths: bool = True) -> None:
        gc.collect()
        leaked = _shm_entries() - shm_before
        # Another program's segments (a vLLM engine's, on a shared machine) are not ours.
        leaked -= {os.path.basename(p) for p in held_elsewhere(f"/dev/shm/{n}" for n in leaked)}
        assert not leaked, f"{url}: /dev/shm entries left behind: {sorted(leaked)}"
        left = [p for p in self.resource_paths(url) if paths and os.path.exists(p)]
        assert not left, f"{url}: files left behind: {left}"

    # -- round trip and fan-out --------------------------------------------------------
    def test_round_trip_is_bit_exact_and_ordered(self) -> None:
        url = self.make_url("roundtrip")
        if not self.cross_process:
            out = asyncio.run(self._in_process(url, receivers=1, syncs=2))
            assert out == [[_expected(0), _expected(1)]]
            return
        shm_before = _shm_entries()
        with self._peers() as peers:
            self._spawn(peers, "receiver", url=url, syncs=2)
            self._spawn(peers, "sender", url=url, syncs=2)
            done = {item["role"]: item for item in self._outcomes(peers, 2, _CONNECT_S + 30)}
            assert done["sender"]["ok"], done["sender"]
            assert done["receiver"]["ok"], done["receiver"]
            assert done["receiver"]["syncs"] == [_expected(0), _expected(1)]
        # Both children have exited (a forkserver child ends with os._exit): what they left
        # in /dev/shm, their CUDA driver's files included, stays there.
        self._check_gone(url, shm_before)

    def test_fan_out_to_two_receivers(self) -> None:
        url = self.make_url("fanout")
        if not self.cross_process:
            out = asyncio.run(self._in_process(url, receivers=2, syncs=1))
            assert out == [[_expected(0)], [_expected(0)]]
            return
        with self._peers() as peers:
            for _ in range(2):
                self._spawn(peers, "receiver", url=url)

            async def send() -> None:
                async with self._tx(self.with_receivers(url, 2)) as tx:
                    for _ in range(2):
                        await anyio.to_thread.run_sync(self._reached, peers, "joined")
                    assert (await self._send(tx)).receivers == 2

            asyncio.run(send())
            for item in self._outcomes(peers, 2, 30):
                assert item["ok"], item
                assert item["syncs"] == [_expected(0)]

    def test_receivers_say_how_many_join_and_what_they_are(self) -> None:
        """A sender opened with ``receivers=0`` waits for as many receivers as the first of
        each team says join with it (``group``: two engines' workers, 2 + 1), hears what
        each says of itself (``facts``), syncs to all of them, and refuses by name one that
        says another count than its team's. (A transport whose group is fixed when it
        forms takes one team.)"""
        url = self.with_receivers(self.make_url("introduced"), 0)
        teams = [("a", 2), ("a", 2)] + ([("b", 1)] if self.replaces_receivers else [])
        said = [
            {**self.receiver_options, "group": n, "team": team, "facts": f"worker{i}".encode()}
            for i, (team, n) in enumerate(teams)
        ]
        facts = [f"worker{i}".encode() for i in range(len(said))]
        if not self.cross_process:
            asyncio.run(self._introduced_in_process(url, said, facts))
            return
        with self._peers() as peers:
            for options in said:
                self._spawn(peers, "receiver", url=url, options=options)

            async def send() -> None:
                async with self._tx(url) as tx:
                    for _ in said:
                        await anyio.to_thread.run_sync(self._reached, peers, "joined")
                    await tx.wait_ready(timeout=_CONNECT_S)
                    assert tx.receivers == len(said)
                    assert sorted(tx.introductions().values()) == facts
                    assert (await self._send(tx)).receivers == len(said)
                    if self.replaces_receivers:  # (a fixed group has no place to try)
                        await self._refuses_another_count(url)

            asyncio.run(send())
            for item in self._outcomes(peers, len(said), 30):
                assert item["ok"], item
                assert item["syncs"] == [_expected(0)]

    async def _introduced_in_process(
        self, url: str, said: list[dict[str, Any]], facts: list[bytes]
    ) -> None:
        async with self._tx(url) as tx:
            async with contextlib.AsyncExitStack() as stack:
                for options in said:
                    await stack.enter_async_context(open_receiver(url, **options))
                await tx.wait_ready(timeout=_CONNECT_S)
                assert tx.receivers == len(said)
                assert sorted(tx.introductions().values()) == facts
            await self._refuses_another_count(url)

    async def _refuses_another_count(self, url: str) -> None:
        """A receiver saying 3 join with it, on a sender whose team ``a`` counted 2, is
        refused by name."""
        odd = {**self.receiver_options, "group": 3, "team": "a", "connect_timeout": 5.0}
        try:
            async with open_receiver(url, **odd) as rx:
                await ss.receive(rx, _HashingSink(), timeout=5.0)
        except ss.ConfigError as exc:
            assert "says 3 receivers join with it, but" in str(exc), exc
        else:
            raise AssertionError(f"{url}: a receiver of another count was let in")

    def test_delta_syncs_are_bit_exact(self) -> None:
        """A full sync, then deltas (bits flipped in a few % of every tensor, NaNs and all,
        a patch spanning two buckets): after each the receiver holds exactly the sender's
        tensors, and every delta sends patches and moves fewer bytes than the full sync (the
        suite's tensors are small: most travel whole, where a patch would not be smaller)."""
        url = self.make_url("delta")
        steps = sides.DELTA_STEPS
        args = {"url": url, "syncs": steps, "delta": True}
        if not self.cross_process:
            done = asyncio.run(self._delta_in_process(args))
        else:
            with self._peers() as peers:
                self._spawn(peers, "receiver", **args)
                self._spawn(peers, "sender", **args)
                done = {item["role"]: item for item in self._outcomes(peers, 2, _CONNECT_S + 60)}
        assert done["sender"]["ok"], done["sender"]
        assert done["receiver"]["ok"], done["receiver"]
        assert done["receiver"]["syncs"] == [sides._delta_expected(s) for s in range(steps)]
        reports = [tuple(r) for r in done["sender"]["reports"]]
        first, *deltas = reports
        assert first[0] is None and first[1] is not None, first  # full: no baseline yet
        for base, why, wire, sparse in deltas:
            assert why is None and base is not None, (base, why)
            assert sparse >= 2 and wire < first[2], (sparse, wire, first[2])

    async def _delta_in_process(self, args: dict[str, Any]) -> dict[str, dict[str, Any]]:
        import queue

        results: queue.Queue[Any] = queue.Queue()
        args = {"timeout": self.timeout, "options": {}, **args}
        rx_args = {**args, "options": self.receiver_options}
        tx_args = {**args, "options": self.sender_options}
        out = await sides._both(
            receiver=lambda: sides._receiver_side(rx_args, results),
            sender=lambda: sides._sender_side(tx_args, results),
        )
        return {
            role: {
                "ok": not isinstance(v, BaseException),
                **(v if isinstance(v, dict) else {"error": repr(v)}),
            }
            for role, v in out.items()
        }

    async def _in_process(self, url: str, *, receivers: int, syncs: int) -> list[list[list[str]]]:
        sinks = [_HashingSink() for _ in range(receivers)]
        got: list[list[list[str]]] = [[] for _ in range(receivers)]
        async with self._tx(self.with_receivers(url, receivers)) as tx:

            async def rx(i: int) -> None:
                async with self._rx(url) as r:
                    for _ in range(syncs):
                        await ss.receive(r, sinks[i], timeout=self.timeout)
                        got[i].append(list(sinks[i].digests))

            async def send() -> None:
                for seed in range(syncs):
                    await self._send(tx, seed)

            async with anyio.create_task_group() as tg:
                for i in range(receivers):
                    tg.start_soon(rx, i)
                tg.start_soon(send)
        return got

    # -- flow control, closing, timeouts (one process, one loop) -------------------------
    def test_backpressure_stops_the_sender(self) -> None:
        url = self.make_url("backpressure")

        async def run() -> None:
            builder = BucketBuilder(1024)
            buckets = [b for i in range(40) for b in builder.add(f"t{i}", torch.full((200,), i))]
            async with self._tx(url, **self.two_slots) as tx, self._rx(url) as rx:
                arrivals, arrived = anyio.create_memory_object_stream[int](len(buckets))

                async def hold() -> None:  # receives, never releases
                    while True:
                        incoming = await rx.receive(timeout=30)
                        arrivals.send_nowait(getattr(incoming.message, "seq", -1))

                accepted = 0
                received: list[int] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(hold)
                    try:
                        for seq, bucket in enumerate(buckets):
                            await tx.send(1, seq, bucket, timeout=0.5)
                            accepted += 1
                    except ss.SyncTimeoutError:
                        pass
                    # Every accepted bucket reaches the receiver...
                    with anyio.fail_after(self.timeout):
                        while len(received) < accepted:
                            received.append(await arrived.receive())
                    # ...and nothing else does while the sender is stopped.
                    with anyio.move_on_after(0.2):
                        received.append(await arrived.receive())
                    tg.cancel_scope.cancel()
                assert accepted == self.max_in_flight, (
                    f"{accepted} buckets in flight; a ring of two slots must stop at "
                    f"{self.max_in_flight}"
                )
                assert received == list(range(accepted)), received
                await tx.abort(Abort(1, "test over"))
                arrivals.close()
                arrived.close()

        asyncio.run(run())

    def test_close_by_sender_ends_stream_and_close_by_me_is_closed(self) -> None:
        url = self.make_url("close")

        async def run() -> None:
            tx, rx = self._tx(url), self._rx(url)
            async with tx, rx:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: ss.receive(rx, _HashingSink(), timeout=self.timeout))
                    await self._send(tx)
                await tx.aclose()
                await _raises(
                    ss.EndOfStream,
                    "receive after the sender closed did not end",
                    lambda: rx.receive(timeout=self.timeout),
                    2 * self.timeout,
                )
            await _raises(
                ss.ClosedError,
                "receive on a closed receiver did not raise ClosedError",
                lambda: rx.receive(timeout=1),
                2 * self.timeout,
            )

        asyncio.run(run())

    # -- membership: receivers that leave, come back, or join late --------------------
    async def _present(self, tx: Any, count: int) -> None:
        """Wait until ``count`` receivers are counted in on ``tx``."""
        with anyio.fail_after(self.timeout):
            while tx.present != count:
                await anyio.sleep(0.01)

    async def _sync(
        self,
        tx: Any,
        receivers: Sequence[Any],
        weights: dict[str, torch.Tensor],
        source: AsyncIterator[tuple[str, torch.Tensor]] | None = None,
    ) -> Any:
        """One sync of ``weights`` (read from ``source`` if given) from ``tx`` to
        ``receivers``; each must hold exactly those bytes."""
        sinks = [_HashingSink() for _ in receivers]
        async with anyio.create_task_group() as tg:
            for rx, sink in zip(receivers, sinks, strict=True):
                tg.start_soon(partial(ss.receive, rx, sink, timeout=self.timeout))
            report = await ss.send(
                source if source is not None else weights,
                tx,
                bucket_bytes=_BUCKET_BYTES,
                timeout=self.timeout,
            )
        expected = [digest(n, t) for n, t in weights.items()]
        for sink in sinks:
            assert sink.digests == expected, "a receiver got other bytes than were sent"
        return report

    def _needs_membership(self) -> None:
        if not self.replaces_receivers:
            import pytest

            pytest.skip(f"{type(self).__name__}: its receivers are fixed once the group forms")

    def test_a_receiver_that_left_is_replaced(self) -> None:
        self._needs_membership()
        url = self.make_url("leave")

        async def run() -> None:
            async with self._tx(url) as tx:
                async with self._rx(url) as rx:
                    await self._sync(tx, [rx], conformance_weights(0))
                # Once the sender has heard it leave, the next sync waits for a receiver,
                # and says who left when none comes...
                await self._present(tx, 0)
                await _raises(
                    ss.SyncTimeoutError,
                    "a sync with its only receiver gone did not time out",
                    lambda: ss.send({"w": torch.ones(1)}, tx, timeout=0.3),
                    2 * self.timeout,
                )
                # ...and a new one on the same channel gets the next sync, whole.
                async with self._rx(url) as rx:
                    await self._present(tx, 1)
                    report = await self._sync(tx, [rx], conformance_weights(1))
                    assert report.receivers == 1 and report.complete, report

        asyncio.run(run())

    def test_a_late_joiner_takes_part_from_the_next_sync(self) -> None:
        self._needs_membership()
        url = self.with_receivers(self.make_url("late"), 2)

        async def run() -> None:
            async with self._tx(url, require_all=False) as tx, self._rx(url) as rx0:
                async with self._rx(url) as rx1:
                    await self._sync(tx, [rx0, rx1], conformance_weights(0))
                await self._present(tx, 1)
                # A bucket per tensor: when the fourth is read, buckets are on their way.
                slabs = {f"slab.{i}": torch.full((_BUCKET_BYTES // 4,), i + 0.5) for i in range(6)}
                late: list[Any] = []
                async with contextlib.AsyncExitStack() as stack:

                    async def joining_midway() -> AsyncIterator[tuple[str, torch.Tensor]]:
                        for i, (name, tensor) in enumerate(slabs.items()):
                            if i == 3:
                                late.append(await stack.enter_async_context(self._rx(url)))
                            yield name, tensor

                    # The channel was whole once: with require_all=False this sync goes on
                    # with the one receiver there, and names the missing one.
                    report = await self._sync(tx, [rx0], slabs, joining_midway())
                    assert report.receivers == 1 and len(report.absent) == 1, report
                    assert late, "the late receiver did not join"
                    # It joined during that sync and took no part in it: the next is its first.
                    await self._present(tx, 2)
                    report = await self._sync(tx, [rx0, late[0]], conformance_weights(2))
                    assert report.receivers == 2 and not report.absent, report

        asyncio.run(run())

    def test_a_killed_receiver_is_replaced_on_the_open_channel(self) -> None:
        if not self.cross_process:
            import pytest

            pytest.skip("an in-process transport has no receiver process to kill")
        self._needs_membership()
        url = self.make_url("replace")

        async def run(peers: Peers) -> None:
            first = self._spawn(peers, "receiver", url=url, syncs=3)
            async with self._tx(url) as tx:
                await anyio.to_thread.run_sync(self._reached, peers, "joined")
                for seed in range(2):
                    assert (await self._send(tx, seed)).receivers == 1
                os.kill(first.pid, signal.SIGKILL)  # waiting for a third sync
                self._spawn(peers, "receiver", url=url, syncs=1)
                # The newcomer takes the dead one's place once its death is noticed (until
                # then the sender answers "busy" and it tries again).
                await anyio.to_thread.run_sync(self._reached, peers, "joined")
                report = await self._send(tx, 2)
                assert report.receivers == 1 and report.complete, report
            done = self._outcomes(peers, 1, 30)[0]
            assert done["ok"] and done["syncs"] == [_expected(2)], done

        with self._peers() as peers:
            asyncio.run(run(peers))

    def test_timeouts_on_a_silent_peer(self) -> None:
        url = self.make_url("silent")
        weights = conformance_weights(0)

        async def run() -> None:
            async with self._tx(url) as tx, self._rx(url) as rx:
                await _raises(
                    ss.SyncTimeoutError,
                    "receive from a silent sender did not time out",
                    lambda: ss.receive(rx, _HashingSink(), timeout=0.3),
                    5,
                )
                # The receiver never reads: no acks, no report.
                await _raises(
                    ss.SyncTimeoutError,
                    "send to a silent receiver did not time out",
                    lambda: ss.send(weights, tx, bucket_bytes=1024, timeout=0.3),
                    5,
                )
            lonely = self.make_url("lonely")
            await _raises(
                ss.SyncTimeoutError,
                "send with no receiver did not time out",
                lambda: ss.send({"w": torch.ones(1)}, lonely, timeout=0.3, **self.sender_options),
                5,
            )

        asyncio.run(run())

    def test_a_second_sender_on_a_channel_in_use_is_refused(self) -> None:
        """A second sender on a channel that has one is a ``ConfigError``; the first goes
        on serving, its rendezvous (a socket file) left in place by the refused one."""
        url = self.make_url("second")

        async def run() -> None:
            async with self._tx(url) as tx:
                caught = await _caught(self._tx(url).__aenter__())
                assert isinstance(caught, ss.ConfigError), repr(caught)
                left = [p for p in self.resource_paths(url) if not os.path.exists(p)]
                assert not left, f"the refused sender removed {left}"
                async with self._rx(url) as rx:
                    sink = _HashingSink()
                    with anyio.fail_after(self.timeout):
                        done = await _both(
                            tx=lambda: self._send(tx),
                            rx=lambda: ss.receive(rx, sink, timeout=self.timeout),
                        )
                    assert not isinstance(done["tx"], BaseException), repr(done["tx"])
                    assert sink.digests == _expected(0)

        asyncio.run(run())

    def test_timeouts_follow_one_rule(self) -> None:
        """``connect_timeout`` bounds the wait for the peer to be there, whether a keyword
        or in the URL (the two disagreeing is a ``ConfigError``); without it a one-shot
        ``send``/``receive`` waits its ``timeout``. Each bound is read from the error's
        message; the guard only stops a wait far longer than any bound given here."""
        weights = {"w": torch.ones(1)}
        tx_opts, rx_opts = self.sender_options, self.receiver_options

        async def gives_up_after(seconds: float, call: Callable[[], Any]) -> None:
            with anyio.fail_after(10):
                caught = await _caught(call())
            assert isinstance(caught, ss.SyncTimeoutError), repr(caught)
            assert f"within {seconds:g} s" in str(caught), str(caught)

        async def run() -> None:
            url = self.make_url("nobody")
            at = f"{url}{'&' if '?' in url else '?'}connect_timeout=0.2"
            sink = _HashingSink()
            await gives_up_after(0.3, lambda: ss.receive(url, sink, timeout=0.3, **rx_opts))
            await gives_up_after(0.2, lambda: ss.receive(at, sink, timeout=60, **rx_opts))
            await gives_up_after(
                0.2, lambda: ss.receive(url, sink, timeout=60, connect_timeout=0.2, **rx_opts)
            )
            await gives_up_after(0.3, lambda: ss.send(weights, url, timeout=0.3, **tx_opts))
            await gives_up_after(0.2, lambda: ss.send(weights, at, timeout=60, **tx_opts))
            await gives_up_after(
                0.2, lambda: ss.send(weights, url, timeout=60, connect_timeout=0.2, **tx_opts)
            )

            async def made(opener: Callable[..., Any], **options: Any) -> None:
                opener(at, connect_timeout=5, **options)  # checks its options when made

            for call in (
                lambda: ss.send(weights, at, connect_timeout=5, **tx_opts),
                lambda: ss.receive(at, sink, connect_timeout=5, **rx_opts),
                lambda: made(open_sender, **tx_opts),
                lambda: made(open_receiver, **rx_opts),
            ):
                caught = await _caught(call())
                assert isinstance(caught, ss.ConfigError), repr(caught)
                assert "connect_timeout=5 disagrees with the URL's" in str(caught), caught

        asyncio.run(run())

    def test_a_sync_that_fails_before_its_first_bucket_ends_for_the_receivers_there(
        self,
    ) -> None:
        # The receivers already there wait for the sync's first message. When the sync
        # fails before it (another receiver never came; the source raised at once), the
        # sender's abort ends their wait with its reason, long before their own timeout,
        # and their sinks are not touched.
        async def broken() -> AsyncIterator[tuple[str, torch.Tensor]]:
            raise RuntimeError("the source broke")
            yield  # pragma: no cover - makes this an async generator

        cases = [
            (2, lambda tx: ss.send({"w": torch.ones(1)}, tx, timeout=0.3), ss.SyncTimeoutError,
             "1 of 2 receivers joined"),
            (1, lambda tx: ss.send(broken(), tx, timeout=self.timeout), RuntimeError,
             "the source broke"),
        ]  # fmt: skip

        async def run(receivers: int, send: Callable[[Any], Any], raised: type, why: str) -> None:
            url = self.with_receivers(self.make_url("unbegun"), receivers)
            sink = _HashingSink()
            async with self._tx(url) as tx, self._rx(url) as rx:
                await self._present(tx, 1)
                with anyio.fail_after(self.timeout):
                    out = await _both(
                        tx=lambda: send(tx), rx=lambda: ss.receive(rx, sink, timeout=60)
                    )
            assert isinstance(out["tx"], raised) and why in str(out["tx"]), out
            assert isinstance(out["rx"], ss.SenderAbortedError) and why in str(out["rx"]), out
            report = out["rx"].report
            assert report is not None and report.loaded == () and sink.prepared == 0, out

        for case in cases:
            asyncio.run(run(*case))

    def test_resources_released_after_close(self) -> None:
        url = self.make_url("resources")
        shm_before = _shm_entries()

        async def run() -> None:
            async with self._tx(url) as tx, self._rx(url) as rx, anyio.create_task_group() as tg:
                tg.start_soon(lambda: ss.receive(rx, _HashingSink(), timeout=self.timeout))
                await self._send(tx)

        asyncio.run(run())  # warms up imports and lazily created globals
        fds_before = _open_fds()
        asyncio.run(run())
        gc.collect()
        assert _open_fds() <= fds_before, f"{url}: {_open_fds() - fds_before} descriptors leaked"
        self._check_gone(url, shm_before)

    # -- SIGKILL mid-sync --------------------------------------------------------------
    def _survives_sigkill(
        self,
        tag: str,
        victim: str,
        survivor: Callable[..., Coroutine[Any, Any, BaseException | None]],
        **args: Any,
    ) -> None:
        """Spawn the ``victim`` side, run ``survivor(url, peers, kill)`` here, and check that
        what it caught is the peer's death, within twice the timeout, leaving nothing behind."""
        if not self.cross_process:
            import pytest  # here: children preload this module, and they do not need pytest

            pytest.skip(f"an in-process transport has no {victim} process to kill")
        url = self.make_url(tag)
        shm_before = _shm_entries()
        peers = self._peers()
        proc = self._spawn(peers, victim, url=url, **args)
        killed: list[float] = []

        def kill() -> None:
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(time.monotonic())

        with peers:
            exc = asyncio.run(survivor(url, peers, kill))
        assert killed, "the child was not killed"
        wanted = ss.PeerBrokenError if self.detects_peer_death else ss.StreamsyncError
        assert isinstance(exc, wanted), f"expected {wanted.__name__}, got {exc!r}"
        took = time.monotonic() - killed[0]
        assert took < 2 * self.timeout, f"the peer's death took {took:.1f} s to surface"
        # A killed sender cannot remove a rendezvous file (its next bind reuses the path):
        # the test removes what it left.
        self._check_gone(url, shm_before, paths=victim != "sender")
        if victim == "sender":
            for path in self.resource_paths(url):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def test_sigkill_of_the_receiver_mid_sync(self) -> None:
        async def send(url: str, peers: Peers, kill: Callable[[], None]) -> BaseException | None:
            async def kill_when_loading() -> None:
                await anyio.to_thread.run_sync(self._reached, peers, "loading")
                kill()

            async with self._tx(url) as tx:
                await anyio.to_thread.run_sync(self._reached, peers, "joined")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill_when_loading)
                    # Bucket 0 loads for 30 s: the sender waits for a slot when it dies.
                    caught = await _caught(self._send(tx, bucket_bytes=1024))
            return caught

        self._survives_sigkill("killrx", "receiver", send, delay=30.0)

    def test_sigkill_of_the_sender_mid_sync(self) -> None:
        async def receive(url: str, peers: Peers, kill: Callable[[], None]) -> BaseException | None:
            async with self._rx(url, connect_timeout=_CONNECT_S) as rx:
                sink = _HashingSink(on_first_load=kill)
                return await _caught(ss.receive(rx, sink, timeout=self.timeout))

        self._survives_sigkill("killtx", "sender", receive, delay=0.5, bucket_bytes=1024)
