"""The links other tiers keep (`fs.model.links`: a relative link outside any step directory,
pointing inside the mount, such as Lightning's `last.ckpt`) made in this node's tree: those the
store keeps, on a fresh RAM dir (`adopt`), and those another node of the cluster keeps, as they
change there (`replace`, from `replication.coordination.shared_links`). Made as the tree's own
entries are (a directory's times do not move, the kernel is told), and never noted as this
node's changes: another tier or node wrote them, so neither is written again from here."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from tierfs import layout
from tierfs.fs.model import links as symlinks
from tierfs.fs.model.nodes import LATEST, Node
from tierfs.fs.tree.dir_attributes import times_kept

if TYPE_CHECKING:
    from tierfs.fs.tree.dir_attributes import DirAttributes
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.tree import Tree
    from tierfs.fs.tree.virtual_latest import VirtualLatest


class KeptLinks:
    """Makes the links another tier keeps for a directory this node's."""

    def __init__(self, tree: Tree, *, dir_attributes: DirAttributes, identity: StepIdentity,
                 latest: VirtualLatest) -> None:
        self.tree = tree
        self._dir_attributes = dir_attributes
        self._identity = identity
        self._latest = latest

    def adopt(self, directory: str, links: dict[str, str]) -> int:
        """Make the links the store keeps for `directory` (a fresh RAM dir); an entry of
        that name here stays. The number made."""
        parent = self._directory(directory, make=True)
        return 0 if parent is None else self._make(parent, links)

    def replace(self, directory: str, links: dict[str, str]) -> int:
        """Make `directory`'s kept links here those another node keeps (its mount changed
        them): each kept link not among them goes, one with another target is made again, a
        missing one is made; an entry of another kind, and a link tierfs does not keep (an
        absolute one), stay. The number of links changed."""
        parent = self._directory(directory, make=bool(links))
        if parent is None:
            return 0
        backing = self.tree.backing(parent)
        gone = 0
        for raw, child in list(parent.children.items()):
            if child.kind != stat.S_IFLNK or child.virtual:
                continue
            path = os.path.join(backing, raw)
            name, target = os.fsdecode(raw), os.fsdecode(os.readlink(path))
            if links.get(name) == target or \
                    not symlinks.stays_inside(layout.join(directory, name), target):
                continue
            with times_kept(backing):
                os.unlink(path)
            self.tree.detach(child)
            gone += 1
        return gone + self._make(parent, links)

    def _directory(self, directory: str, *, make: bool) -> Node | None:
        """The directory's node, made (with its parents) if `make`; None inside a step
        directory (which holds no kept links), or missing."""
        parent = self.tree.root
        for part in map(os.fsencode, directory.split("/") if directory else ()):
            child = parent.children.get(part)
            if child is not None and (not child.is_dir or child.step is not None):
                return None
            if child is None:
                if not make or self._identity.step_number_at(parent, part) is not None:
                    return None
                os.mkdir(os.path.join(self.tree.backing(parent), part), 0o755)
                child = self.tree.attach(parent, part, stat.S_IFDIR)
                self._dir_attributes.made(child)
            parent = child
        return parent

    def _make(self, parent: Node, links: dict[str, str]) -> int:
        made = 0
        backing = self.tree.backing(parent)
        for name, target in links.items():
            raw = os.fsencode(name)
            if raw in parent.children or (raw == LATEST and self._latest.is_own(parent)):
                continue
            with times_kept(backing):  # made again, not a change
                os.symlink(target, os.path.join(backing, raw))
            self.tree.attach(parent, raw, stat.S_IFLNK)
            made += 1
        return made
