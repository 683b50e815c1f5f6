"""Strangers cannot break a channel: anything that reaches a sender's address without being
one of its receivers is dropped (or, if it looks like a receiver, refused with an answer),
logged, and costs the legitimate receiver nothing.

Per transport, a sender with a persistent channel serves one receiver (a child process)
through several syncs, each verified bit for bit, while rounds of strangers (another child
process: see ``stranger_peers.strangers``) connect before and during them: a port scanner,
4 KiB of random bytes, a huge length claim, malformed frames, a ZeroMQ peer claiming a
routing id already taken (which aborts a heartbeating libzmq 4.3.5 sender: see
``zeromq._open``), and two streamsync receivers the sender must refuse (a wrong secret,
another protocol version). A round "during" a sync
runs while the sync is under way: the sync's source waits for the round to finish between
its first buckets and the rest (an event, not a sleep). Only the refused receivers show in
the sync reports, with their address; a last sync shows the channel still works.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

import anyio
import pytest
import stranger_peers as sp
import torch

import streamsync as ss
from streamsync.testing.peers import Peers, free_port
from streamsync.transports import open_sender

#: The syncs, and those during which a round of strangers runs (one more runs before).
SYNCS = 4
DURING = (0, 2)


def _url(transport: str) -> str:
    if transport == "zmq+tcp":
        return f"zmq+tcp://127.0.0.1:{free_port()}"
    return f"{transport}://strangers-{os.getpid()}"


async def _report(peers: Peers, what: str, **match: object) -> dict[str, object]:
    """The child's report matching ``match`` (bounded); a child's error fails the test."""

    def wanted(item: dict[str, object]) -> bool:
        return "error" in item or all(item.get(k) == v for k, v in match.items())

    item = await anyio.to_thread.run_sync(peers.get, wanted, 3 * sp.TIMEOUT, what)
    assert "error" not in item, item
    return item


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "zmq+ipc", "zmq+tcp"])
async def test_strangers_never_break_a_channel(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="streamsync")
    rounds: list[dict[str, object]] = []

    with Peers("stranger_peers") as peers:

        async def round_of_strangers(tag: str) -> None:
            peers.spawn(sp.strangers, transport, url, tag)
            got = await _report(peers, f"the strangers {tag}", role="strangers", tag=tag)
            # The refused ones were answered, and raised what the sender said.
            assert got["done"] == {
                **{k: "ok" for k in got["done"] if k not in sp.REFUSED},  # type: ignore[attr-defined]
                "wrong secret": "AuthenticationError",
                "other version": "ProtocolVersionError",
            }, got
            rounds.append(got)

        async def source(sync: int) -> AsyncIterator[tuple[str, torch.Tensor]]:
            items = list(sp.weights(sync).items())
            yield items[0]  # several buckets: the sync is under way
            if sync in DURING:
                await round_of_strangers(f"during sync {sync}")
            for item in items[1:]:
                yield item

        # zmq: a fast heartbeat, so that a sender that pinged its connections would meet the
        # libzmq abort the "taken routing id" stranger provokes well within the test.
        options = {"heartbeat": 0.1} if transport.startswith("zmq") else {}
        async with open_sender(
            _url(transport),
            secret=sp.SECRET,
            connect_timeout=sp.TIMEOUT,
            slot_bytes=sp.BUCKET_BYTES,
            **options,
        ) as tx:
            url = tx.url  # type: ignore[attr-defined]
            await round_of_strangers("before the receiver")
            peers.spawn(sp.receiver, url, SYNCS)
            await _report(peers, "the receiver joining", role="receiver", joined=True)
            reports = []
            for sync in range(SYNCS):
                # Never raises because of a stranger: a failed sync fails the test here.
                report = await ss.send(
                    source(sync), tx, bucket_bytes=sp.BUCKET_BYTES, timeout=sp.TIMEOUT
                )
                assert report.complete and report.receivers == 1, report
                got = await _report(peers, f"sync {sync} received", role="receiver", sync=sync)
                assert got["verified"], got
                reports.append(report)

    # Only the receivers that were refused with an answer are reported, each sync those
    # refused since the one before (the first: the round before the receiver, and its own).
    expected = [len(sp.REFUSED) * ((s == 0) + (s in DURING)) for s in range(SYNCS)]
    assert [len(r.refused) for r in reports] == expected, [r.refused for r in reports]
    refused = [entry for r in reports for entry in r.refused]
    for entry in refused:
        assert "AuthenticationError" in entry or "ProtocolVersionError" in entry, entry
    # Each names the peer: its process (unix sockets) or the address it came from.
    pids = {str(got["pid"]) for got in rounds}
    for entry in refused:
        if transport == "shm":
            assert entry.startswith("pid ") and entry.split(":")[0][4:] in pids, (entry, pids)
        elif transport == "zmq+ipc":  # ZeroMQ's ipc Peer-Address: localhost:UID:GID:PID
            assert entry.startswith("a receiver at localhost:"), entry
            assert entry.split(":")[3] in pids, (entry, pids)
        else:
            assert entry.startswith("a receiver at 127.0.0.1:"), entry
    # Logged: the refused as warnings (with the address), the others as strangers.
    events = [r.getMessage() for r in caplog.records if r.name == "streamsync"]
    assert sum("event='channel.refused'" in e for e in events) == len(refused), events
    assert sum("event='channel.stranger'" in e for e in events) >= len(rounds), events
