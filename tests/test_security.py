"""Security properties not covered elsewhere: no pickle anywhere in the package, tcp binds
loopback unless told otherwise, and an unauthenticated peer cannot make the sender allocate
from a size it merely claims.

Covered in ``test_process_transports.py``: the shared secret (a wrong or missing one is
refused on both sides), owner-only resources (the ``shm`` segment is an anonymous 0600
memfd, an ``ipc`` socket file is 0600 in a 0700 directory and removed once every receiver
joined). Covered in ``test_fuzz_wire.py``: the decoder and unpacker under hostile bytes.
"""

from __future__ import annotations

import ast
import pathlib

import anyio
import psutil
import pytest
import torch
from conftest import run_both

import streamsync as ss
from streamsync.transports import open_receiver, open_sender

PACKAGE = pathlib.Path(ss.__file__).parent
# Modules that turn bytes into arbitrary objects (or code): none may be imported.
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}


def _unsafe_uses(path: pathlib.Path) -> list[str]:
    """Imports of unsafe modules, and calls that (un)pickle under another name:
    ``torch.load``/``torch.save``, pyzmq's ``send_pyobj``/``recv_pyobj``, ``allow_pickle=``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if _unsafe(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and _unsafe(node.module):
            found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            if name in {"send_pyobj", "recv_pyobj"} or (
                name in {"load", "save"} and isinstance(owner, ast.Name) and owner.id == "torch"
            ):
                found.append(f"{where} {ast.unparse(node.func)}(...)")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            found.append(f"{where} allow_pickle=")
    return found


def _unsafe(module: str) -> bool:
    return module.split(".")[0] in UNSAFE_MODULES


def test_no_pickle_anywhere_in_the_package() -> None:
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20 and any(p.name == "frames.py" for p in sources)
    found = [use for path in sources for use in _unsafe_uses(path)]
    assert not found, "pickle-like (de)serialisation in streamsync:\n" + "\n".join(found)


def test_the_check_sees_what_it_looks_for(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom dill import loads\nimport torch\ntorch.load('x')\n"
        "sock.recv_pyobj()\nnp.load('x', allow_pickle=True)\n"
    )
    assert len(_unsafe_uses(bad)) == 5


async def test_tcp_binds_loopback_unless_told_otherwise() -> None:
    def listening() -> set[tuple[str, int]]:
        return {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }

    before = listening()
    async with open_sender("zmq+tcp://:0", connect_timeout=2) as tx:
        new = listening() - before
        port = int(tx.url.rpartition(":")[2])  # type: ignore[attr-defined]
        assert new == {("127.0.0.1", port)}, new


async def test_an_oversized_message_is_dropped_before_it_is_read() -> None:
    # Anyone who can reach the port may connect: a message claiming 64 MiB and one byte is
    # refused by ZeroMQ from its size alone, so it never reaches the handshake (where it
    # would be refused too, but only after being received whole and answered). What a
    # stranger sees: its connection is closed by the sender, with no answer.
    import zmq
    import zmq.asyncio
    from zmq.utils.monitor import recv_monitor_message

    async with open_sender("zmq+tcp://127.0.0.1:0", connect_timeout=5) as tx:
        url = tx.url  # type: ignore[attr-defined]
        ctx = zmq.asyncio.Context()
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.RECONNECT_IVL, -1)  # dropped once, it stays dropped
        monitor = stranger.get_monitor_socket()

        async def wait_for(event: int, what: str) -> None:
            with anyio.move_on_after(10):
                while int((await recv_monitor_message(monitor))["event"]) != event:
                    pass
                return
            raise AssertionError(f"the stranger's connection was not {what} within 10 s")

        try:
            stranger.connect(url.replace("zmq+tcp://", "tcp://"))
            # Connected and past ZeroMQ's own greeting: what follows is about the message.
            await wait_for(zmq.EVENT_HANDSHAKE_SUCCEEDED, "established")
            oversized = bytes((64 << 20) + 1)
            await stranger.send(oversized, copy=False)
            await wait_for(zmq.EVENT_DISCONNECTED, "closed by the sender")
            # Dropped unread: a message received whole would have been answered (refused).
            assert not await stranger.poll(0), "the sender read the oversized message"
        finally:
            stranger.disable_monitor()
            monitor.close()
            stranger.close()
            ctx.term()

        async def rx() -> ss.SyncReport:
            async with open_receiver(url, connect_timeout=5) as r:
                return await ss.receive(r, _Keep(), timeout=5)

        out = await run_both(rx=rx, tx=lambda: ss.send({"w": torch.ones(4)}, tx, timeout=5))
    assert isinstance(out["tx"], ss.SyncReport) and out["tx"].complete, out
    assert isinstance(out["rx"], ss.SyncReport) and out["rx"].complete, out


class _Keep:
    def prepare(self) -> None:
        pass

    def load(self, tensors: object) -> None:
        pass

    def finalize(self) -> None:
        pass


@pytest.mark.slow  # a fresh interpreter: make test, not the edit loop
def test_the_worker_side_loads_no_trainer_side_and_import_does_no_work() -> None:
    import subprocess
    import sys

    code = (
        "import sys, threading, streamsync, streamsync.engine.worker\n"
        "assert 'streamsync.engine.channel' not in sys.modules, 'worker loaded the trainer'\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "import streamsync._copies as c\n"
        "assert c._omp_set_num_threads.cache_info().currsize == 0, 'OpenMP looked up'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
