"""The fault matrix: every fault, over every process transport, between two processes.

For each fault the sync ends in a specific exception on both sides within twice the sync
timeout; the receiver's exception carries a partial report (``complete`` false, ``loaded``
exactly the names its sink applied, and the model holds exactly those new values); and a
following sync succeeds, on the same channel where the fault leaves it usable, else on a
fresh one. The peers are forkserver children (``fault_peers.py``) run by script; this
process kills, stops and resumes them.

What the conformance suite and ``test_process_transports.py`` already cover is not repeated:
resources left after a SIGKILL, wrong or missing secrets, refused extra receivers.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import fault_peers
import pytest
from fault_peers import NAMES, SLOT_BYTES, TIMEOUT

import streamsync.wire.frames
from streamsync.testing.peers import context, free_port
from streamsync.transports.zeromq import zmq_address

TRANSPORTS = ["shm", "zmq+tcp", "zmq+ipc", "torch+gloo"]
LIMIT = 2 * TIMEOUT
_ids = itertools.count()


class Matrix:
    """The peers of one case, and what they reported.

    The peers start from :func:`streamsync.testing.peers.context` like every harness child,
    but each reports over its own pipe rather than the one queue of
    :class:`~streamsync.testing.peers.Peers`: this matrix kills and stops peers mid-sync,
    and one caught writing to a shared queue would hold its lock and silence the others.
    """

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.ctx = context("fault_peers")
        self.procs: dict[str, Any] = {}
        self.controls: dict[str, Any] = {}
        self.pipes: list[Any] = []
        self.seen: list[dict[str, Any]] = []
        self.socket_files: list[str] = []  # zmq+ipc: what a killed sender leaves
        # No transport options: a frozen (SIGSTOPped) peer is caught by the timeout on every
        # transport (over zmq its kernel still answers the keepalive probes).
        self.options: dict[str, Any] = {}

    def url(self) -> str:
        tag = f"fault-{os.getpid()}-{next(_ids)}"
        if self.transport in ("zmq+tcp", "torch+gloo"):
            return f"{self.transport}://127.0.0.1:{free_port()}"
        if self.transport == "zmq+ipc":
            self.socket_files.append(zmq_address(self.transport, tag, bind=True)[len("ipc://") :])
        return f"{self.transport}://{tag}"

    def spawn(
        self, tag: str, role: str, *sessions: tuple[str, list[dict[str, Any]]], **args: Any
    ) -> None:
        # A pipe each way per peer: a peer killed mid-write spoils only its own.
        reports, report_end = self.ctx.Pipe(duplex=False)
        control_end, control = self.ctx.Pipe(duplex=False)
        script = {
            "sessions": [{"url": url, "syncs": syncs} for url, syncs in sessions],
            "options": self.options,
            **args,
        }
        proc = self.ctx.Process(
            target=fault_peers.peer_main, args=(tag, role, script, report_end, control_end)
        )
        proc.start()
        report_end.close()
        control_end.close()
        self.procs[tag] = proc
        self.controls[tag] = control
        self.pipes.append(reports)

    def _pull(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for item in self.seen:
                if match(item):
                    self.seen.remove(item)
                    return item
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(self.pipes, max(0.0, left))
            if not ready and left <= 0:
                raise AssertionError(f"no such report within {timeout:g} s; got {self.seen}")
            for pipe in ready:
                assert isinstance(pipe, multiprocessing.connection.Connection)
                try:
                    item = pipe.recv()
                except (EOFError, OSError):  # that peer exited (or was killed)
                    self.pipes.remove(pipe)
                    continue
                if "crash" in item:
                    raise AssertionError(f"peer {item['tag']} crashed: {item['crash']}")
                self.seen.append(item)

    def event(self, tag: str, name: str, timeout: float = 60) -> float:
        """Wait for peer ``tag``'s event; the time it was noticed here."""
        self._pull(lambda i: i.get("tag") == tag and i.get("event") == name, timeout)
        return time.monotonic()

    def outcome(self, tag: str, session: int = 0, sync: int = 0) -> dict[str, Any]:
        """Peer ``tag``'s report of one sync."""
        return self._pull(
            lambda i: (
                i.get("tag") == tag and "ok" in i and (i["session"], i["sync"]) == (session, sync)
            ),
            60,
        )

    def signal(self, tag: str, signum: int) -> float:
        os.kill(self.procs[tag].pid, signum)
        return time.monotonic()

    def go(self, tag: str) -> None:
        self.controls[tag].send("go")

    def close(self, *, kill: bool = False) -> None:
        """Wait for the peers to finish their scripts (``kill``: do not wait)."""
        deadline = time.monotonic() + (0 if kill else 30)
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in [*self.pipes, *self.controls.values()]:
            conn.close()
        # A sender this matrix killed could not remove its socket file: the peers are gone.
        for path in self.socket_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# -- what a fault must produce ---------------------------------------------------------------
