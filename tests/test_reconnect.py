"""A receiver whose sender is not there yet (none bound, or the one there turned it away)
tries again after short pauses, paced by ``link.Tries``: it is in within one short pause
of the sender being there, however long it waited. The pauses it records say so; nothing
here is timed (a one-shot loop used to spend 130-280 ms a step in growing pauses)."""

from __future__ import annotations

import itertools
import os
from typing import Any

import anyio
import pytest

from streamsync.testing.peers import free_port
from streamsync.transports import open_receiver, open_sender
from streamsync.transports.link import RETRY_MAX_S

_ids = itertools.count()


def _url(scheme: str) -> str:
    if scheme == "zmq+tcp":
        return f"zmq+tcp://127.0.0.1:{free_port()}"
    return f"{scheme}://reconnect-{os.getpid()}-{next(_ids)}"


async def _until(check: Any) -> None:
    with anyio.fail_after(20):
        while not check():
            await anyio.sleep(0.005)


@pytest.mark.parametrize("scheme", ["shm", "zmq+ipc", "zmq+tcp"])
async def test_a_receiver_turned_away_is_in_one_short_pause_after_a_place_frees(
    scheme: str,
) -> None:
    url = _url(scheme)
    async with open_sender(url, connect_timeout=20) as tx, open_receiver(url) as first:
        await tx.wait_ready(timeout=20)
        second = open_receiver(url, connect_timeout=20)
        async with anyio.create_task_group() as tg:
            tg.start_soon(second.__aenter__)
            await _until(lambda: second.tries.failed >= 8)  # type: ignore[attr-defined]
            await first.aclose()  # its place frees: the next try gets in
        try:
            tries = second.tries  # type: ignore[attr-defined]
            assert tries.longest <= RETRY_MAX_S, tries
        finally:
            await second.aclose()


async def test_a_receiver_waiting_for_its_sender_is_in_one_short_pause_after_it_binds() -> None:
    url = _url("shm")
    receiver = open_receiver(url, connect_timeout=20)
    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver.__aenter__)
        await _until(lambda: receiver.tries.failed >= 20)  # type: ignore[attr-defined]
        async with open_sender(url, connect_timeout=20) as tx:
            await tx.wait_ready(timeout=20)
    try:
        tries = receiver.tries  # type: ignore[attr-defined]
        assert tries.longest <= RETRY_MAX_S, tries
    finally:
        await receiver.aclose()
