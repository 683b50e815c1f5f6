"""Property: any tensors through any chain of cast/rename/select, any bucket size, the
memory transport: arrive in order, with identical names, dtypes, shapes and bytes."""

from __future__ import annotations

import anyio
import torch
from conftest import WIRE_DTYPES, random_tensor, same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

import streamsync as ss
from streamsync.adapters import cast, rename, select
from streamsync.pipeline import Chain

CASTS = [torch.float32, torch.bfloat16, torch.float16]


class Keep:
    def __init__(self) -> None:
        self.items: list[tuple[str, torch.Tensor]] = []

    def prepare(self) -> None: ...

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.items.extend((n, t.clone()) for n, t in tensors)

    def finalize(self) -> None: ...


stage = st.one_of(
    st.tuples(st.just("cast"), st.sampled_from(CASTS)),
    st.tuples(st.just("rename"), st.text("abc", min_size=1, max_size=3)),
    st.tuples(st.just("select"), st.integers(0, 3)),
)


def build(stages: list[tuple[str, object]]) -> tuple[Chain, object]:
    """The chain, and a reference implementation applied to a plain list."""
    adapters = []
    for kind, arg in stages:
        if kind == "cast":
            adapters.append(cast(arg))  # type: ignore[arg-type]
        elif kind == "rename":
            adapters.append(rename(lambda n, p=arg: f"{p}.{n}"))
        else:
            adapters.append(select(lambda n, k=arg: hash(n) % 4 != k))

    def reference(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        for kind, arg in stages:
            if kind == "cast":
                items = [
                    (
                        n,
                        t.to(arg)
                        if t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
                        else t,
                    )
                    for n, t in items
                ]
            elif kind == "rename":
                items = [(f"{arg}.{n}", t) for n, t in items]
            else:
                items = [(n, t) for n, t in items if hash(n) % 4 != arg]
        return items

    return Chain(*adapters) if adapters else Chain(select(lambda n: True)), reference


shapes = st.lists(st.integers(0, 6), max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(WIRE_DTYPES), shapes, st.booleans()), max_size=10),
    stages=st.lists(stage, max_size=4),
    bucket_bytes=st.integers(1024, 3000),
    big=st.integers(0, 1500),
    fused=st.booleans(),
)
def test_any_chain_any_bucket_size_round_trips(
    specs: list[tuple[torch.dtype, tuple[int, ...], bool]],
    stages: list[tuple[str, object]],
    bucket_bytes: int,
    big: int,
    fused: bool,
) -> None:
    tensors = []
    for i, (dtype, shape, transpose) in enumerate(specs):
        t = random_tensor(shape, dtype, i)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)  # non-contiguous
        tensors.append((f"t{i}", t))
    tensors.append(("big", random_tensor((big,), torch.bfloat16, 7)))
    chain, reference = build(stages)
    want = reference(list(tensors))  # type: ignore[operator]
    sink = Keep()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: ss.receive("memory://prop", sink, timeout=10))
            if fused:
                tg.start_soon(
                    lambda: ss.send(
                        tensors,
                        "memory://prop",
                        pipeline=chain,
                        bucket_bytes=bucket_bytes,
                        timeout=10,
                        checksum=True,
                    )
                )
            else:
                tg.start_soon(
                    lambda: ss.send(
                        chain(ss.named_tensors(tensors)),
                        "memory://prop",
                        bucket_bytes=bucket_bytes,
                        timeout=10,
                    )
                )

    anyio.run(main)
    assert [n for n, _ in sink.items] == [n for n, _ in want]
    for (_, got), (name, exp) in zip(sink.items, want, strict=True):
        assert same_bits(got, exp), name
