"""vLLM's and TRL's private code is used in one module per dependency, and each of those
refuses, by name, a version it was not tested with."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import streamsync
from streamsync.errors import UnsupportedVersionError

PACKAGE = Path(streamsync.__file__).parent
#: The one module per dependency allowed to touch its private code.
COMPAT = {
    "vllm": PACKAGE / "vllm" / "_compat.py",
    "trl": PACKAGE / "integrations" / "_trl_compat.py",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in PACKAGE.rglob("*.py")}


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every underscore name streamsync defines itself (its functions, classes, attributes
    and keys), which any of its modules may use on its own objects."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
    return {name for name in own if _private(name)}


def _imports(tree: ast.Module, dependency: str) -> list[tuple[int, str, list[str]]]:
    """Each import of ``dependency`` in ``tree``: its line, module and imported names."""
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == dependency:
            found.append((node.lineno, node.module or "", [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == dependency
            ]
    return found


def _private_uses(tree: ast.Module, own: set[str], *, handles_objects: bool) -> list[str]:
    """What in ``tree`` touches vLLM's or TRL's private code: an underscore name imported from
    them, and (in a module that handles their objects) an underscore attribute streamsync
    does not define itself, read, written or named to ``getattr``, or a ``__dict__`` write."""
    found: list[str] = []
    for dependency in COMPAT:
        for line, module, names in _imports(tree, dependency):
            if any(_private(p) for p in module.split(".")) or any(_private(n) for n in names):
                found.append(f"line {line}: import of {module} {names}")
    if not handles_objects:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
        ):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "__dict__"
        ):
            found.append(f"line {node.lineno}: .__dict__[...]")
    return found


def _handles_objects(path: Path, tree: ast.Module) -> bool:
    """Whether the module at ``path`` handles vLLM's or TRL's objects: it lives where those
    are handled, or imports either."""
    where = path.relative_to(PACKAGE).parts[0]
    return where in ("vllm", "integrations") or any(_imports(tree, d) for d in COMPAT)


def test_private_code_of_vllm_and_trl_is_touched_in_their_compat_modules_only() -> None:
    trees = _sources()
    # The compat modules' own names (a wrapper named as vLLM's method) are not streamsync's.
    own = _own_names({p: t for p, t in trees.items() if p not in COMPAT.values()})
    offenders = {
        str(path.relative_to(PACKAGE)): uses
        for path, tree in trees.items()
        if path not in COMPAT.values()
        for uses in [_private_uses(tree, own, handles_objects=_handles_objects(path, tree))]
        if uses
    }
    assert offenders == {}
    # The compat modules are where they are: the pin finds them there.
    for path in COMPAT.values():
        assert _private_uses(trees[path], set(), handles_objects=True)


def test_the_pin_finds_each_kind_of_private_access() -> None:
    source = """
