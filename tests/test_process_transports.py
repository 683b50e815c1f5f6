"""What the conformance suite does not cover: authentication, addresses and options,
owner-only resources, lazy imports, and the CPU-testable parts of ``cuda-ipc://``."""

from __future__ import annotations

import itertools
import os
import random
import socket
import stat
import subprocess
import sys
from datetime import timedelta
from typing import Any

import anyio
import pytest
import torch
from conftest import run_both

import streamsync as ss
from streamsync.testing import peers
from streamsync.testing.conformance import TransportConformance
from streamsync.testing.peers import free_port
from streamsync.transports import open_receiver, open_sender
from streamsync.transports.cuda_ipc import (
    local_device,
    remove_leftovers,
    remove_own_event_files,
    wait_ended,
)
from streamsync.transports.zeromq import zmq_address

# Real channels that wait out refusals and timeouts, a second or two each: in make test,
# not in the edit loop (make test-fast).
pytestmark = pytest.mark.slow

_ids = itertools.count()
URLS = ["shm://{tag}", "zmq+ipc://{tag}", "zmq+tcp://127.0.0.1:0", "torch+gloo://127.0.0.1:0"]


def _url(form: str) -> str:
    return form.format(tag=f"unit-{os.getpid()}-{next(_ids)}")


class Keep:
    def __init__(self) -> None:
        self.items: dict[str, torch.Tensor] = {}

    def prepare(self) -> None:
        pass

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.items.update((n, t.clone()) for n, t in tensors)

    def finalize(self) -> None:
        pass


async def _pair(url: str, tx_kw: dict[str, object], rx_kw: dict[str, object]) -> dict[str, object]:
    """Open a sender, then a receiver, then sync once; each side's result or exception."""
    async with open_sender(url, connect_timeout=2, **tx_kw) as tx:
        url = getattr(tx, "url", url)  # a tcp port 0 is resolved on open

        async def rx() -> object:
            async with open_receiver(url, connect_timeout=2, **rx_kw) as r:
                return await ss.receive(r, Keep(), timeout=2)

        return await run_both(rx=rx, tx=lambda: ss.send({"w": torch.arange(10.0)}, tx, timeout=2))


@pytest.mark.parametrize("form", URLS)
async def test_shared_secret_round_trip(form: str) -> None:
    out = await _pair(_url(form), {"secret": b"s3cret"}, {"secret": b"s3cret"})
    assert isinstance(out["tx"], ss.SyncReport) and out["tx"].receivers == 1, out


@pytest.mark.parametrize("scheme", ["zmq+tcp", "torch+gloo"])
async def test_a_sender_bound_on_every_interface_tells_an_address_receivers_reach(
    scheme: str,
) -> None:
    """Bound on 0.0.0.0, the sender tells its receivers (in its URL, which a channel hands
    the engine's workers) this machine's address on its default route, not 0.0.0.0, which
    on another machine would be that machine itself; a receiver given it syncs."""
    from streamsync.transports.places import told_host

    async with open_sender(f"{scheme}://0.0.0.0:0", connect_timeout=2) as tx:
        host = tx.url.removeprefix(f"{scheme}://").rpartition(":")[0]
        assert host == told_host("0.0.0.0") not in ("0.0.0.0", ""), tx.url

        async def rx() -> object:
            async with open_receiver(tx.url, connect_timeout=2) as r:
                return await ss.receive(r, Keep(), timeout=2)

        out = await run_both(rx=rx, tx=lambda: ss.send({"w": torch.arange(10.0)}, tx, timeout=2))
    assert isinstance(out["tx"], ss.SyncReport) and out["tx"].receivers == 1, out


@pytest.mark.parametrize("form", URLS)
async def test_wrong_secret_fails_on_both_sides(form: str) -> None:
    with anyio.fail_after(10):
        out = await _pair(_url(form), {"secret": b"right"}, {"secret": b"wrong"})
    assert isinstance(out["rx"], ss.AuthenticationError), out
    # The sender is not broken by a stranger: it waits for a receiver of its own, and its
    # timeout says who was refused.
    assert isinstance(out["tx"], ss.SyncTimeoutError), out
    assert "0 of 1 receivers" in str(out["tx"]), out
    assert "refused" in str(out["tx"]) and "AuthenticationError" in str(out["tx"]), out


@pytest.mark.parametrize("form", URLS)
async def test_missing_secret_is_refused(form: str) -> None:
    with anyio.fail_after(10):
        out = await _pair(_url(form), {"secret": b"right"}, {})
    assert isinstance(out["rx"], ss.AuthenticationError), out
    assert "refused" in str(out["rx"])
    assert isinstance(out["tx"], ss.SyncTimeoutError), out
    assert "AuthenticationError" in str(out["tx"]), out


