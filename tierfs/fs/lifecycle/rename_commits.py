"""What a rename commits. A directory renamed onto a step name becomes that step and commits
(the `mv tmp step_N` idiom); one renamed away from a step name, or into a step, stops being a
step, its files then files of the step it is in; steps moved along with it commit again so
that their manifests name where they are now; a `.metadata` renamed into place commits its
step (DCP's own rename of it), and a file renamed onto a file-step name commits as one. The
rename itself is `fs.tree.renames`; the commits are `fs.lifecycle.commits`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import METADATA, Node

if TYPE_CHECKING:
    from tierfs.fs.lifecycle.commits import Commits
    from tierfs.fs.model.ports import BringBack
    from tierfs.fs.tree.renames import Renames
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.tree import Tree


class RenameCommits:
    """The steps a rename made, unmade or moved, and their commits (see the module docstring)."""

    def __init__(self, tree: Tree, commits: Commits, bring_back: BringBack, *,
                 identity: StepIdentity, renames: Renames) -> None:
        self.tree = tree
        self._commits = commits
        self._bring_back = bring_back  # a demoted step's files that are in other tiers only
        self._identity = identity  # which directories are steps, single files or neither
        self._renames = renames

    async def after_rename(self, node: Node, old_parent: Node) -> None:
        """`node` was renamed out of `old_parent`: a directory may have become or stopped
        being a step; a `.metadata` renamed into place commits its step."""
        if node.is_dir:
            await self._renamed_dir(node)
        elif node.name == METADATA and node.parent.step is not None:
            await self._commits.commit_for_saver(node.parent)
        else:
            await self._commits.commit_file_step(node)  # `mv x.tmp epoch=0-step=5.ckpt`
        await self._commits.run_pending_commits(old_parent)
        self._renames.moves_may_settle()

    async def _renamed_dir(self, node: Node) -> None:
        """A directory renamed onto a step name commits it (the `mv tmp step_N` idiom); one
        renamed away from a step name, or into a step, stops being a step (its files are
        then files of the step it is in); steps moved along with it commit again so that
        their manifests name where they are now."""
        tree = self.tree
        number = self._identity.step_number_at(node.parent, node.name)
        if number is None:
            if node.step is not None:
                await self._demote(node)
        else:
            self._identity.become_step(node, number)
        for below in list(tree_walk.dirs_under(node)):
            await self._restep(below)
        for file_node in list(tree_walk.walk_files(node)):
            await self._refile(file_node)
        if node.step is not None:
            await self._commits.commit_quietly(node)
        for step_node in list(tree.steps(under=node)):
            manifest = step_node.step.manifest
            if step_node is not node and manifest and manifest.path != tree.relpath(step_node):
                await self._commits.commit_quietly(step_node)

    async def _restep(self, node: Node) -> None:
        """After a rename above it: `node` is a step exactly when its name is a step name and
        no directory above it is a step (a directory inside a step is part of that step)."""
        number = self._identity.step_number_at(node.parent, node.name)
        if number is None and node.step is not None:
            await self._demote(node)
        else:
            self._identity.restep(node, number)

    async def _refile(self, node: Node) -> None:
        """After a rename above it: a file is a single-file step exactly when no directory
        above it is a step; one that moved commits again at its new path."""
        tree = self.tree
        wanted = self._identity.single_file_step(node.parent, node.name)
        if wanted is None and node.step is not None:
            if node.remote is not None and not node.remote.in_store:
                await self._bring_back.make_resident(node, empty=False)
            self._identity.stop_being_step(node)
        elif wanted is not None and (node.step is None or (
                node.step.manifest is not None
                and node.step.manifest.path != tree.relpath(node))):
            self._identity.become_single_file(node, wanted)
        if node.step is not None and node.step.number is not None:
            await self._commits.commit_quietly(node)

    async def _demote(self, node: Node) -> None:
        """A committed directory that stops being a step keeps its files, not its manifest."""
        for _rel, child in list(tree_walk.files_under(node)):
            if child.remote is not None and not child.remote.in_store:
                await self._bring_back.make_resident(child, empty=False)
        self._identity.stop_being_step(node)
