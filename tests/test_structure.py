"""The package's shape, checked from its source: no import cycles among tierfs's modules, nor
among its folders (a cycle makes the order of imports matter and hides which part depends on
which); the file system's sub-packages importing only those below them; and no
product module imports the developer tooling (`tierfs.devtools`) but the demo, which runs on its
local servers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

PACKAGE = Path(__file__).resolve().parent.parent / "tierfs"


def module_imports(typing_only: bool = True) -> dict[str, set[str]]:
    """Each tierfs module -> the tierfs modules it imports (at the top or inside a function;
    with `typing_only` False, not those imported only for type checking)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = set() if typing_only else {
            id(inner) for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for inner in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
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
    for outer in ("tierfs.replication", "tierfs.s3tier", "tierfs.mount_helper", "tierfs.observe"):
        assert importers(outer, "tierfs.fs") == set(), outer


def test_the_file_system_reports_to_a_port() -> None:
    """fs reports events through its `EventSink` port: it imports neither the observer nor
    the metrics library, which would tie the core to them."""
    for path in (PACKAGE / "fs").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("prometheus_client"), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("prometheus_client") for a in node.names), path


# The file system's sub-packages, from the ground up: each imports only those before it here
# (namespace.py, at fs's root, composes the layers below it for the FUSE face above).
FS_LAYERS = ("store", "model", "tree", "lifecycle", "namespace", "fuse")


def fs_layer(module: str) -> str | None:
    """The layer of a module of tierfs.fs (None for fs's own __init__ and for other modules)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["tierfs", "fs"] else None


def arrows_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports from a layer of fs to a layer above it."""
    return sorted((name, other) for name, imported in graph.items() for other in imported
                  if fs_layer(name) and fs_layer(other)
                  and FS_LAYERS.index(fs_layer(other)) > FS_LAYERS.index(fs_layer(name)))


def test_the_layer_check_sees_an_arrow_up() -> None:
    graph = {"tierfs.fs.tree.tree": {"tierfs.fs.model.nodes"},
             "tierfs.fs.model.nodes": {"tierfs.fs.lifecycle.commits"}}
    assert arrows_up(graph) == [("tierfs.fs.model.nodes", "tierfs.fs.lifecycle.commits")]


def test_fs_sub_packages_import_only_downward() -> None:
    graph = module_imports()
    fs_modules = {name for name in graph if name.startswith("tierfs.fs.")}
    assert {fs_layer(name) for name in fs_modules} == set(FS_LAYERS)  # every module in a layer
    assert arrows_up(graph) == []


