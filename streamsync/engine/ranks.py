"""The old path of :class:`~streamsync.vllm.Ranks` and :class:`~streamsync.vllm.RankPeer`:
it still works for one release and warns; import them from :mod:`streamsync.vllm`."""

from __future__ import annotations

import warnings
from typing import Any

from streamsync.engine import collective as _collective

_MOVED = ("RankPeer", "Ranks")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"streamsync.engine.ranks.{name} is deprecated and goes in the next release; "
        f"import it from streamsync.vllm",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_collective, name)
