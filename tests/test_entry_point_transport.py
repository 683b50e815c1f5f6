"""A transport from a separate distribution, found by its entry point, passes the
conformance suite.

``tests/fixtures/relay_transport`` is a distribution of its own (``streamsync-relay``) that
declares ``relay`` in the ``streamsync.transports`` entry-point group, as the built-ins do in
streamsync's ``pyproject.toml``. The test installs it with pip into a directory put on
``sys.path`` (the children the suite spawns inherit it), and nothing registers it by hand.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamsync.testing.conformance import TransportConformance
from streamsync.transports import schemes

FIXTURE = Path(__file__).parent / "fixtures" / "relay_transport"
_ids = itertools.count()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``streamsync-relay`` installed (a built wheel, its entry points) into a fresh
    directory on ``sys.path``; removed from it afterwards."""
    tmp = tmp_path_factory.mktemp("relay")
    source, target = tmp / "src", tmp / "site"
    shutil.copytree(FIXTURE, source)  # the build writes next to the sources
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    assert "relay" not in schemes()
    sys.path.insert(0, str(target))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), old]))
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        schemes()  # forget it


def test_the_installed_transport_is_found_by_its_entry_point(installed: Path) -> None:
    assert "relay" in schemes()
    from streamsync.transports import open_sender

    assert type(open_sender("relay://found")).__name__ == "LinkedSender"


@pytest.mark.slow
@pytest.mark.usefixtures("installed")
class TestRelayFromItsOwnDistribution(TransportConformance):
    def make_url(self, tag: str) -> str:
        return f"relay://{tag}-{os.getpid()}-{next(_ids)}"
