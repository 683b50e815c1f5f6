"""The soak: 600 consecutive syncs of a small model between two processes, per transport.

Both sides' resident memory must stay flat after a warm-up (the least-squares slope, in
bytes per sync, is printed: run ``pytest -s tests/test_soak.py`` to see it), and nothing may
accumulate: open file descriptors on either side, ``/dev/shm`` entries, socket files.

Resident memory here is what a leak can grow: anonymous pages (the heap) and shared-memory
pages (segments). Pages of mapped files (torch's libraries) are left out: the kernel drops
and reloads them at will when other processes need memory, which moved a receiver's RSS by
170 MB in one run on a busy machine.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from streamsync.testing.peers import context, free_port, held_elsewhere
from streamsync.transports import open_sender

SYNCS = 600
WARMUP = 100
BUCKET_BYTES = 64 << 10
#: Largest RSS slope accepted after warm-up, per side: the README's promise. A leak of one
#: bucket per sync would be 64 KiB/sync. RSS moves in 4 KiB pages, so the slope needs many
#: syncs to resolve a few hundred bytes: over 150 syncs after 50 of warm-up it read 0-490
#: B/sync on zmq; over 500 after 100 it reads under 170.
MAX_SLOPE = 300


def resident(pid: int) -> int:
    """Bytes of anonymous and shared-memory pages process ``pid`` has resident."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return sum(int(fields[key].split()[0]) << 10 for key in ("RssAnon", "RssShmem"))


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
    """Entries in the places a transport could leave something behind: ``/dev/shm``, and
    this soak's own socket files in the per-user runtime directory (other channels' files
    there, such as a second suite's, are theirs)."""
    runtime = os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"streamsync-{os.getuid()}"
    )
    found: set[str] = set()
    if os.path.isdir("/dev/shm"):
        found |= {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")}
        found = {f for f in found if not os.path.basename(f).startswith("sem.mp-")}
    if os.path.isdir(runtime):
        mine = f"soak-{os.getpid()}"
        found |= {os.path.join(runtime, n) for n in os.listdir(runtime) if n.startswith(mine)}
    return found


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "zmq+tcp", "zmq+ipc"])
def test_soak(transport: str, record_property: Any) -> None:
    url = _url(transport)
    files_before = _files()
    ctx = context("fault_peers")
    reports, report_end = ctx.Pipe()
    proc = ctx.Process(target=fault_peers.soak_receiver, args=(url, SYNCS, {}, report_end))
    proc.start()
    report_end.close()
    me, peer = psutil.Process(), psutil.Process(proc.pid)
    samples: list[tuple[int, int, int, int]] = []  # resident and fds, this side then the peer
    # New entries another program held when they appeared (this machine may run vLLM
    # engines or a second test run): theirs, not left behind by this soak.
    seen, foreign = set(files_before), set()

    def classify() -> None:
        new = _files() - seen
        if new:
            seen.update(new)
            foreign.update(held_elsewhere(new, ours=[peer.pid]))

    async def run() -> None:
        weights = fake_state_dict(fault_peers.SOAK_CONFIG, dtype=torch.bfloat16)
        async with open_sender(url, slot_bytes=BUCKET_BYTES, connect_timeout=60) as tx:
            for step in range(SYNCS):
                for tensor in weights.values():
                    tensor.add_(1)  # a training step, in place
                report = await ss.send(weights, tx, bucket_bytes=BUCKET_BYTES, timeout=30)
                assert report.complete and report.buckets > len(weights) // 4, report
                samples.append((resident(me.pid), me.num_fds(), resident(peer.pid), peer.num_fds()))
                classify()
                del report, step

    try:
        asyncio.run(run())
        assert reports.poll(60), "the receiver did not finish"
        final = reports.recv()
        assert final == {"done": SYNCS}, final
    finally:
        with contextlib.suppress(OSError):
            reports.send("exit")  # the receiver waits for this before it exits
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
    print(f"\nsoak {transport}: resident memory slope after {WARMUP} warm-up syncs: {line}")
    for side, value in slopes.items():
        record_property(f"rss_slope_{side}_bytes_per_sync", round(value))
        assert value < MAX_SLOPE, f"{transport}: {side} resident memory grows {value:.0f} B/sync"
    for side, i in (("sender", 1), ("receiver", 3)):
        fds = [s[i] for s in steady]
        assert max(fds) <= fds[0], f"{transport}: {side} fds grew: {fds[0]} -> {max(fds)}"
    classify()
    left = _files() - files_before - foreign
    assert not left, f"{transport}: left behind {sorted(left)}"
