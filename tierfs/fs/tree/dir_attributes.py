"""A directory's own attributes (owner, group, mode, mtime) as committed state.

A file carries its attributes in its manifest entry; a directory has no entry of its own, so
each step's manifest records the directories above its files as they are at the commit: from
the top of the mount down to the step, and those inside a step directory (`recorded`). A node
that makes such a directory for a step it did not write (a fresh node listing the store, a
node learning a peer's commit, a link the store keeps) gives it the attributes of the newest
manifest that records it (`DirAttributes.give`), so that a job running as its own user goes on
saving and rotating there, and a directory that kept other users out of its files still does.
A directory a user made on this node is never changed this way, and one the job changed here
(an entry made or removed in it, its attributes set) takes only commits made after that change:
a commit learned again (its record names more holders) must not put back times older than the
job's write (HF's Trainer rotates its checkpoints by them).

tierfs's own entries in a directory (a step's records, a file fetched back or evicted, the mark
of a saver's own `latest`) must not move its times, or the times recorded at the next commit,
and those a fresh node shows, would be tierfs's and not the job's: `times_kept` puts them back.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from tierfs import manifest as mf
from tierfs.fs.model import tree_walk

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import Node


@contextlib.contextmanager
def times_kept(path: bytes) -> Iterator[None]:
    """The directory at `path` keeps its access and modification times across the change
    made inside (tierfs's own entries come and go; a user's change is no such change)."""
    try:
        st = os.lstat(path)
    except OSError:
        yield
        return
    yield
    with contextlib.suppress(OSError):
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def recorded(step_node: Node, backing: Callable[[Node], bytes],
             relpath: Callable[[Node], str]) -> tuple[mf.DirEntry, ...]:
    """The directories a commit of `step_node` records (see the module docstring), parents
    before their children: none for a file at the top of the mount."""
    chain = []
    node = step_node if step_node.is_dir else step_node.parent
    while node is not None and node.parent is not None:  # up to the mount's root, not it
        chain.append(node)
        node = node.parent
    inside = list(tree_walk.dirs_under(step_node)) if step_node.is_dir else []
    return tuple(mf.dir_entry_from_stat(relpath(node), os.lstat(backing(node)))
                 for node in [*reversed(chain), *inside])


class DirAttributes:
    """The directories this node made for steps it did not write, and the recorded
    attributes each was given (the newest commit's that records it), with its time; no
    attributes at a time the job changed it here (what it has then is the job's)."""

    def __init__(self) -> None:
        self._given: weakref.WeakKeyDictionary[
            Node, tuple[int, mf.DirEntry | None] | None] = weakref.WeakKeyDictionary()

    def made(self, node: Node) -> None:
        """tierfs made `node` for a step from another tier: recorded attributes apply to it."""
        self._given.setdefault(node, None)

    def changed_here(self, node: Node) -> None:
        """The job changed the directory `node` here: its attributes are the job's now, over
        those of any commit made before."""
        if node in self._given:
            self._given[node] = (time.time_ns(), None)

    def give(self, root: Node, manifest: mf.StepManifest,
             backing: Callable[[Node], bytes]) -> None:
        """Give the directories `manifest` records that this node made for other tiers the
        attributes of the newest commit recording each (this one, if none newer did), times
        last and deepest first: a directory made inside another moved the outer one's."""
        self.give_entries(root, manifest.dirs, manifest.committed_ns, backing)

    def give_entries(self, root: Node, entries: Iterable[mf.DirEntry], when_ns: int,
                     backing: Callable[[Node], bytes]) -> None:
        """`give`, of entries as they were at `when_ns` (a commit's time, or now for those the
        nodes that write a step say their directories have: its commit records them)."""
        touched = []
        for entry in entries:
            node = tree_walk.node_at(root, entry.path)
            if node is None or not node.is_dir or node not in self._given:
                continue
            given = self._given[node]
            if given is None or given[0] <= when_ns:
                self._given[node] = (when_ns, entry)
            touched.append(node)
        for node in sorted(touched, key=_depth, reverse=True):
            given = self._given[node]
            assert given is not None
            if given[1] is not None:
                with contextlib.suppress(OSError):
                    _apply(backing(node), given[1])


def _depth(node: Node) -> int:
    depth = 0
    while node.parent is not None:
        depth += 1
        node = node.parent
    return depth


def _apply(path: bytes, entry: mf.DirEntry) -> None:
    """Owner first (a change of owner may clear set-id bits), then mode, then times; each as
    far as this daemon may (one not run as root keeps its own uid)."""
    with contextlib.suppress(OSError):
        os.chown(path, entry.uid, entry.gid, follow_symlinks=False)
    os.chmod(path, entry.mode)
    os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
