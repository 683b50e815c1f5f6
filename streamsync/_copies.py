"""The library's copies, with a parallelism it controls.

Every byte a sync moves on the CPU (packing into a slot, a fused cast, reassembling chunks,
``ModuleSink``'s copies) goes through here, and ``torch.get_num_threads()`` is never changed:

* **Same dtype, both sides contiguous: a ``memmove``** (the compiled kernel, else
  ``ctypes.memmove``; both release the GIL). Small ones run inline, many in one call, so a
  bucket of thousands of small tensors pays no per-tensor cost worth the name; large ones are
  split into pieces of at least :data:`PIECE_BYTES` across the pool. The kernel's copies of
  4 KiB and more bypass the cache: what a sync writes is not read again by the writing
  thread, and glibc streams only above a threshold from the cache size the CPU reports,
  which a VM may report as its host's (below it, glibc copied at about half the speed).
* **fp32 to bf16 and back, both contiguous: the kernel's cast** on the pool, bit for bit
  torch's (rounding to nearest even), about 1.5 times torch's single-threaded ``copy_``;
  torch casts a piece that holds a NaN.
* **Anything else: ``Tensor.copy_`` on a pool thread**, split across the pool when large.
  Each pool thread sets its own OpenMP thread count to 1, so these never open an OpenMP
  parallel region.

Why: with torch's default thread count every large ``copy_`` opens an OpenMP region, and
between regions the runtime's workers spin-wait, for the whole sync, on the cores the peer
process needs: on a 2-core machine shm ran at 0.23 of the two-copy bound that way, 0.85 with
one torch thread.

The pool (:data:`POOL_THREADS` threads, ``streamsync-cpN`` to the OS) starts on first use,
is dropped in a forked child and shut down at interpreter exit or by :func:`shutdown`. The
compiled kernel (``_kernel.c``) is the extension module ``streamsync._kernel``, built when
the package is installed: nothing is compiled or loaded from outside the package at run
time. Where it was not built, torch, numpy and ``ctypes.memmove`` do the same work, and
:func:`kernel` says which is in use.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

import numpy as np
import torch

from streamsync._log import warn

#: Threads in the copy pool: a few are enough to saturate memory bandwidth, and more would
#: only compete with the peer process for cores.
POOL_THREADS: Final = max(1, min(4, os.cpu_count() or 1))
#: The smallest piece a large copy is split into (below it, one thread does the whole copy).
PIECE_BYTES: Final = 4 << 20
#: A copy of fewer bytes than this, that only needs a memmove, runs on the calling thread.
INLINE_BYTES: Final = 1 << 20

Move = tuple[int, int, int]  # (destination address, source address, bytes)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_DIFF = (_I64, _P, _P, _I64, _I64, _P, _P, _P, _I64)
#: Each function of the compiled kernel: its result type, then its arguments' (_kernel.c).
_SIGNATURES: Final[dict[str, tuple[Any, ...]]] = {
    **{f"ss_diff_{size}": _DIFF for size in (1, 2, 4, 8)},
    **{f"ss_apply_{size}": (None, _P, _P, _P, _P, _I64) for size in (1, 2, 4, 8)},
    "ss_diff_f32_bf16": _DIFF,
    "ss_diff_f32_bf16_portable": _DIFF,
    "ss_check": (_I64, _P, _P, _I64, _I64, _I64),
    "ss_copy": (None, _P, _P, _I64),
    "ss_memmove_many": (None, _P, _I64),
    "ss_cast_f32_bf16": (_I64, _P, _P, _I64),
    "ss_cast_f32_bf16_portable": (_I64, _P, _P, _I64),
    "ss_cast_bf16_f32": (None, _P, _P, _I64),
    "ss_name_thread": (None, ctypes.c_char_p),
    "ss_openmp_setter": (_P, ctypes.c_char_p),
}


@functools.cache
def _library() -> Any:
    """The compiled kernel's functions by name, each a ctypes function at the address the
    extension module ``streamsync._kernel`` gives, or ``None`` where it was not built."""
    try:
        module = importlib.import_module("streamsync._kernel")
        functions = {
            name: ctypes.CFUNCTYPE(*signature)(getattr(module, name))
            for name, signature in _SIGNATURES.items()
        }
    except (ImportError, AttributeError) as exc:
        warn("copies.kernel", using="torch", why=f"{type(exc).__name__}: {exc}")
        return None
    return types.SimpleNamespace(**functions)


def kernel() -> str:
    """Which implementation the copies and patches use here: ``"c"`` (the compiled kernel,
    built when the package was installed) or ``"torch"`` (torch, numpy and
    ``ctypes.memmove``, where it was not built)."""
    return "c" if _library() is not None else "torch"


@functools.cache
def _omp_set_num_threads() -> Callable[[int], Any] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded, or ``None`` (no OpenMP:
    torch's own pool does not spin; or no compiled kernel to find it with). Looked up when
    the pool starts, not at import."""
    lib = _library()
    if lib is None:
        return None
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if ".so" in line}
    except OSError:
        return None
    # Other wheels vendor their own runtime (sentencepiece's libgomp, loaded by tokenizers
    # and peft): the one in torch's own directory is torch's, so it comes first.
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for path in sorted(paths, key=lambda p: (not p.startswith(torch_dir + os.sep), p)):
        base = os.path.basename(path)
        if base.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in base:
            # Only a runtime already loaded: the kernel never loads a library.
            address = lib.ss_openmp_setter(os.fsencode(path))
            if address:
                return ctypes.CFUNCTYPE(None, ctypes.c_int)(address)  # type: ignore[no-any-return]
    return None