async def test_receiver_with_a_secret_refuses_an_unauthenticated_sender() -> None:
    with anyio.fail_after(10):
        out = await _pair(_url(URLS[0]), {}, {"secret": b"mine"})
    assert isinstance(out["rx"], ss.AuthenticationError), out
    assert isinstance(out["tx"], ss.PeerBrokenError | ss.SyncTimeoutError), out


async def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMSYNC_SECRET", "from-env")
    out = await _pair(_url(URLS[0]), {}, {"secret": b"other"})
    assert isinstance(out["rx"], ss.AuthenticationError), out
    out = await _pair(_url(URLS[0]), {}, {})
    assert isinstance(out["tx"], ss.SyncReport), out


@pytest.mark.parametrize(
    "form",
    [
        "shm://{tag}",
        "zmq+ipc://{tag}",
        "zmq+tcp://127.0.0.1:{port}",
        "torch+gloo://127.0.0.1:{port}",
    ],
)
async def test_a_receiver_too_many_is_refused(form: str) -> None:
    # It is told "busy" and tries again until its connect timeout: a place may free up.
    url = _url(form.replace("{port}", str(free_port())))
    async with open_sender(url, connect_timeout=2), open_receiver(url, connect_timeout=2):
        with pytest.raises(ss.ConfigError, match="receivers=N"):
            async with open_receiver(url, connect_timeout=2):
                pass


async def test_second_sender_on_a_name_is_refused() -> None:
    url = _url(URLS[0])
    async with open_sender(url):
        with pytest.raises(ss.ConfigError, match="already has a sender"):
            async with open_sender(url):
                pass


async def test_receiver_times_out_without_a_sender() -> None:
    with anyio.fail_after(5), pytest.raises(ss.SyncTimeoutError, match="no sender answered"):
        async with open_receiver(_url(URLS[0]), connect_timeout=0.3):
            pass


async def test_ipc_socket_file_is_private_then_removed() -> None:
    url = _url("zmq+ipc://{tag}")
    path = zmq_address("zmq+ipc", url.split("://")[1], bind=True).removeprefix("ipc://")
    async with open_sender(url, connect_timeout=2) as tx:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, oct(mode)
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        async with open_receiver(url, connect_timeout=2):
            await tx.wait_ready(timeout=2)
            # Kept while the sender is open: a receiver that restarts rejoins through it.
            assert os.path.exists(path)
    assert not os.path.exists(path)


