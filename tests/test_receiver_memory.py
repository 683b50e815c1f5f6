"""What a receiver holds of a bucket after giving its slot back: nothing. Where a bucket's
bytes are a message of their own (zmq), the sender's next bucket is allocated while the
receiver still holds what it did not drop, so every bucket held past its release is one
more bucket of memory (BENCHMARKS.md, peak extra memory)."""

from __future__ import annotations

import os
import weakref

import anyio
import torch

import streamsync as ss
from streamsync._channel import receiver_state


async def test_a_zmq_receiver_holds_no_bucket_past_its_release() -> None:
    url = f"zmq+ipc://held-{os.getpid()}"
    weights = {f"w{i}": torch.full((1024,), float(i)) for i in range(12)}  # 4 KiB each
    target = torch.nn.Module()
    for name, tensor in weights.items():
        target.register_buffer(name, torch.zeros_like(tensor))
    alive_at_release: list[tuple[int, bool]] = []
    async with (
        ss.open_sender(url, slots=2, slot_bytes=8192) as tx,
        ss.open_receiver(tx.url) as rx,
    ):
        delivered: dict[int, weakref.ref[torch.Tensor]] = {}
        fill, release = rx.view.fill, rx.release  # type: ignore[attr-defined]

        async def filled(header, payload, *, timeout):  # type: ignore[no-untyped-def]
            data = await fill(header, payload, timeout=timeout)
            delivered[header.seq] = weakref.ref(data)
            return data

        async def released(header) -> None:  # type: ignore[no-untyped-def]
            alive_at_release.append((header.seq, delivered[header.seq]() is not None))
            await release(header)

        rx.view.fill = filled  # type: ignore[attr-defined]
        rx.release = released  # type: ignore[method-assign]
        for _ in range(2):  # a second sync on the same channel, too
            alive_at_release.clear()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ss.receive, rx, ss.ModuleSink(target))
                await ss.send(weights, tx, bucket_bytes=8192, timeout=10)
            assert len(alive_at_release) == 6  # two tensors to a bucket
            assert alive_at_release == [(seq, False) for seq in range(6)]
    for name, tensor in weights.items():
        assert torch.equal(target.get_buffer(name), tensor), name


async def test_a_receiver_keeps_one_string_per_name_in_its_plans_and_its_sink() -> None:
    # The unpacker keeps each layout's names (for as long as the sender repeats it); the
    # sink keeps the module's. Decoded from the wire, each name would be a second string.
    url = f"zmq+ipc://names-{os.getpid()}"
    weights = {f"layer{i}_weight": torch.full((256,), float(i)) for i in range(40)}
    target = torch.nn.Module()
    for name, tensor in weights.items():
        target.register_buffer("".join(name), torch.zeros_like(tensor))  # a string of its own
    sink = ss.ModuleSink(target)
    async with ss.open_sender(url) as tx, ss.open_receiver(tx.url) as rx:
        for _ in range(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: ss.receive(rx, sink, timeout=5))
                await ss.send(weights, tx, bucket_bytes=4096, timeout=5)
        kept = [n for plan in receiver_state(rx).unpacker._plans.values() for n in plan.names]
    assert sorted(kept) == sorted(weights)  # every bucket was a kept plan
    assert not any(n is w for n in kept for w in weights)  # decoded, not the sender's
    own = {name: name for name in sink._targets}
    assert all(own[n] is n for n in kept), "a kept name is not the sink's own string"
    for name, want in weights.items():
        assert torch.equal(target.get_buffer(name), want), name
