"""The package's shape, checked from its source: no import cycles among tierfs's modules (a
cycle makes the order of imports matter and hides which part depends on which), and no
product module imports the developer tooling (`tierfs.devtools`) but the demo, which runs on its
local servers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

PACKAGE = Path(__file__).resolve().parent.parent / "tierfs"


def module_imports() -> dict[str, set[str]]:
    """Each tierfs module -> the tierfs modules it imports (at the top or inside a function)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(other for other in named if other in modules and other != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    graph = module_imports()
    assert "tierfs.mount_helper.cli" in graph and graph["tierfs.mount_helper.cli"]
    assert cycles(graph) == []


def test_the_product_never_imports_devtools() -> None:
    importers = {name for name, imported in module_imports().items()
                 if not name.startswith(("tierfs.devtools", "tierfs.demo"))
                 and any(other.startswith("tierfs.devtools") for other in imported)}
    assert importers == set()


def test_layers_depend_one_way() -> None:
    """coordination (etcd) never imports peers (bytes between nodes); the file system core
    imports neither, nor the persistent tier, nor the daemon: they are handed to it."""
    graph = module_imports()

    def importers(of: str, among: str) -> set[str]:
        return {name for name, imported in graph.items() if name.startswith(among)
                and any(other.startswith(of) for other in imported)}

    assert importers("tierfs.replication.peers", "tierfs.replication.coordination") == set()
    for outer in ("tierfs.replication", "tierfs.s3tier", "tierfs.mount_helper"):
        assert importers(outer, "tierfs.fs") == set(), outer