def failed(out: dict[str, Any], error: str, *, since: float | None = None) -> dict[str, Any]:
    """``out`` is the sync failing with ``error`` within twice the timeout (of ``since``, or
    of the sync's start)."""
    assert not out["ok"] and out["error"] == error, repr(out)
    took = out["t"] - since if since is not None else out["elapsed"]
    assert took < LIMIT, f"{error} took {took:.2f} s; the limit is {LIMIT:g} s: {out}"
    return out


def partial(out: dict[str, Any], loaded: list[str] | None = None) -> None:
    """The receiver's exception reports exactly what its model now holds, never success."""
    report = out["report"]
    assert report is not None and report["complete"] is False, repr(out)
    assert report["loaded"] == out["applied"], repr(out)
    if loaded is not None:
        assert report["loaded"] == loaded, repr(out)
    assert out["consistent"], f"the model does not hold what the report says: {out}"


def prefix(out: dict[str, Any], at_least: int) -> None:
    """What a receiver applied before the fault: the first buckets, in order."""
    loaded = out["report"]["loaded"]
    assert loaded == NAMES[: len(loaded)] and len(loaded) >= at_least, repr(out)


def succeeded(out: dict[str, Any]) -> None:
    assert out["ok"] and out["report"]["complete"], repr(out)
    if "consistent" in out:  # a receiver: every name applied
        assert out["consistent"] and sorted(out["report"]["loaded"]) == NAMES, repr(out)


def sender_heard(tx: dict[str, Any], rx: dict[str, Any], *, since: float | None = None) -> None:
    """The sender's ReceiverFailedError names the receiver's error and what it applied."""
    failed(tx, "ReceiverFailedError", since=since)
    assert rx["error"] in tx["message"], repr((tx, rx))
    assert tx["report"] is not None and tx["report"]["complete"] is False, repr(tx)
    assert tx["report"]["loaded"] == rx["report"]["loaded"], repr((tx, rx))


# -- faults ------------------------------------------------------------------------------------
def kill_sender(m: Matrix) -> None:
    url, fresh = m.url(), m.url()
    m.spawn("rx", "receiver", (url, [{"loaded_at": 2}]), (fresh, [{"seed": 1}]))
    m.spawn("tx", "sender", (url, [{"stall_at": 4}]))
    m.event("tx", "stalled")  # bucket 3 is half full...
    m.event("rx", "loaded")  # ...and buckets 0-2 are applied
    killed = m.signal("tx", signal.SIGKILL)
    rx = failed(m.outcome("rx"), "PeerBrokenError", since=killed)
    partial(rx, NAMES[:3])
    m.spawn("tx2", "sender", (fresh, [{"seed": 1}]))
    succeeded(m.outcome("rx", 1))
    succeeded(m.outcome("tx2"))


def kill_receiver(m: Matrix) -> None:
    url, fresh = m.url(), m.url()
    m.spawn("rx", "receiver", (url, [{"event_at": 2, "linger": 3600}]))
    m.spawn("tx", "sender", (url, [{}]), (fresh, [{"seed": 1}]))
    m.event("rx", "loading")
    killed = m.signal("rx", signal.SIGKILL)
    tx = failed(m.outcome("tx"), "PeerBrokenError", since=killed)
    assert tx["report"] is None, repr(tx)  # nobody is left to say what the dead receiver applied
    m.spawn("rx2", "receiver", (fresh, [{"seed": 1}]))
    succeeded(m.outcome("rx2"))
    succeeded(m.outcome("tx", 1))