def _memfds() -> dict[str, str]:
    """This process's open descriptors that are anonymous memory files: fd -> name."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if link.startswith("/memfd:"):
            found[fd] = link
    return found


async def test_shm_segment_is_anonymous_and_owner_only() -> None:
    url = _url(URLS[0])
    before, memfds = set(os.listdir("/dev/shm")), _memfds()
    async with open_sender(url, slot_bytes=4096):
        assert set(os.listdir("/dev/shm")) == before  # nothing with a name anyone could open
        segments = {fd: name for fd, name in _memfds().items() if fd not in memfds}
        assert segments, "the sender holds no anonymous memory file"
        for fd in segments:
            mode = stat.S_IMODE(os.stat(f"/proc/self/fd/{fd}").st_mode)
            assert mode == 0o600, (segments[fd], oct(mode))


def test_zmq_addresses() -> None:
    assert zmq_address("zmq+tcp", ":5555", bind=True) == "tcp://127.0.0.1:5555"
    assert zmq_address("zmq+tcp", "*:5555", bind=True) == "tcp://*:5555"
    assert zmq_address("zmq+ipc", "@abc", bind=True) == "ipc://@abc"
    assert zmq_address("zmq+ipc", "/run/x.sock", bind=False) == "ipc:///run/x.sock"
    with pytest.raises(ss.ConfigError, match="not '\\*'"):
        zmq_address("zmq+tcp", "*:5555", bind=False)
    with pytest.raises(ss.ConfigError, match="HOST:PORT"):
        zmq_address("zmq+tcp", "localhost", bind=True)
    with pytest.raises(ss.ConfigError, match="bare name"):
        zmq_address("zmq+ipc", "a/b", bind=True)


def test_bad_options_name_what_is_valid() -> None:
    with pytest.raises(ss.ConfigError, match="receivers=-1"):  # (0: as the receivers say)
        open_sender("shm://x?receivers=-1")
    with pytest.raises(ss.ConfigError, match="without '/'"):
        open_sender("shm://a/b")
    with pytest.raises(ss.ConfigError, match="secret is empty"):
        open_sender("shm://x", secret=b"")


def test_import_streamsync_stays_light() -> None:
    code = (
        "import sys, streamsync, streamsync.transports as t; t.schemes(); "
        "print(sorted(m for m in ('zmq', 'streamsync.transports.shm', "
        "'streamsync.transports.zeromq', 'streamsync.transports.cuda_ipc', "
        "'streamsync.transports.torch_dist', 'streamsync.transports.torch_group') "
        "if m in sys.modules)); "
        "import torch.distributed as d; print(d.is_available() and d.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "False"]  # no process group anywhere
    assert {"shm", "zmq+tcp", "zmq+ipc", "cuda-ipc", "torch+gloo", "torch+nccl"} <= set(
        ss.transports.schemes()
    )


# -- cuda-ipc ------------------------------------------------------------------------
def test_cuda_device_is_found_by_uuid_whatever_the_visible_order() -> None:
    assert local_device("GPU-b", ["GPU-a", "GPU-b"], fallback=0) == 1
    assert local_device("", ["GPU-a"], fallback=3) == 3
    with pytest.raises(ss.ConfigError, match="CUDA_VISIBLE_DEVICES"):
        local_device("GPU-z", ["GPU-a"], fallback=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
async def test_cuda_ipc_without_cuda_says_what_to_use() -> None:
    with pytest.raises(ss.ConfigError, match="use shm://"):
        async with open_sender(_url("cuda-ipc://{tag}")):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.slow
class TestCudaIpc(TransportConformance):
    def make_url(self, tag: str) -> str:
        return _url("cuda-ipc://" + tag + "-{tag}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_ipc_into_a_host_module_three_times() -> None:
    # From the second sync the layout is recognised: ModuleSink's memmove plan must not read
    # the GPU slot from the host (torch copies instead). The third is a delta whose patch is
    # read from a host copy of the slot.
    module = torch.nn.Linear(64, 32)
    sent = {n: torch.randn_like(t) for n, t in module.state_dict().items()}
    url = _url("cuda-ipc://{tag}")
    async with (
        open_sender(url, connect_timeout=5) as tx,
        open_receiver(url, connect_timeout=5) as rx,
    ):
        for step in range(3):
            if step == 2:
                sent["weight"][0, :3] += 1  # a patch of three elements
            out = await run_both(
                rx=lambda: ss.receive(rx, ss.ModuleSink(module), timeout=30),
                tx=lambda: ss.send(sent, tx, timeout=30, delta=True),
            )
            assert isinstance(out["tx"], ss.SyncReport), out
            for name, tensor in module.state_dict().items():
                assert torch.equal(tensor, sent[name]), (step, name)
        assert out["tx"].delta is not None and out["tx"].delta.sparse == 1, out


def test_leftovers_of_an_ended_sender_are_removed_and_a_live_ones_kept(tmp_path: Any) -> None:
    # A SIGKILLed cuda-ipc sender leaves torch's reference count and the driver's event file
    # in /dev/shm; the receiver removes them once that process has ended, and only then.
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    live = os.getpid()
    names = {
        ended.pid: [f"torch_{ended.pid}_123_0", f"cuda.shm.0.{ended.pid:x}.1"],
        live: [f"torch_{live}_456_0", f"cuda.shm.0.{live:x}.1"],
    }
    for files in names.values():
        for name in files:
            (tmp_path / name).write_bytes(b"x")
    (tmp_path / "unrelated").write_bytes(b"x")
    kept = {p.name for p in tmp_path.iterdir()} - set(names[ended.pid])
    removed = remove_leftovers(ended.pid, f"/torch_{ended.pid}_123_0".encode(), str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(names[ended.pid])
    assert remove_leftovers(live, f"/torch_{live}_456_0".encode(), str(tmp_path)) == []
    # Another pid's count is never taken for this one's.
    assert remove_leftovers(ended.pid, f"/torch_{live}_456_0".encode(), str(tmp_path)) == []
    assert {p.name for p in tmp_path.iterdir()} == kept


def test_an_exiting_process_removes_its_own_driver_event_files_only(tmp_path: Any) -> None:
    # The CUDA driver never removes a process's interprocess-event file, even at a normal
    # exit; an exiting cuda-ipc peer removes its own (the count is torch's to remove).
    me, other = os.getpid(), os.getppid()
    for name in (f"cuda.shm.0.{me:x}.1", f"cuda.shm.0.{other:x}.1", f"torch_{me}_1_0"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_own_event_files(str(tmp_path))
    assert [os.path.basename(p) for p in removed] == [f"cuda.shm.0.{me:x}.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"cuda.shm.0.{other:x}.1", f"torch_{me}_1_0"]
    )


def test_free_ports_are_outside_the_range_outgoing_connections_take() -> None:
    # Any process's next outgoing connection may take a port bind(0) just returned; the
    # tests' ports come from below that range, and are free when handed out.
    low, high = peers._ephemeral_range()
    rng = random.Random(7)
    for _ in range(50):
        port = free_port(rng=rng)
        assert peers.LOWEST_PORT <= port < low, (port, low, high)
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port(rng=random.Random(11))))
    with taken:
        # The same draw finds that port taken and moves on.
        assert free_port(rng=random.Random(11)) != taken.getsockname()[1]


# -- torch+gloo / torch+nccl ------------------------------------------------------------
async def test_torch_gloo_receiver_that_never_joins_times_out_everyone() -> None:
    # Two receivers expected, one comes and waits: the sender's join timeout ends the sync.
    # The receiver that came would wait far longer on its own (so it cannot give up first
    # and turn "1 of 2 joined" into "0 of 2, one left"); the sender's abort ends its wait
    # at once, with the sender's reason, and nobody waits on the group.
    url = f"torch+gloo://127.0.0.1:{free_port()}?receivers=2"
    async with open_sender(url, connect_timeout=1) as tx:

        async def rx() -> object:
            async with open_receiver(tx.url, connect_timeout=5) as r:  # type: ignore[attr-defined]
                return await ss.receive(r, Keep(), timeout=30)

        with anyio.fail_after(2 * 1 + 1):
            out = await run_both(rx=rx, tx=lambda: ss.send({"w": torch.ones(8)}, tx, timeout=1))
    assert isinstance(out["tx"], ss.SyncTimeoutError), out
    assert "1 of 2 receivers joined within 1 s" in str(out["tx"]), out
    assert "left" not in str(out["tx"]), out
    assert isinstance(out["rx"], ss.SenderAbortedError), out
    assert "1 of 2 receivers joined" in str(out["rx"]), out
    assert out["rx"].report.loaded == () and out["rx"].report.buckets == 0, out


async def test_torch_gloo_store_opens_whatever_the_sync_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sender's store connects its own client to the server it starts. Under load that
    # took longer than a 0.3 s sync timeout, and the send failed with torch's
    # DistNetworkError instead of timing out waiting for its receivers.
    import torch._C._distributed_c10d as c10d

    real = c10d.TCPStore
    opened: list[tuple[timedelta, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        store = real(*args, **kwargs)
        if kwargs.get("is_master"):
            opened.append((kwargs["timeout"], store))
        return store

    monkeypatch.setattr(c10d, "TCPStore", recording)
    with pytest.raises(ss.SyncTimeoutError):
        await ss.send({"w": torch.ones(1)}, "torch+gloo://127.0.0.1:0", timeout=0.3)
    ((opened_with, store),) = opened
    assert opened_with >= timedelta(seconds=30)
    assert store.timeout == timedelta(seconds=0.3)  # then it waits as long as the sync


async def test_torch_gloo_store_that_cannot_open_is_a_named_error_and_leaks_no_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch._C._distributed_c10d as c10d

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise torch.distributed.DistNetworkError("the client socket has timed out")

    monkeypatch.setattr(c10d, "TCPStore", failing)
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(ss.PeerBrokenError, match="could not open its rendezvous store"):
        await ss.send({"w": torch.ones(1)}, "torch+gloo://127.0.0.1:0", timeout=0.3)
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_torch_bad_urls_name_what_is_valid() -> None:
    with pytest.raises(ss.ConfigError, match="HOST:PORT"):
        open_sender("torch+gloo://localhost")
    with pytest.raises(ss.ConfigError, match="not '\\*'"):
        open_receiver("torch+gloo://*:5555")
    with pytest.raises(ss.ConfigError, match="gloo sends from host memory"):
        open_sender("torch+gloo://127.0.0.1:0", device="cuda")


async def test_torch_gloo_taken_port_is_refused() -> None:
    async with open_sender("torch+gloo://127.0.0.1:0") as tx:
        with pytest.raises(ss.ConfigError, match="another sender"):
            async with open_sender(tx.url):  # type: ignore[attr-defined]
                pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_torch_nccl_without_cuda_says_what_to_use() -> None:
    with pytest.raises(ss.ConfigError, match="use torch\\+gloo://"):
        open_sender(f"torch+nccl://127.0.0.1:{free_port()}")
    with pytest.raises(ss.ConfigError, match="use torch\\+gloo://"):
        open_receiver(f"torch+nccl://127.0.0.1:{free_port()}")


def _nccl_devices() -> int:
    import torch.distributed as dist

    return torch.cuda.device_count() if dist.is_nccl_available() else 0


@pytest.mark.skipif(
    _nccl_devices() < 2,
    reason="torch+nccl needs a torch with NCCL and one GPU per rank (two or more GPUs; "
    "NCCL refuses two ranks on one device, so the in-process conformance tests cannot run it)",
)
@pytest.mark.slow
def test_torch_nccl_gpu_check() -> None:
    args = [
        sys.executable,
        os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_torch_nccl.py"),
        "--gib",
        "0.25",
        "--repeat",
        "1",
        "--bucket-mib",
        "32",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and '"bit_exact": true' in out.stdout, out.stdout + out.stderr


async def test_torch_gloo_receiver_times_out_without_a_sender() -> None:
    url = f"torch+gloo://127.0.0.1:{free_port()}"
    with anyio.fail_after(5), pytest.raises(ss.SyncTimeoutError, match="no sender answered"):
        async with open_receiver(url, connect_timeout=0.5):
            pass


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hexport = local.rpartition(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.add(address)
    return found


async def test_torch_gloo_store_listens_on_host_only() -> None:
    async with open_sender("torch+gloo://127.0.0.1:0") as tx:
        port = int(tx.url.rpartition(":")[2])  # type: ignore[attr-defined]
        assert _listening(port) == {"0100007F"}  # 127.0.0.1, not every interface


class _Events:
    """A stand-in for a dialer's monitor socket: the events it will read, in order."""

    def __init__(self) -> None:
        self.queue: list[list[bytes]] = []

    def add(self, event: int, fd: int) -> None:
        import struct

        self.queue.append([struct.pack("=hi", event, fd), b"tcp://127.0.0.1:1"])

    def try_recv(self) -> list[bytes] | None:
        return self.queue.pop(0) if self.queue else None


