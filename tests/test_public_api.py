"""The public surface is the documented one: each public module's ``__all__`` lists exactly
the names the README, ``docs/`` and ``examples/`` import or name as API, every listed name
imports, and no other module of the package declares ``__all__``.

A name is public from one module only: the errors, ``Sender`` / ``Receiver`` and
``open_sender`` / ``open_receiver`` from :mod:`streamsync` (as ``ss.UnknownTensorError``,
``ss.open_sender``), not also from :mod:`streamsync.errors` or :mod:`streamsync.transports`.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import streamsync
import streamsync as ss
from streamsync import errors

PACKAGE = Path(streamsync.__file__).parent

ERRORS = [
    "AuthenticationError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "DeltaBaseError",
    "DtypeMismatchError",
    "DuplicateTensorError",
    "EndOfStream",
    "LoraError",
    "PartialCommitError",
    "PeerBrokenError",
    "ProtocolVersionError",
    "ReceiverFailedError",
    "SenderAbortedError",
    "ShapeMismatchError",
    "StaleSyncError",
    "StreamsyncError",
    "SyncInProgressError",
    "SyncTimeoutError",
    "UnknownTensorError",
    "UnsupportedVersionError",
    "WireFormatError",
]

PUBLIC: dict[str, list[str]] = {
    "streamsync": [
        "DEFAULT_TIMEOUT",
        "AbortableSink",
        "DeltaReport",
        "LoadResult",
        "LoraReport",
        "ModuleSink",
        "Receiver",
        "Sender",
        "Sink",
        "SyncReport",
        "TargetSink",
        "adapter",
        "named_tensors",
        "open_receiver",
        "open_sender",
        "receive",
        "send",
        *ERRORS,
    ],
    "streamsync.adapters": [
        "BufferSink",
        "bucket",
        "cast",
        "expand_moe",
        "quantize_fp8",
        "rename",
        "select",
        "split_buffers",
    ],
    # For a transport of your own (docs/transports.md, docs/ARCHITECTURE.md).
    "streamsync.transports": ["Endpoint", "Option", "Transport"],
    "streamsync.testing": [
        "FakeConfig",
        "FakeVllmModel",
        "LoadWeightsSink",
        "TransportConformance",
        "fake_named_tensors",
        "fake_state_dict",
        "sync",
    ],
    "streamsync.testing.models": ["build_tiny_model", "perturb"],
    "streamsync.vllm": [
        "BlockingVllmSync",
        "PauseMode",
        "RankPeer",
        "Ranks",
        "WeightSync",
        "WorkerExtension",
        "WorkerOptions",
        "update_weights",
    ],
    # register: the vllm.general_plugins entry point.
    "streamsync.vllm.native": [
        "AsyncLLMWeightSyncClient",
        "StreamsyncInitInfo",
        "register",
        "weight_source",
    ],
    # An engine in a Ray actor: the handle goes to WeightSync; the address to bind.
    "streamsync.vllm.ray": ["node_address"],
    "streamsync.integrations.trl": ["WeightTransfer"],
    # The engine seam, for another engine (docs/vllm.md, "Another engine").
    "streamsync.engine.channel": ["EngineChannel"],
    "streamsync.engine.clients": ["EngineClient"],
    "streamsync.engine.messages": ["WorkerResult"],
    "streamsync.engine.worker": ["WorkerReceivers"],
}

# Importing it imports vLLM (it registers the backend with vLLM's factories), or Ray.
NEEDS_VLLM = {"streamsync.vllm.native", "streamsync.vllm.ray"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _declared_all() -> dict[str, list[Any]]:
    """Every module of the package that assigns ``__all__`` anywhere, read from its source
    (nothing imported), with the literal it assigns (``None`` where it is not a literal)."""
    found: dict[str, list[Any]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets, value = [node.target], node.value
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                try:
                    literal = ast.literal_eval(value) if value is not None else None
                except ValueError:
                    literal = None
                found.setdefault(_module_name(path), []).append(literal)
    return found


def _imported(name: str) -> ModuleType:
    return importlib.import_module(name)


def _param(name: str) -> Any:
    return pytest.param(name, marks=pytest.mark.vllm) if name in NEEDS_VLLM else name


def test_only_the_public_modules_declare___all__() -> None:
    declared = _declared_all()
    assert sorted(declared) == sorted(PUBLIC)
    for name, assignments in declared.items():
        assert len(assignments) == 1, f"{name} assigns __all__ {len(assignments)} times"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_module_lists_exactly_its_documented_names(name: str) -> None:
    """Read from the source, so modules that import vLLM are checked without it."""
    (listed,) = _declared_all()[name]
    assert isinstance(listed, list)
    assert len(set(listed)) == len(listed), f"{name}.__all__ repeats a name"
    assert sorted(listed) == sorted(PUBLIC[name])


@pytest.mark.parametrize("name", [_param(n) for n in sorted(PUBLIC)])
def test_every_listed_name_imports_and_says_what_it_is(name: str) -> None:
    module = _imported(name)
    assert sorted(module.__all__) == sorted(PUBLIC[name])
    star: dict[str, Any] = {}
    exec(f"from {name} import *", star)
    assert sorted(k for k in star if k != "__builtins__") == sorted(PUBLIC[name])
    for attr in PUBLIC[name]:
        obj = getattr(module, attr)
        assert star[attr] is obj
        if inspect.isclass(obj) or callable(obj):
            doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
            assert doc and doc.strip(), f"{name}.{attr} has no docstring"


def test_a_public_object_has_one_public_path() -> None:
    paths: dict[int, list[str]] = {}
    for name in sorted(set(PUBLIC) - NEEDS_VLLM):
        module = _imported(name)
        for attr in PUBLIC[name]:
            obj = getattr(module, attr)
            if inspect.isclass(obj) or callable(obj):
                paths.setdefault(id(obj), []).append(f"{name}.{attr}")
    assert [p for p in paths.values() if len(p) > 1] == []


def test_every_streamsync_error_is_public_from_the_root() -> None:
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.StreamsyncError)
    }
    assert defined == set(ERRORS)
    assert all(getattr(streamsync, name) is getattr(errors, name) for name in ERRORS)


def test_the_old_path_of_ranks_warns_and_gives_the_same_classes() -> None:
    import streamsync.engine.ranks as old
    from streamsync.vllm import RankPeer, Ranks

    with pytest.warns(DeprecationWarning, match="import it from streamsync.vllm"):
        assert old.Ranks is Ranks
    with pytest.warns(DeprecationWarning, match="import it from streamsync.vllm"):
        assert old.RankPeer is RankPeer
    with pytest.raises(AttributeError, match="Exchange"):
        old.Exchange  # noqa: B018  (only the public names moved)


def test_each_channel_method_is_declared_once_and_the_blocking_face_derives_it() -> None:
    from streamsync.engine.blocking import two_faced
    from streamsync.engine.channel import BlockingWeightSync, EngineChannel

    declared = vars(EngineChannel)
    public = {
        name
        for name, value in declared.items()
        if not name.startswith("_")
        and (inspect.iscoroutinefunction(value) or isinstance(value, two_faced))
    }
    # aclose is the blocking face's close(); sync_round is the lifecycles' seam.
    faced = public - {"aclose", "sync_round"}
    assert faced and all(isinstance(declared[name], two_faced) for name in faced)
    derived = {n for n, v in vars(BlockingWeightSync).items() if isinstance(v, two_faced)}
    assert derived == faced

    class OneWorker:
        receivers = 1

    channel = EngineChannel(OneWorker(), "memory://faces")  # type: ignore[arg-type]
    face = BlockingWeightSync(channel)
    for name in faced:  # the blocking call is the channel's, signature and docstring
        blocking, coroutine = getattr(face, name), getattr(channel, name)
        assert blocking.__doc__ == coroutine.__doc__
        assert inspect.signature(blocking) == inspect.signature(coroutine)
    with pytest.raises(ss.ConfigError, match=r"sync.drop\(...\) blocks.*'await sync.drop"):
        asyncio.run(_in_a_loop(face.drop))


async def _in_a_loop(call: Any) -> Any:
    return call()
