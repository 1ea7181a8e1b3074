"""A rename's change to the tree: its checks before any await, the entry moved in the tree and
in the RAM dir's `tree/` (a target it replaces leaves its name as rmdir or unlink would have
it), the directories whose symbolic links the store must learn again, and every committed step
it moves recorded as moved in every tier (`fs.lifecycle.deletes`) before anything moves, so that no
crash brings an old name back. Part of the tree's core (see `fs.tree.tree`): the change is one
synchronous method, made through `Tree`'s primitives; `fs.lifecycle.commits` decides what follows
(step identities below a renamed directory, a commit by `.metadata`)."""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

from tierfs import layout
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import LATEST, RENAME_NOREPLACE, FsError, Node

if TYPE_CHECKING:
    from tierfs.fs.model.ports import DeleteLog
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.tree_primitives import StepRemoval, TreePrimitives
    from tierfs.fs.tree.virtual_latest import VirtualLatest


class Renames:
    """The renames of one mount's tree (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, deletes: DeleteLog, identity: StepIdentity,
                 latest: VirtualLatest, *, removals: StepRemoval) -> None:
        self.tree = tree
        self._deletes = deletes
        self._removals = removals
        self._identity = identity
        self._latest = latest

    def check_rename(self, old_parent: Node, old_name: bytes, new_name: bytes,
                     flags: int) -> Node:
        """The node a rename moves, after the checks that come before any await."""
        if flags & ~RENAME_NOREPLACE:
            raise FsError(errno.EINVAL)  # RENAME_EXCHANGE and friends: not supported
        node = self.tree.existing_entry(old_parent, old_name)
        self.tree.check_new_name(new_name)
        return node

    def rename(self, node: Node, old_parent: Node, old_name: bytes, new_parent: Node,
               new_name: bytes, flags: int) -> bool:
        """Move `node` (the resident entry `old_name` of `old_parent`); False if it is there
        already. Step identities below it are the caller's next step
        (`RenameCommits.after_rename`)."""
        tree = self.tree
        if not new_parent.is_dir:
            raise FsError(errno.ENOTDIR)
        target = new_parent.children.get(new_name)
        if target is node:
            return False
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if node.is_dir and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if target.is_dir and not node.is_dir:
                raise FsError(errno.EISDIR)
            if target.is_dir and target.children:
                raise FsError(errno.ENOTEMPTY)
        if node.is_dir and tree_walk.holds(node, new_parent):
            raise FsError(errno.EINVAL)
        old_path = tree.backing(node)
        new_path = os.path.join(tree.backing(new_parent), new_name)
        old_rel = tree.relpath(node)
        new_rel = layout.join(tree.relpath(new_parent), os.fsdecode(new_name))
        link_dirs = tree_walk.dirs_with_links(node, old_rel)
        if target is not None and target.kind == stat.S_IFLNK:
            link_dirs.append(("", tree.relpath(new_parent)))
        for _below, directory in link_dirs:  # their objects in the store go or change
            tree.links.note(directory)
        # The deletes the rename makes, all on disk or none (ENOSPC: the rename is refused
        # before anything changed): the entry it replaces, and the steps it moves.
        deleted = self._moves(node, new_rel)
        if target is not None and target.step is not None and target.step.manifest is not None:
            replaced = target.step.manifest
            deleted.append((replaced.path, replaced.version, replaced.committed_ns, None))
        if deleted:
            self._deletes.record_all(deleted)
        if target is not None:
            self._removals.clear_replaced(target, new_path)
        if not node.is_dir and node.step is not None:
            # a step at its new name (RenameCommits.after_rename); the move is recorded
            self._removals.no_longer_step(node)
        if new_name == LATEST:
            self._latest.keep_own(new_parent)  # `mv -T tmp latest`: a real `latest` from now on
        if node.remote is None or node.is_dir:  # a file only in the store has no bytes here
            os.rename(old_path, new_path)
        if target is not None:
            tree.detach(target)
        tree.mark_dirty(old_parent)
        self.tree.shape += 1
        del old_parent.children[old_name]
        node.name = new_name
        node.parent = new_parent
        new_parent.children[new_name] = node
        if node.is_file:
            node.step = self._identity.single_file_step(new_parent, new_name)
            tree.mark_dirty(node)
        else:
            tree.mark_dirty(new_parent)
        for below, _directory in tree_walk.dirs_with_links(node, new_rel):
            tree.links.note(layout.join(new_rel, below) if below else
                            (new_rel if node.is_dir else tree.relpath(new_parent)))
        return True

    def _moves(self, node: Node, new_path: str) -> list[tuple[str, int, int, str | None]]:
        """`node` moves to `new_path`: every committed step at or below it is renamed in every
        tier (fs.lifecycle.deletes: its old name leaves them once its new one is there), as a
        delete of its old name (path, version, committed_ns, moved_to). Recorded before the rename,
        so that no crash lets the old name come back."""
        if not node.is_dir and node.step is None:
            return []  # a file inside a step: that step commits again
        old_path = self.tree.relpath(node)
        moves: list[tuple[str, int, int, str | None]] = []
        for step_node in self.tree.steps(under=node):
            manifest = step_node.step.manifest
            if manifest is None:
                continue
            at = self.tree.relpath(step_node)
            moves.append((at, manifest.version, manifest.committed_ns,
                          new_path + at[len(old_path):]))
        return moves

    def moves_may_settle(self) -> None:
        """Steps renamed just now committed at their new names: their old names may go."""
        self._deletes.poke()