def silent_sender(m: Matrix) -> None:
    url = m.url()
    m.spawn("rx", "receiver", (url, [{"event_at": 2, "hold": True}, {"seed": 1}]))
    m.spawn("tx", "sender", (url, [{}, {"seed": 1}]))
    m.event("rx", "loading")
    stopped = m.signal("tx", signal.SIGSTOP)
    m.go("rx")  # the receiver held bucket 2 (and its slot) until the sender was stopped
    rx = failed(m.outcome("rx"), "SyncTimeoutError", since=stopped)
    partial(rx)
    prefix(rx, 3)
    resumed = m.signal("tx", signal.SIGCONT)
    sender_heard(m.outcome("tx"), rx, since=resumed)
    succeeded(m.outcome("rx", 0, 1))
    succeeded(m.outcome("tx", 0, 1))


def silent_receiver(m: Matrix) -> None:
    url = m.url()
    m.spawn("rx", "receiver", (url, [{"event_at": 2, "hold": True}, {"seed": 1}]))
    m.spawn("tx", "sender", (url, [{}, {"seed": 1, "wait_go": True}]))
    m.event("rx", "loading")
    stopped = m.signal("rx", signal.SIGSTOP)
    m.go("rx")  # read once it is resumed: it held bucket 2 until it was stopped
    tx = failed(m.outcome("tx"), "SyncTimeoutError", since=stopped)
    assert "free slot" in tx["message"], repr(tx)
    resumed = m.signal("rx", signal.SIGCONT)
    rx = failed(m.outcome("rx"), "SenderAbortedError", since=resumed)
    assert "SyncTimeoutError" in rx["message"], repr(rx)
    partial(rx)
    prefix(rx, 3)
    m.go("tx")
    succeeded(m.outcome("rx", 0, 1))
    succeeded(m.outcome("tx", 0, 1))


def silent_sender_breaks_the_group(m: Matrix) -> None:
    """torch+gloo: a sender frozen in the middle of a broadcast for longer than the timeout
    finds it timed out when it resumes, which leaves the process group unusable: the
    receiver's sync fails as with every transport, the sender's with a named error, and the
    next sync runs on a fresh channel. (Frozen between broadcasts, the channel survives,
    as in ``silent_sender``; which one happens is a race, so the next sync uses a fresh
    channel either way.)"""
    url, fresh = m.url(), m.url()
    m.spawn("rx", "receiver", (url, [{"event_at": 2, "hold": True}]), (fresh, [{"seed": 1}]))
    m.spawn("tx", "sender", (url, [{}]), (fresh, [{"seed": 1}]))
    m.event("rx", "loading")
    stopped = m.signal("tx", signal.SIGSTOP)
    m.go("rx")  # the receiver held bucket 2 (and its slot) until the sender was stopped
    rx = failed(m.outcome("rx"), "SyncTimeoutError", since=stopped)
    partial(rx)
    prefix(rx, 3)
    resumed = m.signal("tx", signal.SIGCONT)
    tx = m.outcome("tx")
    assert tx["error"] in ("ReceiverFailedError", "SyncTimeoutError", "PeerBrokenError"), repr(tx)
    failed(tx, tx["error"], since=resumed)
    succeeded(m.outcome("rx", 1))
    succeeded(m.outcome("tx", 1))


def silent_receiver_breaks_the_group(m: Matrix) -> None:
    """torch+gloo: a stopped receiver stalls the broadcast itself (the sender's bytes wait for
    it), and a broadcast that timed out leaves the process group unusable: the sync fails as
    with every transport, and the next one runs on a fresh channel."""
    url, fresh = m.url(), m.url()
    m.spawn("rx", "receiver", (url, [{"event_at": 2, "hold": True}]), (fresh, [{"seed": 1}]))
    m.spawn("tx", "sender", (url, [{}]), (fresh, [{"seed": 1}]))
    m.event("rx", "loading")
    stopped = m.signal("rx", signal.SIGSTOP)
    m.go("rx")  # read once it is resumed: it held bucket 2 until it was stopped
    failed(m.outcome("tx"), "SyncTimeoutError", since=stopped)
    resumed = m.signal("rx", signal.SIGCONT)
    rx = m.outcome("rx")
    assert rx["error"] in ("SenderAbortedError", "PeerBrokenError"), repr(rx)
    failed(rx, rx["error"], since=resumed)
    partial(rx)
    prefix(rx, 3)
    succeeded(m.outcome("rx", 1))
    succeeded(m.outcome("tx", 1))


