"""The shared conformance suite (:mod:`streamsync.testing.conformance`) applied to every
built-in transport that runs on this machine."""

from __future__ import annotations

import itertools
import os

import pytest

from streamsync.testing.conformance import TransportConformance
from streamsync.testing.peers import free_port
from streamsync.transports.zeromq import zmq_address

_ids = itertools.count()


def _fresh(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{next(_ids)}"


class TestMemory(TransportConformance):
    cross_process = False

    def make_url(self, tag: str) -> str:
        return f"memory://{_fresh(tag)}"


@pytest.mark.slow
class TestSharedMemory(TransportConformance):
    def make_url(self, tag: str) -> str:
        return f"shm://{_fresh(tag)}"


@pytest.mark.slow
class TestZmqTcp(TransportConformance):
    def make_url(self, tag: str) -> str:
        return f"zmq+tcp://127.0.0.1:{free_port()}"


@pytest.mark.slow
class TestZmqIpc(TransportConformance):
    def make_url(self, tag: str) -> str:
        return f"zmq+ipc://{_fresh(tag)}"

    def resource_paths(self, url: str) -> list[str]:
        return [zmq_address("zmq+ipc", url.split("://", 1)[1].split("?")[0], bind=True)[6:]]


@pytest.mark.slow
class TestSharedMemoryWithSecret(TransportConformance):
    sender_options = {"secret": b"conformance-secret"}  # noqa: RUF012
    receiver_options = {"secret": b"conformance-secret"}  # noqa: RUF012

    def make_url(self, tag: str) -> str:
        return f"shm://{_fresh(tag)}"


@pytest.mark.slow
class TestTorchGloo(TransportConformance):
    # One process group per channel, of a fixed size: a receiver that leaves ends it.
    replaces_receivers = False

    def make_url(self, tag: str) -> str:
        return f"torch+gloo://127.0.0.1:{free_port()}"
