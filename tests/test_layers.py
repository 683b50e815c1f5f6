"""Layers run one way: the transports know bytes, slots and peers, never the sync protocol's
state. No module under ``streamsync/transports/`` imports the delta baseline, the replay
plans, either side of a sync or the receiver's unpacker, at module level or inside a
function. Read from the source (nothing imported), so a cycle cannot hide one."""

from __future__ import annotations

import ast
from pathlib import Path

import streamsync

PACKAGE = Path(streamsync.__file__).parent
TRANSPORTS = PACKAGE / "transports"

#: Modules of the sync layer a transport must not import, nor anything under them.
SYNC_LAYER = (
    "streamsync._channel",
    "streamsync._delta",
    "streamsync._replay",
    "streamsync.sending",
    "streamsync.receiving",
    # The receiver's unpacker (a transport may use the bucket's packing, wire/pack.py).
    "streamsync.wire.unpack",
)


def _within(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module an ``from ... import`` names, resolved against ``package`` if relative."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def layer_violations(source: str, package: str = "streamsync.transports") -> list[str]:
    """Each import in ``source`` (a module of ``package``; every import in it, those inside
    functions and ``if TYPE_CHECKING:`` included) of the sync layer."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if any(_within(alias.name, layer) for layer in SYNC_LAYER):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
            names = [alias.name for alias in node.names]
            # ``from streamsync import sending`` names the module as an attribute.
            named = [module, *(f"{module}.{name}" for name in names)]
            if any(_within(m, layer) for m in named for layer in SYNC_LAYER):
                found.append(f"line {node.lineno}: from {module} import {', '.join(names)}")
    return found


def _package_of(path: Path) -> str:
    """The package a module's relative imports resolve against."""
    return ".".join(path.relative_to(PACKAGE.parent).parts[:-1])


def test_no_transport_imports_the_sync_layer() -> None:
    modules = sorted(TRANSPORTS.rglob("*.py"))
    assert len(modules) > 10  # the scan sees the transports
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in modules
        if (hits := layer_violations(path.read_text(), _package_of(path)))
    }
    assert found == {}


def test_the_scan_finds_each_kind_of_import_of_the_sync_layer() -> None:
    # The same scan on sources that break the rule, each in another form.
    breaking = [
        "from streamsync._delta import Baseline",
        "import streamsync._replay",
        "from streamsync.wire.unpack import Unpacker",
        "from streamsync.wire.unpack import *",
        "import streamsync.wire.unpack",
        "from streamsync.wire import unpack",
        "from streamsync import sending",
        "from ..receiving import receive",
        "from .._channel import receiver_state",
        "def later():\n    from streamsync.receiving import receive\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from streamsync._replay import BucketPlans\n",
    ]
    for source in breaking:
        assert len(layer_violations(source)) == 1, source
    # What a transport may import is not flagged.
    allowed = [
        "from streamsync.wire.pack import Bucket",
        "from streamsync.wire.slot import allocate_slot",
        "from streamsync.wire.frames import BucketHeader",
        "from . import handshake",
        "from streamsync.errors import ConfigError",
        "import streamsync.transports.ring",
    ]
    for source in allowed:
        assert layer_violations(source) == [], source