def bad_bucket(
    rx_error: str,
    sender: dict[str, Any],
    *,
    fresh_channel: bool = False,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[Matrix], None]:
    """A fault in bucket 3 that the receiver detects: ``w0``..``w2`` stay applied."""

    def run(m: Matrix) -> None:
        url = m.url()
        if fresh_channel:  # the fault ends the channel: both sides open another
            fresh = m.url()
            m.spawn("rx", "receiver", (url, [{}]), (fresh, [{"seed": 1}]))
            m.spawn("tx", "sender", (url, [sender]), (fresh, [{"seed": 1}]))
            then = (1, 0)
        else:
            m.spawn("rx", "receiver", (url, [{}, {"seed": 1}]))
            m.spawn("tx", "sender", (url, [sender, {"seed": 1}]))
            then = (0, 1)
        rx = failed(m.outcome("rx"), rx_error)
        partial(rx, NAMES[:3])
        sender_heard(m.outcome("tx"), rx)
        if check is not None:
            check(rx)
        succeeded(m.outcome("rx", *then))
        succeeded(m.outcome("tx", *then))

    return run


def allocated_at_most_a_slot(rx: dict[str, Any]) -> None:
    assert rx["largest_allocation"] <= SLOT_BYTES, repr(rx)


def second_sync_while_one_runs(m: Matrix) -> None:
    url = m.url()
    m.spawn("rx", "receiver", (url, [{"concurrent": True, "slow": 0.05}, {"seed": 1}]))
    m.spawn("tx", "sender", (url, [{"concurrent": True}, {"seed": 1}]))
    for tag in ("rx", "tx"):
        out = m.outcome(tag)
        succeeded(out)  # the running sync is not disturbed...
        second = out["second"]  # ...and the second one is refused at once
        failed(second, "SyncInProgressError")
        assert second["elapsed"] < 0.5, repr(second)
    succeeded(m.outcome("rx", 0, 1))
    succeeded(m.outcome("tx", 0, 1))


def stale_sync(m: Matrix) -> None:
    url = m.url()
    m.spawn("rx", "receiver", (url, [{}, {"seed": 1}, {"seed": 2}]))
    m.spawn("tx", "sender", (url, [{}, {"seed": 1, "sync_id": 1}, {"seed": 2}]))
    succeeded(m.outcome("rx"))
    succeeded(m.outcome("tx"))
    rx = failed(m.outcome("rx", 0, 1), "StaleSyncError")
    partial(rx, [])  # refused before anything was applied
    sender_heard(m.outcome("tx", 0, 1), rx)
    succeeded(m.outcome("rx", 0, 2))
    succeeded(m.outcome("tx", 0, 2))


OTHER_VERSION = streamsync.wire.frames.PROTOCOL_VERSION + 1


def receiver_speaks_another_version(m: Matrix) -> None:
    url = m.url()
    m.spawn("tx", "sender", (url, [{}, {"seed": 1}]))
    m.spawn("rx", "receiver", (url, [{}]), version=OTHER_VERSION)
    rx = failed(m.outcome("rx"), "ProtocolVersionError")
    assert rx["stage"] == "open" and rx["report"] is None, repr(rx)  # no sync started
    # The sender is not disturbed: it serves a receiver that speaks its version, and the
    # sync's report names the refused one.
    m.spawn("rx2", "receiver", (url, [{}, {"seed": 1}]))
    succeeded(m.outcome("rx2"))
    tx = m.outcome("tx")
    succeeded(tx)
    assert any(f"version {OTHER_VERSION}" in r for r in tx["report"]["refused"]), repr(tx)
    succeeded(m.outcome("rx2", 0, 1))
    succeeded(m.outcome("tx", 0, 1))


