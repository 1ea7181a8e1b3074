"""Users' own extended attributes (`user.*`, not `user.tierfs.*`): kept on the RAM tier's file
or directory, never in a manifest, so no other tier keeps them; a file whose bytes are in
another tier, or the virtual `latest`, has none."""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from tierfs.fs.model.nodes import ENOATTR, XATTR_RESERVED, FsError, Node

if TYPE_CHECKING:
    from tierfs.fs.tree.tree import Tree


def names(tree: Tree, node: Node) -> list[bytes]:
    target = _target(tree, node)
    if target is None:
        return []
    return [name for name in map(os.fsencode, os.listxattr(target))
            if name.startswith(b"user.") and not name.startswith(XATTR_RESERVED)]


def get(tree: Tree, node: Node, name: bytes) -> bytes:
    target = _target(tree, node)
    if target is None:
        raise FsError(ENOATTR)
    return os.getxattr(target, name)


def set_value(tree: Tree, node: Node, name: bytes, value: bytes) -> None:
    target = _target(tree, node)
    if target is None:
        raise FsError(errno.ENOTSUP)
    os.setxattr(target, name, value)


def remove(tree: Tree, node: Node, name: bytes) -> None:
    target = _target(tree, node)
    if target is None:
        raise FsError(ENOATTR)
    os.removexattr(target, name)


def _target(tree: Tree, node: Node) -> bytes | int | None:
    """Where a node's user xattrs live: its backing file or directory, the fd of an open
    handle once it is unlinked, or nowhere (a file whose bytes are in another tier, the
    virtual `latest`). They are not in the manifest, so no other tier keeps them."""
    if node.virtual or node.remote is not None or not (node.is_file or node.is_dir):
        return None
    try:
        return tree.backing(node)
    except FsError:
        for handle in node.handles:
            if handle.fd >= 0:
                return handle.fd
        raise
