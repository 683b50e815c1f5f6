"""The package's modules import one another without cycles, counting imports inside functions.

A function-local import that closes a cycle only hides it: the two modules still need each
other, and which one loads first decides whether the other sees a half-built module. The scan
reads the source (nothing is imported), takes every import of a package module at module level
or inside a function, and leaves out only those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import streamsync

PACKAGE = Path(streamsync.__file__).parent


def _module_names(root: Path) -> dict[str, Path]:
    """Each module's dotted name (a package is its ``__init__``) mapped to its file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        # Under ``if TYPE_CHECKING:`` only the ``else:`` branch runs.
        skip = isinstance(child, ast.If) and _is_type_checking(child.test)
        for node in child.orelse if skip else [child]:  # type: ignore[attr-defined]
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            yield from _imports(node)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The modules ``node`` names explicitly (no implicit parent packages)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        # A relative import counts from the module's package: itself for an ``__init__``.
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        yield f"{base}.{alias.name}"
        yield base


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from the source under ``root``."""
    modules = _module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            is_package = path.name == "__init__.py"
            found = list(_targets(name, is_package, node))
            if isinstance(node, ast.Import):
                graph[name].update(target for target in found if target in modules)
                continue
            # ``from a import b``: pairs of (a.b, a); a.b when it is a module, else a.
            for submodule, base in zip(found[::2], found[1::2], strict=True):
                if submodule in modules:
                    graph[name].add(submodule)
                elif base in modules:
                    graph[name].add(base)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, and modules importing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        # Tarjan's algorithm; the package is small enough for recursion.
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "\n  ".join([" <-> ".join(component), *edges])


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(graph, c) for c in found)


def test_the_scan_covers_the_whole_package() -> None:
    graph = import_graph(PACKAGE)
    # cli/ and testing/ count too, and a function-local import is an edge like any other.
    assert "streamsync.cli" in graph and "streamsync.testing" in graph
    assert "streamsync.errors" in graph["streamsync.sources"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_scan_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import run\n",
            "pkg/a.py": "from pkg import b\n\ndef run():\n    return b.helper()\n",
            # The import back to ``a`` is inside a function: still a cycle.
            "pkg/b.py": "def helper():\n    from .a import run\n    return run\n",
            "pkg/sub/__init__.py": "",
            # A self-import through a relative path, and one the type checker alone sees.
            "pkg/sub/c.py": "from typing import TYPE_CHECKING\nfrom . import c\n"
            "if TYPE_CHECKING:\n    from pkg.sub import d\n",
            "pkg/sub/d.py": "from pkg.sub.c import thing\n",
        },
    )
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.sub.c"}
    assert graph["pkg.sub.d"] == {"pkg.sub.c"}
    # No implicit edge to a parent package: ``pkg.sub.d`` imports ``pkg.sub.c`` only.
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.sub.c"]]
