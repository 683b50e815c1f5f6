"""The README's first form in a loop, across processes: a trainer that calls
``asyncio.run(send(weights, url))`` and an engine that calls
``asyncio.run(receive(url, sink))`` once per step, 200 steps, every step verified.

Each step opens and closes its own channel on both sides, so a receiver regularly reaches
the previous step's sender while it closes: the sender answers "busy" (or drops the link),
and the receiver tries again within its connect timeout until the next step's sender is
there. Nothing here waits for the other side to be ready: that race is the thing tested.
"""

from __future__ import annotations

import os

import loop_peers
import pytest

from streamsync.testing.peers import Peers, free_port

STEPS = 200


def _url(transport: str) -> str:
    if transport == "zmq+tcp":
        return f"zmq+tcp://127.0.0.1:{free_port()}"
    return f"{transport}://loop-{os.getpid()}"


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "zmq+ipc", "zmq+tcp"])
def test_one_shot_send_and_receive_in_a_loop(transport: str) -> None:
    url = _url(transport)
    with Peers("loop_peers") as peers:
        peers.spawn(loop_peers.engine, url, STEPS)
        peers.spawn(loop_peers.trainer, url, STEPS)
        outcomes = {}
        for _ in range(2):
            # Every step is bounded (loop_peers.TIMEOUT); a healthy step takes milliseconds.
            item = peers.get(lambda i: "ok" in i, STEPS * 2.0, "an outcome")
            outcomes[item["role"]] = item
            assert item["ok"], item
    assert outcomes["engine"]["steps"] == STEPS and outcomes["trainer"]["steps"] == STEPS