def openmp_runtime() -> bool:
    """Whether the pool threads pin the OpenMP runtime torch uses to one thread each."""
    return _omp_set_num_threads() is not None


_counter = iter(range(1 << 30))


def _init_worker() -> None:
    lib = _library()
    if lib is not None:  # the OS thread's name, for ``top -H``
        lib.ss_name_thread(f"streamsync-cp{next(_counter)}".encode())
    torch.get_num_threads()  # torch's per-thread lazy init sets this thread's OpenMP count...
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)  # ...which this then lowers, for this thread only


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._fork_hook = False

    def get(self) -> ThreadPoolExecutor:
        executor = self._executor
        if executor is None:
            with self._lock:
                executor = self._executor
                if executor is None:
                    if not self._fork_hook:
                        os.register_at_fork(after_in_child=self.after_fork)
                        self._fork_hook = True
                    executor = self._executor = ThreadPoolExecutor(
                        POOL_THREADS, thread_name_prefix="streamsync-copy", initializer=_init_worker
                    )
        return executor

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def after_fork(self) -> None:
        # The parent's threads are gone in the child; its lock may be held by one of them.
        self._lock = threading.Lock()
        self._executor = None


_pool = _Pool()


def shutdown() -> None:
    """Stop the copy pool's threads (it starts again on the next copy)."""
    _pool.shutdown()


def _wait(futures: Sequence[Future[Any]]) -> None:
    # Wait for every piece, even after one failed: all use the buffers.
    error = next((exc for exc in [fut.exception() for fut in futures] if exc is not None), None)
    if error is not None:
        raise error


