"""Every use of TRL's private code, in one place, checked against the installed version.

TRL's ``AsyncRolloutWorker`` takes the LoRA adapter its generation asks the server for only
as a constructor argument it keeps privately (``_loop_kwargs``, handed to its child process
when it starts): :meth:`~streamsync.integrations.trl.WeightTransfer.adapter_only` sets it
there before the worker starts.

Importing this module checks the installed TRL against :data:`TESTED` and raises
:class:`~streamsync.errors.UnsupportedVersionError` on any other.
"""

from __future__ import annotations

import functools
from typing import Any

from streamsync._versions import check_tested
from streamsync._versions import installed_version as _installed_version

#: The TRL versions this module was tested with: from the first, up to (not including) the
#: second.
TESTED: tuple[tuple[int, int, int], tuple[int, int, int]] = ((1, 16, 0), (1, 17, 0))
#: The installed TRL's ``(major, minor, patch)``, or ``None``.
installed_version = functools.partial(_installed_version, "trl")
#: Raise :class:`~streamsync.errors.UnsupportedVersionError` unless a version is in
#: :data:`TESTED`.
check_version = functools.partial(check_tested, "TRL", tested=TESTED)

check_version(installed_version())


def rollout_loop_kwargs(worker: Any) -> dict[str, Any] | None:
    """The arguments TRL's ``AsyncRolloutWorker`` hands its generation loop (``lora_name``
    among them), or ``None`` when ``worker`` is not TRL's."""
    kwargs = getattr(worker, "_loop_kwargs", None)
    return kwargs if isinstance(kwargs, dict) and "lora_name" in kwargs else None


def started(worker: Any) -> bool:
    """Whether TRL's rollout worker has started its child process."""
    return getattr(worker, "_process", None) is not None
