"""A node's attributes wherever it is: its backing file in the RAM tier, its manifest entry
while its bytes are in another tier, an open descriptor once its name is gone, and a
directory's last attributes once it is removed while the kernel still holds it (kept at each
read). It changes nothing else; `fs.tree.tree.Tree.stat` is its one caller."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from tierfs import manifest as mf
from tierfs.fs.model.nodes import FsError, Node, RemoteAttrs, size_in_blocks


def node_attrs(node: Node, backing: Callable[[Node], bytes]) -> os.stat_result | RemoteAttrs:
    """Attributes of `node`, whose backing path `backing` gives (FsError once it has none)."""
    if node.remote is not None:
        return _remote_attrs(node, backing)
    try:
        st = os.lstat(backing(node))
    except FsError:
        if node.open_fd >= 0:
            return os.fstat(node.open_fd)
        if node.dir_attrs is not None:
            # Removed (here or by another node) while the kernel holds it, as `fstat` of
            # a descriptor on it: its last attributes, as a local file system answers
            # (shutil.rmtree fstat's the directory it opened).
            return node.dir_attrs
        raise
    if node.is_dir:
        node.dir_attrs = st
    return st


def _remote_attrs(node: Node, backing: Callable[[Node], bytes]) -> RemoteAttrs:
    entry = node.remote.entry
    uid, gid = entry.uid, entry.gid
    if uid == mf.NO_OWNER or gid == mf.NO_OWNER:  # a manifest from before owners
        parent = os.lstat(backing(node.parent)) if node.parent else None
        uid, gid = (parent.st_uid, parent.st_gid) if parent else (0, 0)
    return RemoteAttrs(
        st_mode=stat.S_IFREG | entry.mode, st_nlink=1, st_uid=uid, st_gid=gid,
        st_size=entry.size, st_blocks=size_in_blocks(entry.size),
        st_atime_ns=entry.mtime_ns, st_mtime_ns=entry.mtime_ns, st_ctime_ns=entry.mtime_ns)