def _dialer() -> tuple[Any, _Events]:
    from streamsync.transports.zeromq import ZmqDialer

    dialer = ZmqDialer("zmq+tcp", "127.0.0.1:1", heartbeat=1.0)
    events = _Events()
    dialer._monitor = events  # type: ignore[assignment]
    return dialer, events


async def test_a_zmq_receiver_ignores_the_drop_of_a_connection_before_its_session() -> None:
    """A receiver's DEALER reached a sender that was closing (connected, dropped), then
    reconnected by itself to the next sender on the address, whose Welcome it got: that
    earlier drop is not the session's (one-shot loops failed on it under load, 'the sender
    went away without closing the channel'). The session's own drop still ends the link,
    and so does a Welcome whose connection then dropped."""
    import zmq

    up, down = zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED
    for first, second in [(5, 6), (5, 5)]:  # a new descriptor, or the same one reused
        dialer, events = _dialer()
        for event, fd in [(up, first), (down, first), (up, second)]:
            events.add(event, fd)
        dialer._watch()  # seen while waiting for the Welcome
        dialer._welcomed()
        assert dialer._dropped_at is None and dialer._session == second
        events.add(down, 99)  # some other descriptor's: not this channel's
        dialer._watch()
        assert dialer._dropped_at is None
        events.add(down, second)
        dialer._watch()
        assert dialer._dropped_at is not None
    dialer, events = _dialer()
    events.add(up, 7)
    events.add(down, 7)  # the connection the Welcome came over dropped after it
    dialer._welcomed()
    assert dialer._dropped_at is not None


@pytest.mark.parametrize("scheme", ["zmq+tcp", "zmq+ipc"])
async def test_neither_zmq_side_sends_zeromq_heartbeats(scheme: str) -> None:
    """libzmq 4.3.5 aborts a process whose pinging socket loses its pipe while the peer
    hangs up (``zeromq._open``); a one-shot loop's receiver, which pinged, died of it under
    load. Neither side pings; over tcp the kernel's keepalive finds a vanished machine."""
    import zmq

    url = f"{scheme}://127.0.0.1:0" if scheme == "zmq+tcp" else f"{scheme}://pings-{os.getpid()}"
    async with open_sender(url, heartbeat=2.4) as tx, open_receiver(tx.url, heartbeat=2.4) as rx:
        sockets = [tx.link._sock.sock, rx.link._sock.sock]  # type: ignore[attr-defined]
        for sock in sockets:
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == 2
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_INTVL) == 2
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_CNT) == 3


def test_waiting_for_a_sender_to_end_returns_when_it_has() -> None:
    # Not reaped here: a zombie has ended, as a SIGKILLed sender has before its parent waits.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        assert wait_ended(child.pid, 30.0)
    finally:
        child.wait()
    assert not wait_ended(os.getpid(), 0.05)
