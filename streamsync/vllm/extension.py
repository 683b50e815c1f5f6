"""The worker side: ``worker_extension_cls="streamsync.vllm.WorkerExtension"``.

vLLM mixes this class into every worker. Its methods are called through ``collective_rpc``
with plain arguments (an endpoint URL and options: vLLM serialises them; no tensors travel
that way); the weights themselves arrive over the transport. Method names carry the
``streamsync_`` prefix because vLLM refuses extension attributes that clash with the
worker's own (``update_weights``, ``reload_weights``, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamsync.errors import EndOfStream, PeerBrokenError, StreamsyncError
from streamsync.report import SyncReport
from streamsync.sync import receive
from streamsync.transports import Receiver, open_receiver
from streamsync.vllm._loop import LoopThread

__all__ = ["WorkerExtension"]


@dataclass
class _WorkerState:
    loop: LoopThread = field(default_factory=LoopThread)
    receivers: dict[str, Receiver] = field(default_factory=dict)


def _state(worker: Any) -> _WorkerState:
    state = worker.__dict__.get("_streamsync_state")
    if state is None:
        state = worker.__dict__["_streamsync_state"] = _WorkerState()
    return state  # type: ignore[no-any-return]


class WorkerExtension:
    """Methods vLLM adds to each worker (main model and drafter live in the same worker)."""

    def streamsync_receive(
        self, endpoint: str, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Receive one sync from ``endpoint`` into every model instance of this worker.

        Returns the report as plain data, ``{"ok": True, "report": {...}}``, or on failure
        ``{"ok": False, "error": <exception class name>, "message": ..., "report": <partial>}``
        (the trainer side re-raises it), so a failed sync never takes the engine down.
        """
        from streamsync.vllm.sink import VllmSink

        opts = dict(options or {})
        timeout = float(opts.pop("timeout", 60.0))
        transport_options = dict(opts.pop("transport", {}))
        sink = VllmSink.from_worker(self, **opts)
        state = _state(self)

        async def run_once() -> SyncReport:
            receiver = state.receivers.get(endpoint)
            if receiver is None:
                receiver = open_receiver(endpoint, **transport_options)
                await receiver.open()
                state.receivers[endpoint] = receiver
            return await receive(receiver, sink, timeout=timeout)

        async def run() -> SyncReport:
            try:
                return await run_once()
            except (EndOfStream, PeerBrokenError) as exc:
                # The trainer reopened its side since our last sync: reconnect once, unless
                # this sync had already started applying weights.
                if exc.report is not None and exc.report.loaded:
                    raise
                old = state.receivers.pop(endpoint, None)
                if old is not None:
                    await old.aclose()
                return await run_once()

        try:
            report = state.loop.run(run, timeout=timeout * 4)
        except StreamsyncError as exc:
            return {
                "ok": False,
                "error": type(exc).__name__,
                "message": str(exc),
                "report": msgspec.to_builtins(exc.report) if exc.report is not None else None,
                "pid": os.getpid(),
            }
        return {"ok": True, "report": msgspec.to_builtins(report), "pid": os.getpid()}

    def streamsync_close(self, endpoint: str | None = None) -> int:
        """Close this worker's receivers (all, or the one for ``endpoint``); returns how many."""
        state = _state(self)
        names = [endpoint] if endpoint is not None else list(state.receivers)
        closed = 0
        for name in names:
            receiver = state.receivers.pop(name, None)
            if receiver is not None:
                state.loop.run(receiver.aclose, timeout=10)
                closed += 1
        return closed

    def streamsync_describe(self) -> dict[str, Any]:
        """The model instances this worker serves and their parameter/buffer names."""
        from streamsync.vllm.sink import model_instances

        out: dict[str, Any] = {}
        for inst in model_instances(self):
            out[inst.name] = {
                "class": type(inst.model).__name__,
                "parameters": sorted(n for n, _ in inst.model.named_parameters()),
                "buffers": sorted(n for n, _ in inst.model.named_buffers()),
            }
        return out
