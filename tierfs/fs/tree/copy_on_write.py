"""Copy on write: committed objects are never written. A tree file whose inode is shared with
a committed object in `objects/` gets its own inode before it is opened for writing or
truncated, and one shared with other files before its mode, owner or mtime change:
`Namespace.make_private` makes the copy (in a thread, after room is made for it),
`replace_shared` swaps it in with no await. Part of the tree's core (see `fs.tree.tree`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import trio

from tierfs.fs.model.nodes import FsError, Node

if TYPE_CHECKING:
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.tree_primitives import TreePrimitives


class CopyOnWrite:
    """The copies on write of one mount's tree (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, *, store: RamStore) -> None:
        self.tree = tree
        self._store = store
        self._locks: dict[Node, trio.Lock] = {}

    @contextlib.asynccontextmanager
    async def lock(self, node: Node) -> AsyncIterator[None]:
        """One copy on write at a time per file: two writers of the same committed file must
        not each make a copy; writers of different files do not wait for each other."""
        lock = self._locks.setdefault(node, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._locks.pop(node, None)

    def shared_backing(self, node: Node) -> tuple[bytes, os.stat_result] | None:
        """The node's backing path and stat if its inode is shared with a committed object."""
        path = self.tree.backing(node)
        st = os.lstat(path)
        return (path, st) if st.st_nlink > 1 else None

    def shared_with_files(self, node: Node) -> bool:
        """Whether the node's inode is another file's too, beyond its own committed object
        (files of equal bytes and attributes linked to one object at a start): a change of
        its mode, owner or mtime would change theirs, so it gets its own inode first."""
        try:
            return os.lstat(self.tree.backing(node)).st_nlink > 2
        except FsError:
            return False  # its name is gone

    def replace_shared(self, node: Node, path: bytes, st: os.stat_result, copy: bytes) -> bool:
        """Swap a private `copy` in for the shared inode `st` at `path`; False (the copy is
        removed) if a rename moved things meanwhile, and the caller tries again."""
        # No await here: the copy replaces the shared inode only if the node is still where
        # it was and still that inode.
        try:
            unchanged = (self.tree.backing(node) == path and os.lstat(path).st_ino == st.st_ino)
        except (FsError, FileNotFoundError):
            unchanged = False
        if not unchanged:
            os.unlink(copy)
            return False
        os.rename(copy, path)
        self._store.drop_early(st.st_ino)  # an object no commit counted yet goes with it
        backing_ino = self._store.account_path(path)
        for handle in node.handles:  # open handles follow the file to its new inode
            if handle.fd >= 0:
                fresh = os.open(path, os.O_RDWR if handle.writable else os.O_RDONLY)
                os.dup2(fresh, handle.fd)
                os.close(fresh)
                handle.backing_ino = backing_ino
        return True

