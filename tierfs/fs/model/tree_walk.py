"""Walking the tree of `Node`s: which files, directories and steps lie below or above a node.

Pure functions of the nodes (no RAM store, no state of their own), shared by the core and every
collaborator that has to find its way in the tree (`fs.tree.tree`, `fs.lifecycle.commits`,
`fs.lifecycle.fetch_back`...).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tierfs import layout

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import Node, StepState


def node_at(root: Node, relpath: str) -> Node | None:
    """The entry at `relpath` below `root`, None if there is none."""
    node = root
    for part in relpath.split("/") if relpath else ():
        children = node.children
        node = children.get(os.fsencode(part)) if children is not None else None
        if node is None:
            return None
    return node


def entry_node(step_node: Node, name: str) -> Node | None:
    """The file node of a manifest entry, if it is in the tree."""
    if step_node.is_file:
        return step_node if os.fsencode(name) == step_node.name else None
    node = step_node
    for part in name.split("/"):
        if node.children is None:
            return None
        node = node.children.get(os.fsencode(part))
        if node is None:
            return None
    return node if node.is_file else None


def files_under(dir_node: Node, prefix: str = "") -> Iterator[tuple[str, Node]]:
    """Every file below `dir_node` with its path relative to it, in name order (a single-file
    step: the file itself, by its name)."""
    if dir_node.is_file:
        yield prefix + os.fsdecode(dir_node.name), dir_node
        return
    for name, node in sorted(dir_node.children.items()):
        rel = prefix + os.fsdecode(name)
        if node.is_file:
            yield rel, node
        elif node.is_dir:
            yield from files_under(node, rel + "/")


def walk_files(dir_node: Node) -> Iterator[Node]:
    """Every file below `dir_node`, in no particular order (cheaper than `files_under`): the
    node itself if it is a file, none if it is neither a file nor a directory."""
    if dir_node.is_file:
        yield dir_node
    elif dir_node.is_dir:
        yield from walk_kind(dir_node, stat.S_IFREG)


def walk_kind(dir_node: Node, kind: int) -> Iterator[Node]:
    """Every entry of this file type below the directory `dir_node`, in no order."""
    stack = [dir_node]
    while stack:
        for child in stack.pop().children.values():
            if child.children is not None:
                stack.append(child)
            elif child.kind == kind:
                yield child


def dirs_under(node: Node) -> Iterator[Node]:
    """Every directory below `node`, parents before their children."""
    stack = [c for c in node.children.values() if c.is_dir]
    while stack:
        below = stack.pop()
        yield below
        stack.extend(c for c in below.children.values() if c.is_dir)


def steps_under(node: Node) -> Iterator[Node]:
    """Every step at or below `node`, depth first: step directories and single-file steps."""
    stack = [node]
    while stack:
        node = stack.pop()
        if node.step is not None:
            yield node  # nothing inside a step is a step
            continue
        stack.extend(c for c in node.children.values()
                     if c.children is not None or c.step is not None)


def enclosing_steps(node: Node | None) -> Iterator[Node]:
    """The steps `node` is (or is in), innermost first."""
    while node is not None:
        if node.step is not None:
            yield node
        node = node.parent


def path_in_step(node: Node) -> str | None:
    """`node`'s path in the innermost step it is or lies in (`files_under`'s name for it), or
    None outside every step."""
    step_node = next(enclosing_steps(node), None)
    if step_node is None:
        return None
    return os.fsdecode(node.name) if step_node is node else _path_below(step_node, node)


def in_a_step(node: Node | None) -> bool:
    """Whether `node` is a step or lies inside one."""
    return next(enclosing_steps(node), None) is not None


def holds(step_node: Node, node: Node | None) -> bool:
    """Whether `node` is `step_node` or below it."""
    while node is not None:
        if node is step_node:
            return True
        node = node.parent
    return False


def committed_step_holding(node: Node) -> StepState | None:
    """The step `node` belongs to, if that step is committed."""
    for step_node in enclosing_steps(node):
        return step_node.step if step_node.step.committed else None
    return None


def has_active_writers(dir_node: Node) -> bool:
    return any(node.active_writers for node in walk_files(dir_node))


def busy(step_node: Node) -> bool:
    """A file of the step is open, or bytes of one are on their way in."""
    return any(n.handles or (n.fetch and n.fetch.busy) for n in walk_files(step_node))


def dirs_with_links(node: Node, at: str) -> list[tuple[str, str]]:
    """For a rename of `node` (at `at`): (the path below it, or "", the path) of every
    directory whose links it moves: the node's own directory if it is a link, else the
    directories at or below it holding links."""
    if node.kind == stat.S_IFLNK:
        return [("", at.rpartition("/")[0])]
    if not node.is_dir:
        return []
    found = []
    for directory in (node, *dirs_under(node)):
        if any(c.kind == stat.S_IFLNK for c in directory.children.values()):
            below = _path_below(node, directory)
            found.append((below, layout.join(at, below) if below else at))
    return found


def path_below(top: Node, node: Node) -> str | None:
    """The path of `node` relative to `top` ("" for `top` itself), None if `top` does not
    hold it (any more)."""
    parts = []
    at: Node | None = node
    while at is not top:
        if at is None:
            return None
        parts.append(at.name)
        at = at.parent
    return os.fsdecode(b"/".join(reversed(parts)))


def _path_below(top: Node, node: Node) -> str:
    """`path_below` of a node `top` holds."""
    path = path_below(top, node)
    assert path is not None
    return path