def folders(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The import graph between folders: each module stands for its name's first `depth` parts
    (depth 2: tierfs.fs, tierfs.observe, tierfs.mount_helper...; 3: tierfs.fs.lifecycle,
    tierfs.fs.store...)."""
    folded: dict[str, set[str]] = {}
    for name, imported in graph.items():
        folder = ".".join(name.split(".")[:depth])
        folded.setdefault(folder, set())
        for other in imported:
            other_folder = ".".join(other.split(".")[:depth])
            folded.setdefault(other_folder, set())
            if other_folder != folder:
                folded[folder].add(other_folder)
    return folded


def test_the_folder_check_sees_a_cycle() -> None:
    graph = {"tierfs.a.x": {"tierfs.b.y"}, "tierfs.b.z": {"tierfs.a.w"}, "tierfs.b.y": set(),
             "tierfs.a.w": set()}
    assert cycles(graph) == []
    assert cycles(folders(graph, 2)) == [["tierfs.a", "tierfs.b"]]


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_no_import_cycles_between_folders(depth: int) -> None:
    """An import from a folder into one that imports it back (the observer and the file system,
    the command line and the demo) is an arrow running back up, whichever module holds it."""
    assert cycles(folders(module_imports(), depth)) == []


def longest_chain(graph: dict[str, set[str]], among: str) -> list[str]:
    """The longest path of imports between the modules whose names start with `among`."""
    inside = {name: {other for other in imported if other.startswith(among)}
              for name, imported in graph.items() if name.startswith(among)}
    longest: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:
        if name not in longest:
            longest[name] = [name, *max((chain(other) for other in inside[name]), key=len,
                                        default=[])]
        return longest[name]

    return max((chain(name) for name in inside), key=len)


def test_the_chain_of_imports_inside_fs_stays_short() -> None:
    """A module of fs imports at run time what it builds or calls, and the types it is handed
    only for type checking: the chain a reader follows to load one module stays short (print
    it with `python -m tests.test_structure`)."""
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}, "") == ["a", "b", "c"]
    assert len(longest_chain(module_imports(typing_only=False), "tierfs.fs.")) <= 8
    # with the types: the parts of fs.lifecycle name one another by the ports of
    # fs.model.ports, not by their classes (was 17 modules before them)
    assert len(longest_chain(module_imports(typing_only=True), "tierfs.fs.")) <= 12


if __name__ == "__main__":
    for typing_only in (False, True):
        found = longest_chain(module_imports(typing_only), "tierfs.fs.")
        print(f"{len(found)} modules, {'with' if typing_only else 'without'} the imports made "
              f"only for type checking: {' -> '.join(found)}")


# The daemon's own timer: when the process's garbage collector runs its full passes.
DAEMON_TIMERS = {"collection.py"}


def paced_calls(source: str) -> list[str]:
    """The calls in `source` that pace work: a fixed sleep, a retry policy's pause or delay,
    or a retry policy made (`RetryPolicy(...)`, `.capped`, `.limited`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name in ("trio.sleep", "RetryPolicy") or name.rsplit(".", 1)[-1] in (
                "pause", "delay", "capped", "limited"):
            found.append(name)
    return found


def test_the_pacing_check_sees_a_retry_loop() -> None:
    assert paced_calls("async def f():\n    while True:\n        await trio.sleep(0.5)\n"
                       "        await CATCH_UP.pause(2)\n") == ["trio.sleep", "CATCH_UP.pause"]


def test_the_daemon_package_holds_no_policy() -> None:
    """`tierfs.mount_helper.daemon` builds and connects parts: how often work is retried or
    polled, and in what order copies and uploads go, are the parts' own (`tierfs.retry`,
    `tierfs.replication`, the core), so no module of the daemon paces work, and none defines
    the replica-count rule (`placement.copies_wanted`)."""
    daemon = PACKAGE / "mount_helper" / "daemon"
    for path in sorted(daemon.glob("*.py")):
        source = path.read_text()
        if path.name not in DAEMON_TIMERS:
            assert paced_calls(source) == [], path.name
        assert "replicas + 1" not in source and "min(self.cfg.replicas" not in source, path.name


# Where the Tree's parts are handed to the collaborators that use them (Core and Namespace).
PARTS_HANDED_OUT = {"fs/namespace.py"}


def tree_parts() -> set[str]:
    """The parts `Tree.__init__` builds: its attributes made by a constructor of fs/tree
    (`self._residents = Residents(...)`), by name without the underscore."""
    source = ast.parse((PACKAGE / "fs" / "tree" / "tree.py").read_text())
    of_tree = {alias.asname or alias.name for node in ast.walk(source)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                   "tierfs.fs.tree.") for alias in node.names}
    init = next(node for node in ast.walk(source) if isinstance(node, ast.ClassDef)
                and node.name == "Tree").body
    init_def = next(node for node in init if isinstance(node, ast.FunctionDef)
                    and node.name == "__init__")
    return {target.attr.removeprefix("_") for node in ast.walk(init_def)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
            and node.value.func.id in of_tree
            for target in node.targets if isinstance(target, ast.Attribute)
            and ast.unparse(target.value) == "self"}


def reach_throughs(source: str, parts: set[str]) -> list[str]:
    """`tree.<part>` or `<x>.tree.<part>` in `source`: a Tree part taken from the Tree."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in parts
            and (isinstance(node.value, ast.Name) and node.value.id == "tree"
                 or isinstance(node.value, ast.Attribute) and node.value.attr == "tree")]


def test_the_reach_through_check_sees_one() -> None:
    assert reach_throughs("self.tree.residents.drop(x)\nns.tree.find_step(p)\n"
                          "tree.holdings.copies(s)\n", {"residents", "holdings"}) == [
        "self.tree.residents", "tree.holdings"]


def test_tree_parts_are_handed_out_not_reached_through() -> None:
    """A collaborator of the Tree is given the parts it uses (by its constructor) instead of
    reaching them through the Tree: outside fs/tree only the assembly of the namespace names
    a Tree part through the Tree."""
    parts = tree_parts()
    assert {"residents", "sealing", "holdings", "identity"} <= parts
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("fs/tree/") or rel in PARTS_HANDED_OUT:
            continue
        if reached := reach_throughs(path.read_text(), parts):
            found[rel] = reached
    assert found == {}


# What the FUSE layer and the daemon are given of the namespace besides its methods: the
# read-only view of the tree, the checks (`tierfs verify`), what start-up found, the owners of
# background and foreground work, the event sink (`copies`, the tiers' port, is a property).
# Everything else Core and Namespace hold is a collaborator of theirs.
NAMESPACE_FACES = {"view", "verifier", "recovered", "background", "foreground", "events"}


def namespace_collaborators() -> set[str]:
    """The attributes `Core.__init__` and `Namespace.__init__` set that are not faces, by
    name without the underscore."""
    source = ast.parse((PACKAGE / "fs" / "namespace.py").read_text())
    found = set()
    for cls in (node for node in source.body if isinstance(node, ast.ClassDef)
                and node.name in ("Core", "Namespace")):
        init = next(node for node in cls.body if isinstance(node, ast.FunctionDef)
                    and node.name == "__init__")
        found |= {target.attr.removeprefix("_") for node in ast.walk(init)
                  if isinstance(node, ast.Assign) for target in node.targets
                  for target in ast.walk(target) if isinstance(target, ast.Attribute)
                  and ast.unparse(target.value) == "self"}
    return found - NAMESPACE_FACES


def namespace_reaches(source: str, collaborators: set[str]) -> list[str]:
    """`<namespace>.<collaborator>` in `source` (its holder named namespace, ns or core, as a
    name or an attribute; the collaborator with or without its underscore)."""
    holders = {"namespace", "_namespace", "ns", "_ns", "core", "_core"}
    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute)
            and node.attr.removeprefix("_") in collaborators
            and (isinstance(node.value, ast.Name) and node.value.id in holders
                 or isinstance(node.value, ast.Attribute) and node.value.attr in holders)]


def test_the_namespace_reach_check_sees_one() -> None:
    assert sorted(namespace_reaches("self.ns.fetch_back.fetch_whole(n)\ncore.tree\n"
                                    "ns.view.steps()\nnamespace._tiers.x\nself.tree.x\n",
                                    {"fetch_back", "tree", "tiers"})) == [
        "core.tree", "namespace._tiers", "self.ns.fetch_back"]


def test_the_namespace_is_the_one_way_in() -> None:
    """The FUSE layer and the daemon call Namespace's methods and use its faces (the tree's
    view, the tiers' port): none reaches one of its collaborators (Eviction, Commits...)."""
    collaborators = namespace_collaborators()
    assert {"fetch_back", "eviction", "commits", "tree", "store", "deletes",
            "versions"} <= collaborators
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != "fs/namespace.py" and (
                reached := sorted(set(namespace_reaches(path.read_text(), collaborators)))):
            found[rel] = reached
    assert found == {}
