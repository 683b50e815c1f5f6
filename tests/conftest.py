"""Shared test helpers: small tensors of every dtype the wire carries."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

# Run each side concurrently; each one's result, or the exception it raised (the
# conformance suite's helper, shared with the tests that import it from here).
from streamsync.testing.conformance_sides import _both as run_both  # noqa: F401

# Every dtype vLLM uses on the wire, including the fp8 formats and bool.
WIRE_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float64,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values of ``dtype`` with arbitrary bit patterns where the dtype allows."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point and dtype.itemsize == 1:
        # Random bytes reinterpreted: covers every fp8 bit pattern except NaNs we'd not compare.
        raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
        return raw.view(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen, dtype=torch.int64
    ).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included), dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def vllm_required() -> bool:
    """``make test`` and CI need vLLM: there a test that cannot import it fails. Only a
    run without the ``vllm`` extra installed, outside both, skips the engine tests."""
    return os.environ.get("STREAMSYNC_REQUIRE_VLLM") == "1" or os.environ.get("CI") == "true"


def extra(module: str, name: str) -> Any:
    """``module`` of the optional extra ``name`` (peft for ``lora``): imported, and under
    ``make test`` and CI a failure if it does not import; elsewhere its tests skip."""
    if vllm_required():
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"the {name} extra ({module}) is not installed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_required() or importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(
        reason="vLLM is not installed (pip install 'streamsync[vllm]'); make test and CI "
        "require it and fail instead"
    )
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
