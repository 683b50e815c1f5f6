"""A channel's private ``torch.distributed`` process group, as the ``torch+gloo://`` and
``torch+nccl://`` transports (:mod:`streamsync.transports.torch_dist`) use it.

The group is built from a ``TCPStore`` under a per-channel key prefix, with the backend
class itself (``ProcessGroupGloo`` / ``ProcessGroupNCCL``): never ``init_process_group``,
so it coexists with a trainer's or an engine's own groups (vLLM's
``StatelessProcessGroup`` is the pattern). Every broadcast has a timeout; a broadcast that
fails or times out leaves the member broken, and the caller gets a named error. Every
call blocks: transports run them in a worker thread. ``torch.distributed`` is imported
only when a group is formed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from typing import Any

import msgspec
import torch

from streamsync.errors import PeerBrokenError, StreamsyncError, SyncTimeoutError


class GroupPlan(msgspec.Struct, frozen=True, array_like=True):
    """What a joining receiver needs to join the channel's process group (in its
    ``Welcome``): the backend, the group's key prefix in the store and its size."""

    backend: str
    prefix: str
    world_size: int


def as_timedelta(seconds: float) -> timedelta:
    """``seconds`` as torch's timeouts take them (at least a millisecond)."""
    return timedelta(seconds=max(seconds, 0.001))


class ProcessGroupMember:
    """One side's seat in a channel's private process group: the store, its rank, and the
    group itself once formed. Every method blocks: callers run them in a worker thread."""

    def __init__(self, url: str, backend: str, *, device: torch.device | None = None) -> None:
        self.url = url
        self.backend = backend
        self.device = device or torch.device("cpu")
        self.store: Any = None
        self.local_host = ""
        self.rank = -1
        self.plan: GroupPlan | None = None
        self._group: Any = None
        self._broken: StreamsyncError | None = None

    @property
    def formed(self) -> bool:
        """The group exists (formed on the first bucket)."""
        return self._group is not None

    def form(self, timeout: float) -> None:
        """Meet every other rank through the store (all of them call this)."""
        from torch._C._distributed_c10d import PrefixStore

        assert self.plan is not None and self.store is not None
        store = PrefixStore(self.plan.prefix, self.store)
        rank, size = self.rank, self.plan.world_size
        if self.backend == "gloo":
            from torch.distributed.distributed_c10d import ProcessGroupGloo

            # The gloo options with devices (``Options`` is the generic backend's here).
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = as_timedelta(timeout)
            options._devices = [_gloo_device(self.local_host)]
            self._group = ProcessGroupGloo(store, rank, size, options)
        else:
            from torch.distributed.distributed_c10d import ProcessGroupNCCL

            nccl_options = ProcessGroupNCCL.Options()
            nccl_options._timeout = as_timedelta(timeout)
            self._group = ProcessGroupNCCL(store, rank, size, nccl_options)

    def ready_event(self) -> Any:
        """On a GPU: an event recorded now on this thread's current stream (what was queued
        on it, a packing or a sink's copies, is done when it fires); ``None`` on the host."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def broadcast(
        self, data: torch.Tensor, timeout: float, *, form_timeout: float, after: Any = None
    ) -> None:
        """Broadcast ``data`` from rank 0 into every rank's ``data`` within ``timeout``
        seconds (forming the group first if needed, and once ``after``, a
        :meth:`ready_event`, fired); raises a named error and leaves the member broken if
        it cannot."""
        import torch.distributed as dist

        if self._broken is not None:
            raise self._broken
        try:
            if after is not None:
                after.synchronize()  # this worker thread waits, not the device
            if self._group is None:
                self.form(form_timeout)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            options.rootTensor = 0
            options.timeout = as_timedelta(timeout)
            work = self._group.broadcast([data], options)
            if self.backend == "gloo":
                work.wait()  # bounded by options.timeout
            else:
                # NCCL: wait on the work's completion event, abort the group on timeout.
                deadline = time.monotonic() + timeout
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        self._group.abort()
                        raise TimeoutError(f"timed out after {timeout:g} s")
                    time.sleep(0.0002)
        except Exception as exc:
            self._broken = self._error(exc, data.numel(), timeout)
            raise self._broken from exc

    def poison(self) -> None:
        """Refuse every later broadcast (the group is out of step with its peers)."""
        if self._broken is None:
            self._broken = PeerBrokenError(
                f"{self.url}: an earlier broadcast failed; open a new channel"
            )

    def _error(self, exc: Exception, nbytes: int, timeout: float) -> StreamsyncError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, TimeoutError) or "timed out" in text.lower():
            return SyncTimeoutError(
                f"{self.url}: a broadcast of {nbytes} bytes did not complete within "
                f"{timeout:g} s (rank {self.rank}; a peer is not taking part); the channel's "
                "process group is unusable now: open a new channel"
            )
        return PeerBrokenError(
            f"{self.url}: the {self.backend} broadcast failed at rank {self.rank} ({text}); "
            "a peer went away: open a new channel"
        )

    def close(self) -> None:
        """Shut the group down and let go of the store (idempotent)."""
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.abort() if self._broken is not None else group.shutdown()
        self.store = None


def _gloo_device(host: str) -> Any:
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"])
    if host in ("", "*", "0.0.0.0", "::"):
        return ProcessGroupGloo.create_default_device()
    return ProcessGroupGloo.create_device(hostname=host)


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])
            return str(probe.getsockname()[0])
    except OSError:
        return ""
