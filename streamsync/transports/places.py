"""Where a transport's channel is: a ``HOST:PORT`` URL target, a CUDA device."""

from __future__ import annotations

import socket
from typing import Any

import torch

from streamsync.errors import ConfigError


def host_port(scheme: str, target: str, *, bind: bool) -> tuple[str, int]:
    """``HOST:PORT`` of a URL target (HOST defaults to 127.0.0.1; ``*``, every interface,
    only where the side binds)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{scheme}://{target}: expected {scheme}://HOST:PORT")
    host = host or "127.0.0.1"
    if host == "*" and not bind:
        raise ConfigError(f"{scheme}://{target}: a receiver needs the sender's host, not '*'")
    return host, int(port)


#: Hosts that bind every interface: no peer can connect to them by that name.
WILDCARDS = ("*", "0.0.0.0", "::", "")


def told_host(host: str) -> str:
    """The host a sender bound on ``host`` tells its receivers: ``host`` itself, or, for a
    wildcard, this machine's address on its default route (what receivers on other machines
    reach; no packet is sent), else its hostname's address."""
    if host not in WILDCARDS:
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 9))
            return str(probe.getsockname()[0])
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def cuda_device(url: str, device: Any, *, instead: str) -> torch.device:
    """The CUDA device ``device`` names (default the current one), with its index; a
    ``ConfigError`` naming ``instead`` (the transport to use) where there is no CUDA."""
    if not torch.cuda.is_available():
        raise ConfigError(f"{url}: CUDA is not available in this process; use {instead} instead")
    dev = torch.device(device if device is not None else "cuda")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
