"""The bench's baseline: verl's shared-memory weight transfer, re-implemented here.

verl's ``BucketedWeightSender`` / ``BucketedWeightReceiver`` (``use_shm=True``; verl's
``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``) move weights through one
``multiprocessing.shared_memory`` buffer of a bucket's size and a ZMQ REQ/REP pair over ipc:
the sender copies tensors into the buffer with ``Tensor.copy_`` until the next one does not
fit, sends the bucket's metadata (a pickled dict) and waits for the receiver's empty reply;
the receiver views the buffer, hands the views on (here: copies them into preallocated
tensors, as :class:`~streamsync.ModuleSink` does) and replies. One buffer, so packing and
loading never overlap; tensors larger than the buffer are refused with shared memory.

Both roles run with the process's torch settings, as streamsync's do. verl pickles the
metadata (``send_pyobj``); this package never unpickles, so it goes as msgpack here, which is
no slower: if anything the baseline is flattered.
"""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Any

import msgspec
import torch

from streamsync._dtypes import dtype_from_name, dtype_name
from streamsync.cli.bench.models import synthetic_model

__all__ = ["verl_receiver", "verl_sender"]


def _syncs(job: dict[str, Any]) -> int:
    return int(job["runs"]) + 1


async def verl_sender(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """The trainer side: one sync per run, timed from the barrier to the last reply."""
    import zmq

    weights = synthetic_model(job["size"]).weights()
    size = int(job["bucket_bytes"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.bind(job["address"])
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        assert shm.buf is not None
        buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
        sock.send(msgspec.msgpack.encode({"name": shm.name, "size": size}))
        sock.recv()
        spans: list[tuple[float, float]] = []
        for _ in range(_syncs(job)):
            barrier.wait()
            t0 = time.monotonic()
            offset = 0
            meta: dict[str, Any] = {}
            for name, weight in weights.items():
                if offset + weight.nbytes > size and meta:
                    sock.send(msgspec.msgpack.encode({"bucket_meta": meta, "is_last": False}))
                    sock.recv()
                    meta, offset = {}, 0
                if weight.nbytes > size:
                    raise ValueError(f"{name} ({weight.nbytes} bytes) exceeds the buffer")
                meta[name] = {
                    "shape": list(weight.shape),
                    "dtype": dtype_name(weight.dtype),
                    "offset": offset,
                }
                region = buffer[offset : offset + weight.nbytes]
                region.view(weight.dtype).view(weight.shape).copy_(weight)
                offset += weight.nbytes
            sock.send(msgspec.msgpack.encode({"bucket_meta": meta, "is_last": True}))
            sock.recv()
            spans.append((t0, time.monotonic()))
        del buffer, region  # views of the shared memory: it cannot close while they live
    finally:
        sock.close(linger=0)
        ctx.term()
        shm.close()
        shm.unlink()
    return {"spans": spans}


async def verl_receiver(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """The engine side: copies every tensor of every bucket into the model's tensors."""
    import zmq

    model = synthetic_model(job["size"])
    targets = model.zeros()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.connect(job["address"])
    shm: shared_memory.SharedMemory | None = None
    try:
        info = msgspec.msgpack.decode(sock.recv())
        shm = shared_memory.SharedMemory(name=info["name"])
        assert shm.buf is not None
        buffer = torch.frombuffer(shm.buf[: info["size"]], dtype=torch.uint8)
        sock.send(b"")
        for _ in range(_syncs(job)):
            barrier.wait()
            while True:
                msg = msgspec.msgpack.decode(sock.recv())
                for name, meta in msg["bucket_meta"].items():
                    dtype, shape = dtype_from_name(meta["dtype"]), torch.Size(meta["shape"])
                    offset = meta["offset"]
                    nbytes = dtype.itemsize * shape.numel()
                    view = buffer[offset : offset + nbytes].view(dtype).view(shape)
                    targets[name].copy_(view)
                sock.send(b"")
                if msg["is_last"]:
                    break
        expected = model.weights()
        verified = all(torch.equal(targets[n], t) for n, t in expected.items())
        del buffer, view  # views of the shared memory: it cannot close while they live
    finally:
        sock.close(linger=0)
        ctx.term()
        if shm is not None:
            shm.close()
    return {"verified": verified}
