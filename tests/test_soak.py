"""The soak: 200 consecutive syncs of a small model between two processes, per transport.

Both sides' resident memory must stay flat after a warm-up (the least-squares slope, in
bytes per sync, is printed: run ``pytest -s tests/test_soak.py`` to see it), and nothing may
accumulate: open file descriptors on either side, ``/dev/shm`` entries, socket files.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import fault_peers
import psutil
import pytest
import torch

import streamsync as ss
from streamsync.testing import fake_state_dict
from streamsync.testing.peers import context, free_port
from streamsync.transports import open_sender

SYNCS = 200
WARMUP = 50
BUCKET_BYTES = 64 << 10
#: Largest RSS slope accepted after warm-up, per side. A leak of one bucket per sync would
#: be 64 KiB/sync; what a healthy run shows is a few hundred bytes either way.
MAX_SLOPE = 4 << 10


def slope(ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against their index."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def _url(transport: str) -> str:
    if transport == "zmq+tcp":
        return f"zmq+tcp://127.0.0.1:{free_port()}"
    return f"{transport}://soak-{os.getpid()}"


def _files() -> set[str]:
    """Entries in the places a transport could leave something behind."""
    runtime = os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"streamsync-{os.getuid()}"
    )
    found: set[str] = set()
    for where in ("/dev/shm", runtime):
        if os.path.isdir(where):
            found |= {
                os.path.join(where, n) for n in os.listdir(where) if not n.startswith("sem.mp-")
            }
    return found


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "zmq+tcp", "zmq+ipc"])
def test_soak(transport: str, record_property: Any) -> None:
    url = _url(transport)
    files_before = _files()
    ctx = context("fault_peers")
    reports, report_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=fault_peers.soak_receiver, args=(url, SYNCS, {}, report_end))
    proc.start()
    report_end.close()
    me, peer = psutil.Process(), psutil.Process(proc.pid)
    samples: list[tuple[int, int, int, int]] = []  # rss and fds, this side then the peer

    async def run() -> None:
        weights = fake_state_dict(fault_peers.SOAK_CONFIG, dtype=torch.bfloat16)
        async with open_sender(url, slot_bytes=BUCKET_BYTES, connect_timeout=60) as tx:
            for step in range(SYNCS):
                for tensor in weights.values():
                    tensor.add_(1)  # a training step, in place
                report = await ss.send(weights, tx, bucket_bytes=BUCKET_BYTES, timeout=30)
                assert report.complete and report.buckets > len(weights) // 4, report
                samples.append(
                    (me.memory_info().rss, me.num_fds(), peer.memory_info().rss, peer.num_fds())
                )
                del report, step

    try:
        asyncio.run(run())
        assert reports.poll(60), "the receiver did not finish"
        final = reports.recv()
        assert final == {"done": SYNCS}, final
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        reports.close()

    steady = samples[WARMUP:]
    slopes = {side: slope([s[i] for s in steady]) for side, i in (("sender", 0), ("receiver", 2))}
    growth = {side: steady[-1][i] - steady[0][i] for side, i in (("sender", 0), ("receiver", 2))}
    line = ", ".join(
        f"{side} {slopes[side]:+.0f} B/sync ({growth[side] / 1024:+.0f} KiB over "
        f"{len(steady)} syncs)"
        for side in slopes
    )
    print(f"\nsoak {transport}: RSS slope after {WARMUP} warm-up syncs: {line}")
    for side, value in slopes.items():
        record_property(f"rss_slope_{side}_bytes_per_sync", round(value))
        assert value < MAX_SLOPE, f"{transport}: {side} RSS grows {value:.0f} B/sync"
    for side, i in (("sender", 1), ("receiver", 3)):
        fds = [s[i] for s in steady]
        assert max(fds) <= fds[0], f"{transport}: {side} fds grew: {fds[0]} -> {max(fds)}"
    left = _files() - files_before
    assert not left, f"{transport}: left behind {sorted(left)}"