def sender_speaks_another_version(m: Matrix) -> None:
    url, fresh = m.url(), m.url()
    m.spawn("tx", "sender", (url, [{}]), version=OTHER_VERSION)
    m.spawn("rx", "receiver", (url, [{}]), (fresh, [{"seed": 1}]))
    rx = failed(m.outcome("rx"), "ProtocolVersionError")
    assert rx["stage"] == "open" and rx["report"] is None, repr(rx)
    m.signal("tx", signal.SIGKILL)  # it would wait for a receiver of its version
    m.spawn("tx2", "sender", (fresh, [{"seed": 1}]))
    succeeded(m.outcome("rx", 1))
    succeeded(m.outcome("tx2"))


def restarted_receiver(m: Matrix) -> None:
    """A receiver SIGKILLed between syncs and started again: the sender's channel stays
    open and the new process gets the next sync, whole."""
    url = m.url()
    m.spawn("rx", "receiver", (url, [{}, {"seed": 1}, {"seed": 2}]))
    m.spawn("tx", "sender", (url, [{}, {"seed": 1}, {"seed": 2, "wait_go": True}]))
    succeeded(m.outcome("rx", 0, 1))
    succeeded(m.outcome("tx", 0, 1))
    m.signal("rx", signal.SIGKILL)  # waiting for its third sync
    m.spawn("rx2", "receiver", (url, [{"seed": 2}]))
    m.event("rx2", "joined")
    m.go("tx")
    succeeded(m.outcome("rx2"))
    succeeded(m.outcome("tx", 0, 2))


def late_receiver(m: Matrix) -> None:
    """A second receiver arrives while a two-receiver sender waits: the sync starts when it
    is there, and both get it whole."""
    url = m.url() + "?receivers=2"
    m.spawn("tx", "sender", (url, [{}]))
    m.spawn("rx", "receiver", (url, [{}]))
    m.event("rx", "joined")
    m.spawn("rx2", "receiver", (url, [{}]))
    succeeded(m.outcome("rx"))
    succeeded(m.outcome("rx2"))
    tx = m.outcome("tx")
    succeeded(tx)
    assert tx["report"]["receivers"] == 2, repr(tx)


FAULTS: dict[str, Callable[[Matrix], None]] = {
    "sender-sigkill-mid-bucket": kill_sender,
    "receiver-sigkill-mid-bucket": kill_receiver,
    "silent-sender": silent_sender,
    "silent-receiver": silent_receiver,
    "checksum-mismatch": bad_bucket("ChecksumError", {"checksum": True, "tamper": ("flip", 3)}),
    "truncated-frame": bad_bucket(
        "WireFormatError", {"tamper": ("truncate-frame", 3)}, fresh_channel=True
    ),
    "truncated-payload": bad_bucket(
        "WireFormatError", {"tamper": ("truncate-payload", 3)}, fresh_channel=True
    ),
    "absurd-length": bad_bucket(
        "WireFormatError", {"tamper": ("absurd-length", 3)}, fresh_channel=True
    ),
    "absurd-shape": bad_bucket("WireFormatError", {"tamper": ("absurd-shape", 3)}),
    "absurd-dtype": bad_bucket("WireFormatError", {"tamper": ("absurd-dtype", 3)}),
    "absurd-chunked-size": bad_bucket(
        "WireFormatError", {"tamper": ("absurd-chunked", 3)}, check=allocated_at_most_a_slot
    ),
    "unknown-name": bad_bucket("UnknownTensorError", {"bad": "unknown"}),
    "shape-mismatch": bad_bucket("ShapeMismatchError", {"bad": "shape"}),
    "dtype-mismatch": bad_bucket("DtypeMismatchError", {"bad": "dtype"}),
    "duplicate-name": bad_bucket("DuplicateTensorError", {"bad": "duplicate"}),
    "second-sync-while-one-runs": second_sync_while_one_runs,
    "stale-sync-id": stale_sync,
    "receiver-speaks-another-version": receiver_speaks_another_version,
    "sender-speaks-another-version": sender_speaks_another_version,
    "restarted-receiver": restarted_receiver,
    "late-receiver": late_receiver,
}
# What a fault does where a transport's nature makes it differ (said in each function).
_VARIANTS: dict[tuple[str, str], Callable[[Matrix], None]] = {
    ("torch+gloo", "silent-sender"): silent_sender_breaks_the_group,
    ("torch+gloo", "silent-receiver"): silent_receiver_breaks_the_group,
}
# shm has no payload frame: its bytes are in the shared slot; torch+gloo broadcasts them.
_NOT_APPLICABLE = {
    ("shm", "truncated-payload"),
    ("torch+gloo", "truncated-payload"),
    # A process group has a fixed size: a restarted receiver needs a new channel.
    ("torch+gloo", "restarted-receiver"),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("transport", "fault"),
    [
        pytest.param(t, f, id=f"{t}-{f}")
        for f in FAULTS
        for t in TRANSPORTS
        if (t, f) not in _NOT_APPLICABLE
    ],
)
def test_fault(transport: str, fault: str) -> None:
    m = Matrix(transport)
    passed = False
    try:
        _VARIANTS.get((transport, fault), FAULTS[fault])(m)
        passed = True
    finally:
        m.close(kill=not passed)


