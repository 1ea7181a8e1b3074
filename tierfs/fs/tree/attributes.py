"""A resident entry's attributes changed (setattr: chmod, chown, utime, truncate): which changes
keep a file's seal (metadata alone), which make its step commit again (mode, owner and mtime are
committed state; a new size is new bytes), and the RAM tier's accounting of a truncated file.
Not the extended attributes (`fs.tree.user_xattrs`, `fs.tree.tree_view`). Part of the tree's core
(see `fs.tree.tree`): each change is one synchronous method, made through `Tree`'s primitives."""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import FsError, Handle, Node

if TYPE_CHECKING:
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.sealing import Sealing
    from tierfs.fs.tree.tree_primitives import TreePrimitives


class Attributes:
    """The attribute changes of one mount's tree (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, sealing: Sealing, *, store: RamStore) -> None:
        self.tree = tree
        self._store = store
        self._sealing = sealing

    def setattr(
        self, node: Node, handle: Handle | None, *, mode: int | None = None,
        uid: int | None = None, gid: int | None = None, size: int | None = None,
        atime_ns: int | None = None, mtime_ns: int | None = None,
    ) -> None:
        """Change attributes of a resident file (private already if `size` is given)."""
        # A change of metadata alone (utime moves the mtime a seal is checked against) keeps it.
        keeps_seal = size is None and node.is_file and self._sealing.describes_file(node)
        target: bytes | int
        try:
            target = self.tree.backing(node)
        except FsError:  # its name is gone: the open file (fchmod after an unlink, as on tmpfs)
            # fchmod, fchown and futimens come with no handle (only ftruncate has one)
            open_fd = handle.fd if handle is not None else node.open_fd
            if open_fd < 0:
                raise
            target = open_fd
        if size is not None:
            self._truncate(node, handle, target, size)
        if mode is not None and node.kind != stat.S_IFLNK:
            os.chmod(target, mode & 0o7777)
        # a path's symlink itself, not its target (a descriptor takes no such flag)
        no_follow = {"follow_symlinks": False} if isinstance(target, bytes) else {}
        if uid is not None or gid is not None:
            os.chown(target, -1 if uid is None else uid, -1 if gid is None else gid,
                     **no_follow)
        if atime_ns is not None or mtime_ns is not None:
            st = os.lstat(target) if isinstance(target, bytes) else os.fstat(target)
            times = (st.st_atime_ns if atime_ns is None else atime_ns,
                     st.st_mtime_ns if mtime_ns is None else mtime_ns)
            os.utime(target, ns=times, **no_follow)
        if keeps_seal:
            node.seal = node.seal.restamped(self.tree.stat(node))
        # Mode, owner and mtime are committed state, a step directory's and those of the
        # directories in it too (`fs.tree.dir_attributes`): the step commits again, as a version
        # with new attributes only (no byte goes anywhere again). A directory's new times
        # alone wait for the step's next commit: `rsync -a` and `cp -a` set them last, after
        # the step committed, and would leave it `writing` for --commit-idle after every copy.
        # A single file no one writes commits them soon (`quiet_watch.SETTLED`).
        changed = (mode, uid, gid, mtime_ns if node.is_file else None)
        if (node.is_file or node.is_dir and tree_walk.in_a_step(node)) and size is None \
                and changed != (None,) * 4:
            self.tree.mark_dirty(node, settled=node.step is not None and node.is_file
                                 and not node.open_for_writing)
            for step_node in tree_walk.enclosing_steps(node):
                step_node.step.attributes_changed = True

    def drop_setid(self, node: Node) -> None:
        """A writer that may not keep them (any user but root) opened or truncated `node`: its
        set-user-ID bit goes, and its set-group-ID bit if it is group-executable, as the kernel
        clears them at a write on every other Linux file system. Under the relay tierfs takes
        this on (FUSE_HANDLE_KILLPRIV_V2, `fs.fuse.fuse_wire`) and with passthrough the kernel
        writes the backing file without the daemon, so it is done at the open
        (`fs.fuse.operations`), before the first write."""
        mode = stat.S_IMODE(self.tree.stat(node).st_mode)
        kept = mode & ~stat.S_ISUID & ~(stat.S_ISGID if mode & stat.S_IXGRP else 0)
        if kept != mode:
            self.setattr(node, None, mode=kept)

    @staticmethod
    def check_truncatable(node: Node) -> None:
        if not node.is_file:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)

    def _truncate(self, node: Node, handle: Handle | None, target: bytes | int,
                  size: int) -> None:
        self.check_truncatable(node)
        # A file grown by truncate stores nothing more (tmpfs keeps no holes): no room needed.
        if isinstance(target, bytes):
            os.truncate(target, size)
            self._store.account_path(target)
        else:
            os.ftruncate(target, size)
            self._store.account_fd(target)
        if handle is not None and handle.active:
            return
        node.gen += 1
        node.seal = None
        self.tree.mark_dirty(node)
