"""The multi-process peer harness shared by the conformance suite, the benchmark and the
fault tests: how children start, how they report, a free TCP port, and which files
another program holds (a shared machine's ``/dev/shm`` is not only the tests').

A child is a fresh interpreter started by a *forkserver* that has torch and streamsync
preloaded (so each one starts in a fraction of a second), running a plain function that
puts plain dicts on a queue: tensors and exceptions never cross, only their names,
messages and digests.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import random
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

#: The lowest port :func:`free_port` picks (above the well-known and registered-service
#: ports most machines run something on).
LOWEST_PORT = 20000


def _ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and to ``bind(port 0)``."""
    with contextlib.suppress(OSError, ValueError), open(path) as fh:
        low, high = (int(x) for x in fh.read().split()[:2])
        return low, high
    return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", *, rng: random.Random | None = None) -> int:
    """A TCP port on ``host`` that nothing is bound to right now, for a peer that binds it
    a moment later in another process.

    Picked at random *below* the kernel's ephemeral range: a port from ``bind(port 0)`` is
    one the kernel may hand to any process's next outgoing connection before the peer binds
    it (a test once failed that way with "Address already in use"); one outside that range
    only an explicit bind can take. Falls back to ``bind(port 0)`` if the range leaves no
    room or nothing there is free."""
    rng = rng or random.SystemRandom()
    low = _ephemeral_range()[0]
    if low - LOWEST_PORT >= 1000:
        for _ in range(64):
            port = rng.randrange(LOWEST_PORT, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def held_elsewhere(paths: Iterable[str], *, ours: Iterable[int] = ()) -> set[str]:
    """Those of ``paths`` that a live process other than this one and ``ours`` holds: open,
    mapped, or bound as a unix socket. What a test finds new in ``/dev/shm`` or a runtime
    directory on a shared machine may be another program's (a vLLM engine's segments, a
    second test run's sockets); what no one else holds is the test's own. Processes this
    user may not inspect count as holding nothing."""
    wanted = set(paths)
    if not wanted:
        return set()
    skip = {os.getpid(), *ours}
    held: set[str] = set()
    mine: set[str] = set()  # this process's socket inodes: a socket it still binds is its own
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if int(pid) in skip:
                        if link.startswith("socket:["):
                            mine.add(link[8:-1])
                    elif link in wanted:
                        held.add(link)
            if int(pid) not in skip:
                with open(f"/proc/{pid}/maps") as maps:
                    for line in maps:
                        fields = line.rstrip("\n").split(maxsplit=5)
                        if len(fields) == 6 and fields[5] in wanted:
                            held.add(fields[5])
    with contextlib.suppress(OSError), open("/proc/net/unix") as unix:
        next(unix, None)  # the header
        for line in unix:
            fields = line.split()
            if len(fields) >= 8 and fields[7] in wanted and fields[6] not in mine:
                held.add(fields[7])
    return held


def context(*preload: str, start_method: str = "forkserver") -> Any:
    """A multiprocessing context whose children are fresh interpreters; with the forkserver
    (the default), torch, streamsync and the modules in ``preload`` are imported once."""
    if start_method == "forkserver":
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "streamsync", *filter(None, preload)])
        return ctx
    return multiprocessing.get_context(start_method)


class Peers:
    """Child processes that report plain dicts on one queue; closing joins or kills them.

    ``spawn(target, *args)`` starts ``target(*args, results)``; ``get(match, timeout)``
    returns the first reported dict ``match`` accepts (others are kept for later calls) and
    raises ``AssertionError`` on timeout, naming what it waited for.
    """

    def __init__(self, *preload: str, start_method: str = "forkserver") -> None:
        self.ctx = context(*preload, start_method=start_method)
        self.results = self.ctx.Queue()
        self.procs: list[Any] = []
        self._seen: list[dict[str, Any]] = []

    def spawn(self, target: Callable[..., None], *args: Any, daemon: bool = True) -> Any:
        proc = self.ctx.Process(target=target, args=(*args, self.results), daemon=daemon)
        proc.start()
        self.procs.append(proc)
        return proc

    def get(
        self, match: Callable[[dict[str, Any]], bool], timeout: float, what: str = "a report"
    ) -> dict[str, Any]:
        for i, item in enumerate(self._seen):
            if match(item):
                return self._seen.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {what} within {timeout:g} s; got {self._seen}")
            try:
                reported: dict[str, Any] = self.results.get(timeout=remaining)
            except queue.Empty:
                continue
            if match(reported):
                return reported
            self._seen.append(reported)

    def collect(self, count: int, timeout: float) -> list[dict[str, Any]]:
        """The next ``count`` reports in arrival order (fewer if the time runs out)."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            if self._seen:
                got.append(self._seen.pop(0))
                continue
            try:
                got.append(self.results.get(timeout=max(0.05, deadline - time.monotonic())))
            except queue.Empty:
                break
        return got

    def close(self, *, grace: float = 30.0, kill: bool = False) -> None:
        """Join every child (``grace`` seconds each), killing those still alive."""
        for proc in self.procs:
            if kill and proc.is_alive():
                proc.kill()
            proc.join(grace if not kill else 5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs = []

    def __enter__(self) -> Peers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)