def _pieces(nbytes: int) -> int:
    return max(1, min(POOL_THREADS, nbytes // PIECE_BYTES))


@functools.cache
def _kernel(name: str) -> Callable[..., Any] | None:
    lib = _library()
    return None if lib is None else getattr(lib, name)


def large_copy() -> Callable[[int, int, int], Any]:
    """How a large move (or a piece of one) is copied: the compiled kernel's ``ss_copy``,
    which streams past the cache, else ``ctypes.memmove``."""
    return _kernel("ss_copy") or ctypes.memmove


#: Fewer small moves than this go through ctypes one by one (a plan costs arrays).
_PLAN_FROM = 4


def memmove_many(moves: Sequence[Move]) -> None:
    """Copy each ``(dst address, src address, nbytes)``; the caller keeps both alive and
    non-overlapping. Small moves run inline (in one call of the compiled kernel where there
    are several); large ones are split across the pool."""
    if len(moves) < _PLAN_FROM and all(nbytes < INLINE_BYTES for _, _, nbytes in moves):
        for dst, src, nbytes in moves:
            ctypes.memmove(dst, src, nbytes)
    elif moves:
        MovePlan(*zip(*moves, strict=True), spread_small=False).run()


#: Addresses, offsets or sizes: a sequence of ints, or an int64 array.
Addresses = Sequence[int] | np.ndarray


class MovePlan:
    """The same memmoves, run again and again between buffers that may move: each move's
    destination and source as offsets from two bases given at :meth:`run` (0 for absolute
    addresses). Built once (per bucket layout, say), it runs without Python work per move:
    its moves are cut into runs of about equal bytes, one per thread, each run one call of
    the compiled kernel, the last run on the calling thread."""

    def __init__(
        self, dst: Addresses, src: Addresses, nbytes: Addresses, *, spread_small: bool = True
    ) -> None:
        moves = np.stack(
            [np.asarray(dst, np.int64), np.asarray(src, np.int64), np.asarray(nbytes, np.int64)],
            axis=1,
        ).reshape(-1, 3)
        moves = moves[moves[:, 2] > 0]
        self._count = len(moves)
        #: Bytes moved per run.
        self.nbytes = int(moves[:, 2].sum())
        # With ``spread_small``, every move is shared out: thousands of small tensors are as
        # many bytes as a few large, and a sender's gather into one slot gains from the
        # threads. Without it, the small moves stay on the calling thread (a receiver's
        # scatter into thousands of tensors runs faster there alone) and only the large
        # ones are shared.
        if spread_small:
            shared, kept = moves, moves[:0]
        else:
            large = moves[:, 2] >= INLINE_BYTES
            shared, kept = moves[large], moves[~large]
        runs = _cut(shared, _pieces(int(shared[:, 2].sum())))
        runs[-1] = np.concatenate([runs[-1], kept])
        #: One ``(dst, src, nbytes)`` array per thread, the calling thread's last.
        self._runs = [np.ascontiguousarray(run) for run in runs]

    def __len__(self) -> int:
        return self._count

    def run(self, dst_base: int = 0, src_base: int = 0) -> None:
        """Do every move, ``dst_base`` and ``src_base`` added to its two offsets."""
        futures: list[Future[Any]] = []
        *others, mine = self._runs
        bases = np.array([dst_base, src_base, 0], dtype=np.int64)
        try:
            if others:
                submit = _pool.get().submit
                futures.extend(submit(_move_batch, run + bases) for run in others)
            if len(mine):
                _move_batch(mine + bases)
        finally:
            _wait(futures)


#: Where a run may be cut inside a move: a page, so that no piece starts mid-page.
_CUT_ALIGN: Final = 4096


def _cut(moves: np.ndarray, parts: int) -> list[np.ndarray]:
    """``moves`` (rows of ``(dst, src, nbytes)``) as up to ``parts`` runs of about equal
    bytes, in order; a move that straddles a cut is split there, at a page of its bytes."""
    if parts <= 1 or not len(moves):
        return [moves]
    total = int(moves[:, 2].sum())
    runs: list[np.ndarray] = []
    rest, taken = moves, 0
    for k in range(1, parts):
        need = total * k // parts - taken  # bytes of ``rest`` that go before this cut
        ends = np.cumsum(rest[:, 2])
        if need <= 0 or int(ends[-1]) <= need:
            continue  # nothing of ``rest`` would be left after the cut
        j = int(np.searchsorted(ends, need))  # the first move that ends at or past the cut
        size = int(rest[j, 2])
        inside = (need - (int(ends[j]) - size)) // _CUT_ALIGN * _CUT_ALIGN
        if int(ends[j]) == need:  # the cut falls where move j ends
            head, rest = rest[: j + 1], rest[j + 1 :]
        elif inside <= 0:
            head, rest = rest[:j], rest[j:]
        else:
            dst, src = int(rest[j, 0]), int(rest[j, 1])
            head = np.concatenate([rest[:j], np.array([[dst, src, inside]], np.int64)])
            tail = np.array([[dst + inside, src + inside, size - inside]], np.int64)
            rest = np.concatenate([tail, rest[j + 1 :]])
        if len(head):
            runs.append(head)
            taken += int(head[:, 2].sum())
    runs.append(rest)
    return runs


def _move_batch(moves: np.ndarray) -> None:
    batch = _kernel("ss_memmove_many")
    if batch is not None:
        batch(moves.ctypes.data, len(moves))
    else:
        for dst, src, nbytes in moves.tolist():
            ctypes.memmove(dst, src, nbytes)


def _torch_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():  # grad mode is per thread
        dst.copy_(src)


#: The casts the compiled kernel does: its function for each (source, destination) dtype.
_KERNEL_CASTS: Final = {
    (torch.float32, torch.bfloat16): "ss_cast_f32_bf16",
    (torch.bfloat16, torch.float32): "ss_cast_bf16_f32",
}


def _cast_kernel(src: torch.dtype, dst: torch.dtype) -> Callable[[int, int, int], Any] | None:
    name = _KERNEL_CASTS.get((src, dst))
    return None if name is None else _kernel(name)


def kernel_cast(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous tensors of a pair the kernel casts (fp32 <-> bf16):
    bit for bit what torch gives, stored past the cache. Torch casts instead where there is
    no kernel, and where the fp32 -> bf16 kernel refuses a piece for holding a NaN (torch's
    NaN bits differ between its own paths)."""
    kernel = _cast_kernel(src.dtype, dst.dtype)
    refused = kernel(dst.data_ptr(), src.data_ptr(), dst.numel()) if kernel is not None else 0
    if refused is not None and refused >= 0:  # None: a cast that cannot refuse
        _torch_copy(dst, src)


def _flat_pair(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Both on the CPU, of one shape, contiguous: a memmove or a kernel cast can copy them."""
    return (
        dst.is_cpu
        and src.is_cpu
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    )


def _split(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` as pieces for the pool: along the flattened elements when both are
    contiguous, else along the first dimension."""
    nbytes = max(dst.numel() * dst.element_size(), src.numel() * src.element_size())
    count = _pieces(nbytes)
    if count == 1 or dst.dim() == 0 or dst.shape != src.shape:
        return [(dst, src)]
    if dst.is_contiguous() and src.is_contiguous():
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        step = -(-dst.numel() // count)
        return [
            (flat_dst[lo : lo + step], flat_src[lo : lo + step])
            for lo in range(0, dst.numel(), step)
        ]
    rows = dst.shape[0]
    if rows < 2:
        return [(dst, src)]
    step = -(-rows // min(count, rows))
    return [(dst[lo : lo + step], src[lo : lo + step]) for lo in range(0, rows, step)]


class CopyBatch:
    """Copies collected first and then run together (:meth:`run`), so a bucket's large
    copies proceed in parallel on the pool while its small ones run inline."""

    def __init__(self) -> None:
        self._moves: list[Move] = []
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(self, dst: int, src: int, nbytes: int) -> None:
        """A memmove of ``nbytes`` from address ``src`` to ``dst`` (the caller keeps both
        buffers alive until :meth:`run` returns)."""
        if nbytes:
            self._moves.append((dst, src, nbytes))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, as a memmove where that suffices."""
        if dst.dtype == src.dtype and _flat_pair(dst, src):
            self.move(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        else:
            self._pairs.append((dst, src))

    def run(self) -> None:
        """Do every copy; returns when all are done, raising the first error."""
        pairs, self._pairs = self._pairs, []
        moves, self._moves = self._moves, []
        futures: list[Future[Any]] = []
        try:
            for dst, src in pairs:
                if not (dst.is_cpu and src.is_cpu):
                    _torch_copy(dst, src)  # another device: its own streams, no OpenMP
                    continue
                submit = _pool.get().submit
                cast = _flat_pair(dst, src) and _cast_kernel(src.dtype, dst.dtype) is not None
                copy = kernel_cast if cast else _torch_copy
                futures.extend(submit(copy, d, s) for d, s in _split(dst, src))
            memmove_many(moves)
        finally:
            _wait(futures)


def copy_tensors(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair (``src`` broadcastable to ``dst`` as ``copy_``
    allows), done as described in the module docstring: memmoves where they suffice, else
    ``copy_`` on the pool's single-threaded workers. Returns when all are done; the first
    error (e.g. a shape mismatch) is raised."""
    batch = CopyBatch()
    for dst, src in pairs:
        batch.copy(dst, src)
    batch.run()


def clone(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` (what ``tensor.clone()`` gives for a contiguous one),
    made by :func:`copy_tensors`."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    copy_tensors([(out, tensor)])
    return out