from vllm.lora import _private_helper
from vllm._custom_ops import prepack
import trl._C
x = manager._adapter_manager
y = getattr(worker, "_loop_kwargs", None)
z = worker.__dict__["key"]
own._mine
"""
    found = _private_uses(ast.parse(source), {"_mine"}, handles_objects=True)
    assert [f.split(":")[0] for f in found] == [f"line {n}" for n in (2, 3, 4, 5, 6, 7)]


def test_the_vllm_compat_module_refuses_an_untested_vllm_by_name() -> None:
    pytest.importorskip("vllm")
    from streamsync.vllm import _compat

    low, high = _compat.TESTED
    _compat.check_version(low)
    _compat.check_version((low[0], low[1], low[2] + 7))
    for version in (high, (0, 31, 9), (1, 0, 0)):
        with pytest.raises(UnsupportedVersionError) as caught:
            _compat.check_version(version)
        message = str(caught.value)
        assert f"vLLM {'.'.join(map(str, version))} is installed" in message
        assert ">=0.32.0,<0.33.0" in message
    with pytest.raises(UnsupportedVersionError, match="vLLM unknown is installed"):
        _compat.check_version(None)
    assert isinstance(UnsupportedVersionError("x"), ImportError)


def test_the_trl_compat_module_refuses_an_untested_trl_by_name() -> None:
    pytest.importorskip("trl")
    from streamsync.integrations import _trl_compat

    low, high = _trl_compat.TESTED
    assert _trl_compat.installed_version() is not None
    _trl_compat.check_version(low)
    for version in (high, (1, 15, 2), (2, 0, 0)):
        with pytest.raises(UnsupportedVersionError) as caught:
            _trl_compat.check_version(version)
        message = str(caught.value)
        assert f"TRL {'.'.join(map(str, version))} is installed" in message
        assert ">=1.16.0,<1.17.0" in message


def _is_vars(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"


def _state_kept_elsewhere(tree: ast.Module) -> list[str]:
    """What in ``tree`` keeps streamsync's state outside its own objects: a module-level weak
    table or lock (state keyed by other objects), an attribute of streamsync's written onto
    another object, or a write into an object's ``__dict__``."""
    found: list[str] = []
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(value, ast.Call):
            called = ast.unparse(value.func)
            if called.endswith(("WeakKeyDictionary", "WeakValueDictionary", "Lock", "RLock")):
                found.append(f"line {node.lineno}: module-level {called}()")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if node.attr.startswith("_streamsync"):
                found.append(f"line {node.lineno}: .{node.attr} written")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__":
                found.append(f"line {node.lineno}: .__dict__[...] written")
            elif _is_vars(node.value):
                found.append(f"line {node.lineno}: vars(...)[...] written")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setdefault", "update", "__setitem__")
            and _is_vars(node.func.value)
        ):
            found.append(f"line {node.lineno}: vars(...).{node.func.attr}(...)")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
        ):
            found.append(f"line {node.lineno}: setattr(...)")
    return found


def test_vllm_and_trl_state_lives_in_streamsyncs_own_objects() -> None:
    """No module-level table keyed by other objects, and nothing written onto vLLM's, TRL's
    or the user's objects, where streamsync meets them, the compat modules included (the
    adapter store is the worker's, found by vLLM's wrapped loader without riding on vLLM's
    manager)."""
    offenders = {
        str(path.relative_to(PACKAGE)): found
        for path, tree in _sources().items()
        if path.relative_to(PACKAGE).parts[0] in ("vllm", "integrations")
        for found in [_state_kept_elsewhere(tree)]
        if found
    }
    assert offenders == {}


#: What the library-wide state pin lets stand, by module, and why.
STATE_ALLOWED: dict[str, list[str]] = {}


def test_the_library_keeps_no_state_outside_its_own_objects() -> None:
    """The same pin over the whole library (the package less the bench lab in ``cli/`` and
    the test helpers in ``testing/``): no module-level weak table or lock, no attribute of
    streamsync's written onto a user's model or engine (the delta version a model holds is
    kept by its receiver; ``update_weights``' kept channels by endpoint, in
    ``engine.kept.KEPT``)."""
    offenders = {
        where: found
        for path, tree in _sources().items()
        if path.relative_to(PACKAGE).parts[0] not in ("cli", "testing")
        for where in [str(path.relative_to(PACKAGE))]
        for found in [
            [
                f
                for f in _state_kept_elsewhere(tree)
                if f.split(": ", 1)[1] not in STATE_ALLOWED.get(where, [])
            ]
        ]
        if found
    }
    assert offenders == {}


def test_the_state_pin_finds_each_kind() -> None:
    source = """
import threading, weakref
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()
QUIRKS: dict[str, object] = {}
tensor._streamsync_owned = True
worker.__dict__["receivers"] = 1
setattr(llm, "channels", {})
vars(llm).setdefault("_streamsync_channels", {})
vars(llm)["channels"] = {}
"""
    found = _state_kept_elsewhere(ast.parse(source))
    assert [f.split(":")[0] for f in found] == [f"line {n}" for n in (3, 4, 6, 7, 8, 9, 10)]
