"""The virtual `latest` link of a directory holding committed steps: whether a directory shows
it at all (not where the name is the saver's own), which step it names (the newest that can be
read whole now), and which one each process sees while it loads (`fs.model.latest_pins`).

Part of the tree's core (see `fs.tree.tree`): its one change to the tree is the mark that makes a
directory's `latest` its own, written on disk before it counts; the link's node is made and
dropped through `Tree`'s primitives, given to it.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierfs.fs.model import completion, tree_walk
from tierfs.fs.model.latest_pins import LatestPins, Pin
from tierfs.fs.model.nodes import LATEST, OWN_LATEST_MARK, FsError, Handle, Node, StepState
from tierfs.fs.tree.dir_attributes import times_kept
from tierfs.step_names import DEEPSPEED_STEP
from tierfs.trackers import TRACKER_NAMES

if TYPE_CHECKING:
    from tierfs.fs.tree.recoverable import Recoverability

_DEEPSPEED_STEP = re.compile(os.fsencode(DEEPSPEED_STEP))


class VirtualLatest:
    """The `latest` links of one mount's tree (see the module docstring)."""

    def __init__(self, backing: Callable[[Node], bytes],
                 attach_virtual: Callable[[Node, bytes], Node],
                 recoverable: Recoverability,
                 tracked_number: Callable[[Node], int | None] = lambda _dir: None) -> None:
        self._backing = backing  # `Tree.backing`
        self._attach_virtual = attach_virtual  # `Tree.attach_virtual`
        self._recoverable = recoverable
        self._tracked_number = tracked_number  # `StepIdentity.tracked_number`
        self._nodes: dict[int, Node] = {}  # directory inode -> its link's node
        self._pins = LatestPins()

    def shows(self, dir_node: Node) -> bool:
        """Whether `dir_node` has the virtual `latest` link: it holds a committed step and its
        `latest` is not its own."""
        return not self.is_own(dir_node) and self.target(dir_node) is not None

    @staticmethod
    def is_own(dir_node: Node) -> bool:
        """Whether `latest` in this directory belongs to the saver, never to tierfs: a real
        entry has the name, or had it once, or the virtual link was removed (all three
        recorded in the directory: `keep_own`), or it holds DeepSpeed's step directories
        (`global_stepN`), beside which DeepSpeed writes its own `latest` file.

        The kernel decides alone what an open with O_CREAT of a name whose lookup found a
        symbolic link does: it follows the link (to a step directory: EISDIR). A lookup cannot
        tell a create from a read, so the link must be absent wherever a saver writes a
        `latest` of its own, before it does."""
        return (dir_node.own_latest or LATEST in dir_node.children
                or any(node.step is not None and _DEEPSPEED_STEP.match(name)
                       for name, node in dir_node.children.items()))

    def keep_own(self, dir_node: Node) -> None:
        """From now on `latest` in this directory is its own (`is_own`), also after a restart:
        the mark is on disk before it counts. Not inside a step, where there is no virtual
        link."""
        if dir_node.own_latest or not dir_node.is_dir or tree_walk.in_a_step(dir_node):
            return
        path = self._backing(dir_node)
        with times_kept(path):  # tierfs's mark, not the saver's change
            os.close(os.open(os.path.join(path, OWN_LATEST_MARK), os.O_WRONLY | os.O_CREAT,
                             0o600))
        dir_node.own_latest = True

    def target(self, dir_node: Node) -> bytes | None:
        """The step the virtual `latest` of `dir_node` names: its committed step directory
        with the highest number that can be read whole now and is not unfinished (its saver's
        mark missing, `fs.model.completion`), unless no older one is finished (None: none)."""
        committed = [(node.step.number, name, node.step)
                     for name, node in dir_node.children.items()
                     if node.is_dir and node.step is not None and node.step.shown_committed]
        if not committed:
            return None
        newest = max(committed, key=lambda found: found[:2])
        unfinished = self.unfinished(dir_node)
        if self._recoverable.whole(newest[2]) and newest[2] not in unfinished:
            return newest[1]  # as a rule: the newest step is whole
        for _number, name, step in sorted(committed, key=lambda found: found[:2],
                                          reverse=True):
            if self._recoverable.whole(step) and step not in unfinished:
                return name
        return None

    def unfinished(self, dir_node: Node) -> dict[StepState, str]:
        """The committed step directories of `dir_node` whose saver's mark is missing, and
        which mark each lacks (`fs.model.completion`)."""
        return completion.unfinished(
            (node.step for node in dir_node.children.values()
             if node.is_dir and node.step is not None and node.step.committed),
            self._tracked_number(dir_node) if any(
                name.encode() in dir_node.children for name in TRACKER_NAMES) else None)

    def readlink(self, link: Node, pid: int | None) -> bytes:
        """The target process `pid` sees (None: the newest whole step, for anyone)."""
        parent = link.parent
        if self.is_own(parent):
            raise FsError(errno.ENOENT)  # removed, or a real `latest` came since
        target = self.target(parent)
        if pid is not None:
            target = self._pins.resolve(
                pid, parent.ino, target, lambda name: _is_committed_step(parent, name))
        if target is None:
            raise FsError(errno.ENOENT)
        return target

    def node_in(self, dir_node: Node) -> Node:
        """The link's node in `dir_node` (one per directory while the kernel knows it)."""
        node = self._nodes.get(dir_node.ino)
        if node is None:
            node = self._nodes[dir_node.ino] = self._attach_virtual(dir_node, LATEST)
        return node

    def dropped(self, link: Node) -> None:
        """The kernel forgot the link's node."""
        self._nodes.pop(link.parent.ino, None)

    def check_open(self, node: Node, pid: int) -> None:
        """Process `pid` is about to open `node`: `ESTALE` if that starts a new load through
        an older step than its directory's newest (`LatestPins.starts_again`: a DCP load's
        `.metadata`, or the one file a load read); the kernel then walks the path again,
        `latest` naming the newest step."""
        step_node = node.parent
        if step_node is None or step_node.step is None or step_node.parent is None:
            return
        run = step_node.parent
        if self._pins.starts_again(pid, run.ino, step_node.name, node.name,
                                   lambda: self.target(run)):
            raise FsError(errno.ESTALE)

    def opening(self, node: Node, pid: int) -> Pin | None:
        """Process `pid` asks to open `node`, right after its path walk: if it came through its
        pinned `latest`, the pin it holds while the open waits and then while the file is
        open (the handle's, `closed` at its release), else None."""
        step_node = _step_in_a_directory(node)
        if step_node is None:
            return None
        return self._pins.opened(pid, step_node.parent.ino, step_node.name,
                                 node.name if node.parent is step_node else None)

    def load_failed(self, pin: Pin | None, *, opening: bool = False) -> None:
        """An open (`opening`: the one that `opening` gave `pin` for) or a read of a file
        reached through the pinned `latest` failed: the load failed, and the pin ends
        (`LatestPins.failed`)."""
        if pin is None:
            return
        if opening:
            self._pins.closed(pin)
        self._pins.failed(pin)

    def closed(self, handle: Handle) -> None:
        if handle.pin is not None:
            self._pins.closed(handle.pin)


def _step_in_a_directory(node: Node) -> Node | None:
    """The step directory a file is in (at any depth), if that step has a parent directory
    (whose `latest` may name it)."""
    step_node = next(tree_walk.enclosing_steps(node.parent), None)
    return step_node if step_node is not None and step_node.parent is not None else None


def _is_committed_step(dir_node: Node, name: bytes) -> bool:
    node = dir_node.children.get(name)
    step = node.step if node is not None and node.is_dir else None
    return step is not None and step.shown_committed
