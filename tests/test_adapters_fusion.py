"""Property: fusing ``cast`` into the bucketer changes nothing on the wire. For any named
tensors and any chain of cast/rename/select ending in ``bucket``, the fused chain packs the
same entries and the same bytes as the same chain with fusion disabled."""

from __future__ import annotations

import functools
import operator
import zlib
from typing import Any

import anyio
import torch
from conftest import WIRE_DTYPES, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsync import named_tensors
from streamsync.adapters import bucket, cast, rename, select
from streamsync.pipeline import Chain
from streamsync.testing.buckets import pack_bucket

CASTS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _crc(name: str, k: int) -> bool:
    return zlib.crc32(name.encode()) % 3 != k


def make_stage(kind: str, arg: Any) -> Any:
    if kind == "cast":
        dtype, only = arg
        return cast(dtype, only=None if only is None else functools.partial(_crc, k=only))
    if kind == "rename":
        # Some renames make or unmake a ``*_scale_inv`` name, which a cast must leave alone.
        return rename(lambda n, p=arg: n[: -len("_scale_inv")] if n.endswith("_inv") else n + p)
    return select(functools.partial(_crc, k=arg))


stages = st.lists(
    st.one_of(
        st.tuples(
            st.just("cast"),
            st.tuples(st.sampled_from(CASTS), st.one_of(st.none(), st.integers(0, 2))),
        ),
        st.tuples(st.just("rename"), st.sampled_from([".x", "_scale_inv", ".weight_scale_inv"])),
        st.tuples(st.just("select"), st.integers(0, 3)),
    ),
    max_size=5,
)
tensors = st.lists(
    st.tuples(
        st.sampled_from(WIRE_DTYPES),
        st.lists(st.integers(0, 9), max_size=3).map(tuple),  # odd sizes, empty tensors
        st.sampled_from(["", ".weight", ".weight_scale_inv", "_scale_inv"]),
        st.booleans(),  # non-contiguous
    ),
    max_size=8,
)


def build(
    specs: list[tuple[torch.dtype, tuple[int, ...], str, bool]], big: int
) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, (dtype, shape, suffix, transpose) in enumerate(specs):
        t = random_tensor(shape, dtype, i)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)
        out.append((f"layer{i}{suffix}", t))
    # Larger than a bucket: chunked across buckets, converted chunk by chunk when fused.
    out.append(("big.weight", random_tensor((big,), torch.float32, 99)))
    return out


async def packed(chain: Chain, items: list[tuple[str, torch.Tensor]]) -> list[Any]:
    out = []
    async for plan in chain(named_tensors(items)):
        done = pack_bucket(plan, checksum=True)
        regions = [bytes(done.data[e.offset : e.offset + e.nbytes].numpy()) for e in done.entries]
        out.append((done.entries, regions, done.tensors))
    return out


@settings(max_examples=60, deadline=None)
@given(
    specs=tensors,
    chain=stages,
    bucket_bytes=st.integers(1024, 4096),
    big=st.integers(0, 2500),
    grouping=st.integers(0, 5),
)
def test_fused_chain_packs_what_the_unfused_chain_packs(
    specs: list[tuple[torch.dtype, tuple[int, ...], str, bool]],
    chain: list[tuple[str, Any]],
    bucket_bytes: int,
    big: int,
    grouping: int,
) -> None:
    items = build(specs, big)
    parts = [make_stage(kind, arg) for kind, arg in chain] + [bucket(bucket_bytes)]
    # The fused chain as users write it, grouped anywhere: ``a | (b | c)`` fuses the same.
    cut = grouping % len(parts)
    left = functools.reduce(operator.or_, parts[:cut]) if cut else None
    right = Chain(*parts[cut:])
    fused = Chain(right) if left is None else Chain(left, right)
    plain = Chain(*parts, fuse=False)
    if chain and chain[-1][0] == "cast":
        assert len(fused.stages) == len(parts) - 1 and fused.stages[-1].cast is not None
    else:
        assert len(fused.stages) == len(parts)
    assert len(plain.stages) == len(parts)

    got = anyio.run(packed, fused, items)
    want = anyio.run(packed, plain, items)
    assert got == want
