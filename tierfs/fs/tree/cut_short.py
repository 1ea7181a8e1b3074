"""Files a write into failed for want of room (ENOSPC: the RAM tier's limit, or the RAM dir's
file system full), which may therefore hold less than their saver meant to write.

A saver whose write failed gets the error, but closes the file all the same, and a file step
commits at that close, a step directory once quiet: such a file would become a committed
step, copied to peers and to the store, and named by `latest`. So a step holding such a file
does not commit by itself (`Commits.commit_quietly`, `QuietCommits`): it stays `writing`,
saying why, until the file is written again from the start (opened with O_TRUNC, truncated
to 0) or removed; an explicit commit (`tierfs commit`, a DCP `.metadata`) still commits it.

Without passthrough the daemon sees the failed write itself. With passthrough the kernel
writes the backing file and the daemon never sees the error: a file whose writer finished
while the RAM dir's file system had no room left (`FULL_MARGIN`) is taken for one cut short.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierfs.fs.model import tree_walk

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import Node

log = logging.getLogger(__name__)

# Free bytes under which the RAM dir's file system counts as full when a passthrough writer
# finishes: its last write may have failed (tmpfs fills to the last page).
FULL_MARGIN = 64 << 10


class CutShort:
    """The files whose last save may be cut short (see the module docstring)."""

    def __init__(self, relpath: Callable[[Node], str]) -> None:
        self._relpath = relpath
        self._nodes: weakref.WeakSet[Node] = weakref.WeakSet()

    def note(self, node: Node, why: str) -> None:
        if node not in self._nodes:
            self._nodes.add(node)
            log.warning("%s: a write into it failed (%s): it may be cut short, so its step "
                        "does not commit by itself (write it again, remove it, or `tierfs "
                        "commit` the step)", self._relpath(node), why)

    def note_if_full(self, node: Node, ram_dir: str) -> None:
        """A passthrough writer of `node` finished: if the RAM dir's file system is full, its
        last write may have failed unseen."""
        try:
            found = os.statvfs(ram_dir)
        except OSError:
            return
        if found.f_bavail * found.f_frsize < FULL_MARGIN:
            self.note(node, "the RAM dir's file system was full when its writer finished")

    def clear(self, node: Node) -> None:
        """`node` is written again from the start (or gone)."""
        self._nodes.discard(node)

    def in_step(self, step_node: Node) -> str | None:
        """The path of a file of the step (a step directory, or a single file) that may be
        cut short, or None."""
        if step_node.is_file:
            return self._relpath(step_node) if step_node in self._nodes else None
        if not self._nodes:
            return None
        for _rel, node in tree_walk.files_under(step_node):
            if node in self._nodes:
                return self._relpath(node)
        return None
