"""Commits without a marker: a step directory commits once its saver is done with it.

Most savers (HF Trainer, `torch.save`, Megatron-LM, DeepSpeed) write plain files and never say
when a checkpoint is complete. A step being written therefore commits by itself when

* it has had no file open for writing and no change for `commit_idle` seconds, or
* the saver starts a newer step directory beside it (mkdir of a higher step number in the same
  directory): the older one is done, so it commits at once if no file of it is open for writing,
* the file system is unmounted cleanly (every quiet step commits before the daemon exits).

A committed step whose only change since its commit is files removed (an `rm -r` of it cut
short: killed, or its `rmdir` refused for want of room) is not saved again by these rules: a
removal is no new version. It stays `writing` (so `latest` names an older step), and every
other tier keeps its last whole version, until the removal completes (its delete) or a file of
it is written again; `tierfs commit` makes the half-removed step a version of its own.

Only steps changed while this daemon runs are watched (`fs.lifecycle.quiet_watch.QuietWatch`,
step node -> when it is due), so the work is proportional to the steps being written, never a
scan of the tree. The `Tree` tells the watch of every change (the `StepWatch` port);
`QuietCommits` runs the commits through `Commits`. A step left `writing` by a crash is not
committed by these rules (it may be partial); writing into it again, or `tierfs commit`, does.
A step directory that goes quiet holding no file at all is `empty`, not written for ever:
nothing commits. A step holding DCP shards (`*.distcp`) waits for its `.metadata`, the end of a
DCP save, which stays the immediate trigger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from tierfs.fs.lifecycle.commits import Commits, cut_short_reason
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import METADATA, Node

if TYPE_CHECKING:
    from tierfs.fs.lifecycle.quiet_watch import QuietWatch
    from tierfs.fs.tree.cut_short import CutShort
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.step_manifests import StepManifests
    from tierfs.fs.tree.tree import Tree

log = logging.getLogger(__name__)

DCP_SHARD_SUFFIX = b".distcp"
AWAIT_METADATA = "its .metadata (a DCP save in progress or interrupted)"
CUT_SHORT_DCP = ("its .metadata, which will not come: a newer step began beside it, so its "
                 "DCP save was cut short (remove it, or `tierfs commit` it as it is)")
LEFT_WRITING = ("the rest of its save: it was left being written by an earlier run of the "
                "daemon (a save cut short), so it does not commit by itself; `tierfs commit` "
                "it as it is, write it again, or remove it")


@dataclass(frozen=True)
class Outlook:
    """When a step being written commits by itself (`QuietCommits.outlook`; `tierfs flush`
    waits for it): `kind` is

    * `due`: at `due` (monotonic seconds), once quiet for `--commit-idle`, if nothing changes;
    * `writers`: once the files in `files`, open for writing, are closed (then `due`);
    * `waits`: once what `reason` names comes (a DCP `.metadata`, files other nodes write,
      etcd, room): it may, or may never;
    * `never`: it does not commit by itself, `reason` says why (a save cut short)."""

    kind: str
    due: float | None = None
    reason: str | None = None
    files: list[str] = field(default_factory=list)


class QuietCommits:
    """Commits each watched step once it is due and quiet."""

    def __init__(self, tree: Tree, watch: QuietWatch, commits: Commits, *, cut_short: CutShort,
                 residents: Residents, manifests: StepManifests) -> None:
        self.tree = tree
        self._cut_short = cut_short  # files a write into failed: the step waits for them
        self._residents = residents  # whether a file changed since its step's commit
        self._manifests = manifests  # why a step waits (status)
        self.watch = watch
        self.commits = commits
        # due steps the watch is committing now: out of `watch.due`, still `writing`
        self._committing: set[Node] = set()

    def outlook(self, step_node: Node) -> Outlook:
        """When `step_node`, a step being written, commits by itself (see `Outlook`)."""
        step = step_node.step
        if any(n.active_writers or n.open_for_writing for n in tree_walk.walk_files(step_node)):
            return Outlook("writers", files=[
                rel for rel, node in tree_walk.files_under(step_node)  # named in order
                if node.active_writers or node.open_for_writing])
        if step.commit_pending:  # retried (`Commits.retry_pending_commits`)
            return Outlook("waits", reason=step.waiting_for)
        cut = self._cut_short.in_step(step_node)
        if cut is not None:
            return Outlook("never", reason=cut_short_reason(cut))
        if step_node in self._committing:
            return Outlook("due", due=time.monotonic())
        due = self.watch.due.get(step_node)
        if due is None:  # not watched: left writing by a crash, or removed in part
            return Outlook("never", reason=step.waiting_for or LEFT_WRITING)
        reason = self._not_quiet(step_node)
        if reason == AWAIT_METADATA:
            if self._newer_step_beside(step_node):
                return Outlook("never", reason=CUT_SHORT_DCP)
            return Outlook("waits", reason=reason)  # rank 0 may still write it, or its node
        if reason is not None and reason != "open writers":
            return Outlook("never", reason=reason)
        return Outlook("due", due=due)

    @staticmethod
    def _newer_step_beside(step_node: Node) -> bool:
        """Whether the saver began a newer step directory beside `step_node`: it is done
        with this one."""
        number = step_node.step.number
        return number is not None and step_node.parent is not None and any(
            sibling.is_dir and sibling.step is not None and sibling.step.number is not None
            and sibling.step.number > number for sibling in step_node.parent.children.values())

    def _not_quiet(self, step_node: Node) -> str | None:
        """Why `step_node` may not commit by itself now, or None if it may."""
        children = step_node.children or {}  # a single-file step has none
        if METADATA not in children and any(n.endswith(DCP_SHARD_SUFFIX) for n in children):
            return AWAIT_METADATA
        for _rel, node in tree_walk.files_under(step_node):
            if node.active_writers or node.open_for_writing:
                return "open writers"
        cut = self._cut_short.in_step(step_node)
        if cut is not None:
            return cut_short_reason(cut)
        removed = self._removed_only(step_node)
        if removed:
            return (f"the end of its removal: {removed} of its "
                    f"{len(step_node.step.manifest.files)} files removed, none written "
                    "(a removal is no new version; `rm -r` it, or save it again)")
        return None

    def _removed_only(self, step_node: Node) -> int:
        """How many files of its committed version a step directory lacks, if that is its
        only change since its commit (every file left is that version's, as it was); else 0."""
        step = step_node.step
        manifest = step.manifest
        if (manifest is None or not step_node.is_dir or step.attributes_changed
                or step.pending is not None):
            return 0
        present = 0
        for rel, node in tree_walk.files_under(step_node):
            entry = manifest.entry(rel)
            if entry is None or not (
                    node.remote.entry.xxh3 == entry.xxh3 if node.remote is not None
                    else self._residents.unchanged_since_commit(step, rel, node)):
                return 0
            present += 1
        return len(manifest.files) - present

    async def run(self) -> None:
        """The daemon's background task: commit each step once it is due and quiet."""
        watch = self.watch
        while True:
            wake = watch.rearm()
            for step_node in watch.due_steps(time.monotonic()):
                await self._commit_if_quiet(step_node)
            due = watch.next_due()
            with trio.move_on_after(max(0.0, due - time.monotonic())):
                await wake.wait()

    async def _commit_if_quiet(self, step_node: Node) -> bool:
        """Commit `step_node` if nothing writes it; otherwise look again later."""
        step = step_node.step
        if step is None or step_node.parent is None or step.shown_committed:
            # Removed, renamed away, or committed meanwhile (its hashes may still be coming:
            # that commit is finished in the background, not waited for here).
            self.watch.due.pop(step_node, None)
            return False
        if (step_node.is_dir and step.manifest is None and step.pending is None
                and next(tree_walk.walk_files(step_node), None) is None):
            step.empty = True  # nothing to commit (`StepState.empty`)
            self._manifests.note_waiting(step, None)
            del self.watch.due[step_node]
            return False
        reason = self._not_quiet(step_node)
        if reason is not None:
            if reason != "open writers":
                self._manifests.note_waiting(step, reason)
            if reason.startswith("the end of its removal"):
                del self.watch.due[step_node]  # until it changes again (`Tree.mark_dirty`)
                log.info("%s: %s", self.tree.relpath(step_node), reason)
            else:
                self.watch.touch(step_node)
            return False
        del self.watch.due[step_node]
        self._committing.add(step_node)
        try:
            await self.commits.commit_quietly(step_node, by_idle=True)
        finally:
            self._committing.discard(step_node)
        return True

    async def commit_quiet_steps(self) -> None:
        """At a clean unmount: every quiet step being written commits now, instead of being
        left `writing` (and its files thrown away at the next start if it was a re-save)."""
        committed = 0
        for step_node in list(self.watch.due):
            committed += await self._commit_if_quiet(step_node)
        left = [self.tree.relpath(n) for n in self.watch.due if n.step is not None and n.parent]
        if committed or left:
            log.info("unmount: %d steps committed; %d left writing%s", committed, len(left),
                     f" ({', '.join(sorted(left)[:5])})" if left else "")
