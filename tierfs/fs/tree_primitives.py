"""What the parts of the tree's core (`fs.residents`, `fs.step_manifests`, `fs.step_identity`,
`fs.copy_on_write`) change the tree through: `fs.tree.Tree`'s primitives, as a Protocol, so
that `Tree` can hold its parts without their importing it (one-way dependencies, no cycle)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from tierfs.fs.nodes import Node, StepState
from tierfs.fs.ram_store import RamStore
from tierfs.fs.records import StepRecords


class TreePrimitives(Protocol):
    """`Tree`'s state and primitives its parts use (see `fs.tree` for the rules)."""

    store: RamStore
    records: StepRecords
    node_id: str

    def backing(self, node: Node) -> bytes: ...
    def relpath(self, node: Node) -> str: ...
    def records_path(self, step_node: Node) -> bytes: ...
    def data_dir(self, step: StepState) -> str: ...
    def steps(self, under: Node | None = None) -> Iterator[Node]: ...
    def attach(self, parent: Node, name: bytes, kind: int) -> Node: ...
    def mark_dirty(self, node: Node | None) -> None: ...
    def unlink_backing(self, path: bytes, node: Node) -> None: ...
    def remove_hidden(self, dir_node: Node, path: bytes) -> None: ...