# -- several receivers: one killed while buckets are broadcast ------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["torch+gloo", "zmq+tcp"])
def test_receiver_killed_mid_broadcast_fails_every_survivor(transport: str) -> None:
    """Two receivers in their own processes, 4 MiB buckets: one is killed once buckets flow;
    the sender raises PeerBrokenError and the other receiver's sync ends in a named error,
    each within twice the timeout."""
    import anyio
    import torch

    import streamsync as ss

    m = Matrix(transport)
    url = f"{transport}://127.0.0.1:{free_port()}?receivers=2&slot_bytes={4 << 20}"
    for tag in ("rx0", "rx1"):
        reports, report_end = m.ctx.Pipe(duplex=False)
        proc = m.ctx.Process(target=fault_peers.fan_out_receiver, args=(tag, url, 1, report_end))
        proc.start()
        report_end.close()
        m.procs[tag] = proc
        m.pipes.append(reports)
    weights = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(16)}  # 16 x 4 MiB
    killed: list[float] = []

    async def send() -> tuple[BaseException | None, float]:
        async with ss.transports.open_sender(url, connect_timeout=60) as tx:
            await anyio.to_thread.run_sync(lambda: [m.event(t, "joined") for t in ("rx0", "rx1")])

            async def kill() -> None:
                await anyio.to_thread.run_sync(m.event, "rx0", "loading")
                killed.append(m.signal("rx0", signal.SIGKILL))

            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                try:
                    await ss.send(weights, tx, bucket_bytes=4 << 20, timeout=TIMEOUT)
                except ss.StreamsyncError as exc:
                    return exc, time.monotonic()
                finally:
                    tg.cancel_scope.cancel()
        return None, time.monotonic()

    passed = False
    try:
        caught, at = anyio.run(send)
        assert killed, "the receiver was not killed"
        assert isinstance(caught, ss.PeerBrokenError), repr(caught)
        assert at - killed[0] < LIMIT, f"the sender took {at - killed[0]:.2f} s"
        survivor = m._pull(lambda i: i.get("tag") == "rx1" and "ok" in i, 60)
        # The sender's abort or its closing the channel, read at once; or, over torch+gloo,
        # a survivor still inside the broadcast (gloo's root serves ranks in turn, and its
        # abort does not wake them): the group breaks when the root's broadcast times out,
        # or the survivor's own receive times out first. Either within the limit.
        wanted = {"SenderAbortedError", "PeerBrokenError", "EndOfStream"}
        if transport == "torch+gloo":
            wanted.add("SyncTimeoutError")
        assert survivor["error"] in wanted, repr(survivor)
        assert survivor["t"] - killed[0] < LIMIT, repr(survivor)
        passed = True
    finally:
        m.close(kill=not passed)
