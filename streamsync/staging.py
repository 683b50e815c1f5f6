"""Staged syncs on the receiving side: a version received while the model keeps serving the
old one, then applied all at once.

::

    stage:   receive() ──buckets──> StagingSink.load: each tensor copied into host memory
             (a delta patches a staging copy of the worker's kept copy; the model is not
             touched) ──Done──> finalize: the whole version is held, checked as any sync is
    commit:  the wrapped sink's prepare -> load(every staged tensor) -> finalize, with the
             version the staging took; a failure aborts the wrapped sink (the model is
             left able to serve) and forgets its version, so the next sync is full
    drop:    the staged tensors are freed; the model never saw them

What the worker pays while a version is staged: one host copy of every tensor it received
(its slices, in a sharded sync), freed at commit or drop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamsync._log import log
from streamsync.errors import ConfigError
from streamsync.pipeline import NamedTensor
from streamsync.report import LoadResult
from streamsync.sink import (
    AbortableSink,
    BufferDeclaringSink,
    CopyKeepingSink,
    Sink,
    StageCheckedSink,
    as_versioned,
    call_phase,
)


class StagingSink:
    """A sink that holds a sync in host memory instead of loading it, around ``inner``, the
    sink a plain sync would load into; :meth:`commit` then loads it there.

    It takes delta syncs when ``inner`` does (a :class:`~streamsync.sink.VersionedSink`):
    its ``version`` is the version ``inner``'s model holds, patches land in staging copies
    of ``inner``'s kept tensors, and the staged sync's id becomes ``inner``'s version only
    at commit."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self._versioned = as_versioned(inner)
        # Looked up once, not per tensor in ``target``: a protocol check is slow.
        self._kept = inner.kept if isinstance(inner, CopyKeepingSink) else None
        self._staged: dict[str, torch.Tensor] = {}
        self._buffers: frozenset[str] = frozenset()
        #: The sync id the receive gave the staged version (``None``: not wholly staged).
        self.staged_version: int | None = None
        self.complete = False
        # What ``finalize`` checks against, learned now: a staging sink is made where the
        # engine does not step (its RPC's thread), and the learning may drive its loaders.
        if isinstance(inner, StageCheckedSink):
            inner.learn_staged()

    @property
    def nbytes(self) -> int:
        """Host memory the staged tensors take."""
        return sum(t.numel() * t.element_size() for t in self._staged.values())

    @property
    def version(self) -> int | None:
        """The version the model holds (what a delta must be based on) while staging; once
        wholly staged, the staged one (what the next delta will be based on, after the
        commit; a channel that drops the staged version sends a full sync next)."""
        if self.complete:
            return self.staged_version
        return None if self._versioned is None else self._versioned.version

    @version.setter
    def version(self, version: int | None) -> None:
        # The receive marks the model unknown before it writes and sets the sync's id once
        # it is complete; here it writes only staging, so the id waits for the commit.
        if version is not None:
            self.staged_version = version

    def target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The staging tensor for ``name``; for a delta, a copy of the kept tensor the patch
        applies to."""
        held = self._staged.get(name)
        if held is not None and held.dtype == dtype and tuple(held.shape) == shape:
            return held
        held = torch.empty(shape, dtype=dtype)
        if self._versioned is not None and self._versioned.version is not None:
            # The tensor a patch applies to, without making one where there is none: a
            # sink that keeps copies says which it holds (``kept``), one that patches its
            # model in place gives its own tensor.
            base = (self._kept or self._versioned.target)(name, dtype, shape)
            if base is not None:
                held.copy_(base)
        self._staged[name] = held
        return held

    def prepare(self) -> None:
        self.complete = False

    def declare_buffers(self, names: frozenset[str]) -> None:
        self._buffers |= names

    def load(self, tensors: Sequence[NamedTensor]) -> None:
        for name, tensor in tensors:
            if self._staged.get(name) is not tensor:  # else it landed there already
                self.target(name, tensor.dtype, tuple(tensor.shape)).copy_(tensor)

    def finalize(self) -> LoadResult:
        # What the commit would refuse, refused now: a wrong name or shape fails the
        # staging, with every model untouched.
        if isinstance(self.inner, StageCheckedSink):
            self.inner.check_staged(self._staged, self._buffers)
        self.complete = True
        log("staging.staged", tensors=len(self._staged), nbytes=self.nbytes)
        return LoadResult(loaded=tuple(sorted(self._staged)))

    def abort(self) -> None:
        """A staging that failed: drop what it held (the model was never touched)."""
        self.drop()

    def drop(self) -> None:
        """Free the staged tensors."""
        self._staged = {}
        self.complete = False
        self.staged_version = None

    async def commit(self) -> LoadResult:
        """Load the staged version into ``inner`` (prepare, every tensor, finalize) and give
        its model the staged version. On a failure ``inner`` is aborted, its version
        forgotten (the next sync is full) and the error raised."""
        if not self.complete:
            raise ConfigError("commit: no version is wholly staged on this worker")
        inner = self.inner
        try:
            await call_phase(inner.prepare)
            if self._buffers and isinstance(inner, BufferDeclaringSink):
                await call_phase(inner.declare_buffers, self._buffers)
            await call_phase(inner.load, list(self._staged.items()))
            result = await call_phase(inner.finalize)
        except BaseException:
            if isinstance(inner, AbortableSink):
                inner.abort()
            if self._versioned is not None:
                self._versioned.version = None
            raise
        if self._versioned is not None:
            self._versioned.version = self.staged_version
        log("staging.committed", tensors=len(self._staged), version=self.staged_version)
        self.drop()
        return result if isinstance(result, LoadResult) else LoadResult()
