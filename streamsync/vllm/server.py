"""HTTP calls to a vLLM server's routes, as the ``streamsync`` backend's trainer and TRL's
weight transfer make them, with the server's failures mapped to streamsync's errors in one
place."""

from __future__ import annotations

from typing import Any

from streamsync.errors import (
    ConfigError,
    PeerBrokenError,
    ReceiverFailedError,
    StreamsyncError,
    SyncTimeoutError,
)

#: The name of the backend in vLLM's factories and in ``--weight-transfer-config``.
BACKEND = "streamsync"
#: The server flag that selects the ``streamsync`` backend (the ``vllm.general_plugins``
#: entry point of an installed streamsync registers it in the server's processes).
SERVER_FLAG = """--weight-transfer-config '{"backend": "streamsync"}'"""
#: What the server's RL routes need it started with.
DEV_MODE = f"VLLM_SERVER_DEV_MODE=1 (its RL routes need it) and {SERVER_FLAG}"


def call(
    base_url: str,
    method: str,
    route: str,
    *,
    timeout: float,
    needs: str = DEV_MODE,
    error: type[StreamsyncError] = ReceiverFailedError,
    what: str | None = None,
    **kwargs: Any,
) -> Any:
    """``method /route`` on the vLLM server at ``base_url``; its ``requests`` response.

    Raises:
        SyncTimeoutError: no answer within ``timeout`` seconds.
        PeerBrokenError: the server cannot be reached.
        ConfigError: the server has no such route (``error`` where that is not
            :class:`ReceiverFailedError`); the message says to start it with ``needs``.
        StreamsyncError: ``error``, naming ``what`` (default: the method and route), with the
            server's status and answer, when it failed the call.
    """
    import requests

    where = f"the vLLM server at {base_url}"
    what = what or f"{method} /{route}"
    try:
        response = requests.request(method, f"{base_url}/{route}", timeout=timeout, **kwargs)
    except requests.Timeout as exc:
        raise SyncTimeoutError(f"{where} did not answer {what} within {timeout:g} s") from exc
    except requests.RequestException as exc:
        raise PeerBrokenError(
            f"{where} cannot be reached ({what}: {type(exc).__name__}: {exc}); check that it "
            "runs and that this machine reaches it"
        ) from exc
    if response.status_code == 404:
        missing = ConfigError if error is ReceiverFailedError else error
        raise missing(f"{where} has no {method} /{route} route: start it with {needs}")
    if not response.ok:
        raise error(
            f"{where} failed {what} (HTTP {response.status_code}): {response.text.strip()[:1000]}"
        )
    return response
