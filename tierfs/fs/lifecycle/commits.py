"""Commits: when a step commits, and the commit itself.

A step commits when its saver says so (a DCP `.metadata` closed after writing or renamed into
place, a directory renamed onto a step name: `fs.lifecycle.rename_commits`, `tierfs commit`),
when it falls quiet (`fs.lifecycle.quiet_commits`), or when the last writer of a pending
commit is done. `Commits` checks the step, brings in what is missing (files from other tiers
via `BringBack`, other nodes' DCP shards via `CommitTiers`), seals what is unsealed, copies
what an open handle could still write, and then has the `Tree` write the manifest with no
await between the last check and the change (`StepManifests.write_manifest`). The new
manifest goes to the `CommitSink` (uploads, replicas), and its record to the cluster
(`CommitTiers.publish`).

One rule for everything a commit awaits (`Commits._commit_locked`): any await may let a writer
come back, a file go, a seal be dropped or go stale. So an attempt prepares (residency, seals,
private copies), then checks in one synchronous step that everything it prepared still holds
(`_still_ready`); if anything moved, what it made for itself (private copies in objects/) is
removed and it starts over, which first waits for the writers (or leaves the commit pending).
The copies are removed also when the attempt ends any other way (an error, a cancellation:
`tierfs commit --timeout`). A writer that comes back therefore either came after the check (its
writes start the next version) or sends the commit round again (they land in this one whole).

A saver's own call that commits (the close or rename of DCP's `.metadata`) waits for the
cluster's coordination (etcd: other nodes' records of their shards, then the commit record) at
most `saver_wait` seconds in all; then it fails with ETIMEDOUT, and the step stays `writing`,
waiting for etcd, and commits by itself once etcd answers (`retry_pending_commits`).

That call does not wait for the hashes of the step's files (`fs.model.pending_commits`): with every
file of the step in RAM on this node it commits with a pending record (names, sizes, modes and a
snapshot of each file, durable) and returns; the hashes, the manifest, the cluster's record and
the `CommitSink` follow in the background, under the step's lock, which any other commit of the
step takes first (so it finishes the pending one before it looks at the step). A step whose
files other nodes hold (a multi-node DCP save: its commit record in etcd names every file's
digest), `--sync-replicas`, and the other triggers (quiet, `tierfs commit`, renames) wait for
the hashes as before.

With --sync-replicas (a `CopiesWait`), that call returns only once every file of the step it
committed has K + 1 verified copies on live nodes, waiting at most `saver_wait` seconds more;
then it fails with ETIMEDOUT (the step stays committed, and its copies go on). Without it, the
call returns at the commit and the copies follow: the window between save and copies.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs.fs.model import tree_walk
from tierfs.fs.model.latest_pins import thread_group
from tierfs.fs.model.nodes import METADATA, FsError, Node, Seal, StepState, some_names
from tierfs.fs.model.ports import (
    BringBack,
    CommitSink,
    CommitTiers,
    CoordinationUnavailable,
    CopiesWait,
    EventSink,
    OwedMarks,
    RoomInRam,
)
from tierfs.fs.store.ram_store import RamFull

if TYPE_CHECKING:
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.cut_short import CutShort
    from tierfs.fs.tree.sealing import Sealing
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.step_manifests import StepManifests
    from tierfs.fs.tree.tree import Tree

log = logging.getLogger(__name__)

SAVER_WAIT = 20.0  # seconds a saver's call that commits waits for etcd, by default
# seconds a commit not made by a saver's call (quiet, retried, `tierfs commit`) waits for it
BACKGROUND_WAIT = 20.0
# Seconds before the first retry of a commit's finish that found no room for its manifest
# (then doubled, up to FINISH_RETRY_MAX): the RAM dir's file system, a /dev/shm other processes
# share, may have room again.
FINISH_RETRY = 0.5
FINISH_RETRY_MAX = 30.0
# Seconds between the rounds that try pending commits again (shards elsewhere, no space).
PENDING_RETRY = 0.5
# The longest pause before a commit that failed for want of the cluster (etcd away, a node
# that writes the step down) is tried again: the pause doubles from PENDING_RETRY at each
# failure in a row, so that a step whose writer is gone for good costs etcd and the log
# little (on every node of a large cluster), and one that comes back is seen within it.
COORDINATION_RETRY_MAX = 8.0

# What a commit waits for (`tierfs commit` shows it after a second, and when it gives up).
ANOTHER_COMMIT = "another commit of the step"
OPEN_WRITERS = "open writers"
DCP_FILES = "the files its .metadata names"
OTHER_TIERS = "its files to come back from other tiers"
SEALS = "the checksums of its files"
COPIES = "private copies of its files open for writing"


class Waiting:
    """What one commit waits for now (one of the phrases above)."""

    __slots__ = ("what",)

    def __init__(self) -> None:
        self.what = ANOTHER_COMMIT


class Commits:
    """Commits of step directories (see the module docstring)."""

    def __init__(self, tree: Tree, room: RoomInRam, bring_back: BringBack,
                 cluster: CommitTiers, marks: OwedMarks, sink: CommitSink, events: EventSink,
                 saver_wait: float = SAVER_WAIT, copies_wait: CopiesWait | None = None, *,
                 identity: StepIdentity, manifests: StepManifests, sealing: Sealing,
                 cut_short: CutShort, store: RamStore) -> None:
        self.tree = tree
        self._identity = identity  # which directories are steps, single files or neither
        self._manifests = manifests  # the commit's change of the tree: pending, then written
        self._sealing = sealing  # the files' hashes
        self._cut_short = cut_short  # files a write into failed (no room)
        self._store = store  # the RAM store: the commit's copies of files still open
        self._room = room  # room in RAM for a commit's copies of open files
        self._bring_back = bring_back  # files of other tiers a commit needs in RAM
        self._cluster = cluster  # the shards other nodes hold; the records of seals and commits
        self._marks = marks  # persisted marks owed
        self.sink = sink
        self.events = events  # the commit's event line and metrics
        self.saver_wait = saver_wait  # see the module docstring
        self.copies_wait = copies_wait  # --sync-replicas (see the module docstring)
        self._waiting: dict[StepState, Waiting] = {}  # the commit of each step that holds its lock

    async def commit(self, step_node: Node, *, wait_for_writers: bool,
                     patience: float = math.inf, deadline: float | None = None,
                     hashes_later: bool = False, by_idle: bool = False
                     ) -> mf.StepManifest | None:
        """Commit `step_node` now; with writers still open either wait or leave it pending.
        After `patience` seconds of waiting and preparing, give up (FsError ETIMEDOUT) with
        nothing changed. What it waits for from the cluster (etcd) it waits for until
        `deadline` (trio time; by default BACKGROUND_WAIT from now), then leaves it pending and
        raises `CoordinationUnavailable`. `hashes_later`: the commit may be made before its
        files' hashes are in (see the module docstring). `by_idle`: made by the quiet rules
        (`fs.lifecycle.quiet_commits`), not by its saver (`StepManifest.by_idle`).

        Returns the manifest in force after the commit, or None when left pending or when
        committed with its hashes to come (then the manifest follows in the background).
        """
        step = step_node.step
        if step is None:
            raise FsError(errno.EINVAL, "not a step directory")
        started = time.monotonic()
        if deadline is None:
            deadline = trio.current_time() + BACKGROUND_WAIT
        waiting = Waiting()
        try:
            with trio.move_on_after(patience) as attempt:
                manifest, old = await self._commit_locked(step_node, step, wait_for_writers,
                                                          waiting, deadline, hashes_later,
                                                          by_idle)
        except CoordinationUnavailable as exc:
            self._manifests.leave_pending(step, f"{exc.waits_for}: {exc}")
            step.coordination_failures += 1
            step.retry_commit_at = trio.current_time() + min(
                COORDINATION_RETRY_MAX, PENDING_RETRY * 2 ** (step.coordination_failures - 1))
            raise
        except (OSError, RamFull) as exc:
            # Retried (retry_pending_commits) until it succeeds; `status` shows why it waits.
            self._manifests.leave_pending(step, "space: " + (
                "the RAM tier is full" if isinstance(exc, RamFull)
                else exc.strerror or str(exc)))
            raise
        step.coordination_failures, step.retry_commit_at = 0, 0.0
        if attempt.cancelled_caught:
            raise FsError(errno.ETIMEDOUT, f"not committed: gave up after {patience:g} s "
                          f"waiting for {self._describe(step_node, waiting.what)}")
        if manifest is None:
            if step.pending is not None and not step.commit_pending:  # committed, hashes later
                self._manifests.note_waiting(step, None)
                log.info("%s v%d committed; its %d files are hashed in the background",
                         self.tree.relpath(step_node), step.pending.record.version,
                         len(step.pending.record.files))
                assert self._sealing.spawner is not None
                self._sealing.spawner.spawn(self._finish_in_background, step_node, step,
                                            started)
            return None
        self._manifests.note_waiting(step, None)
        if manifest is not old:
            await self.announce(step_node, manifest, started, deadline)
        return manifest

    async def announce(self, step_node: Node, manifest: mf.StepManifest, started: float,
                       deadline: float | None = None) -> None:
        """A new version was committed (`started`: monotonic time its commit began): the
        cluster's record (waited for until `deadline`, trio time), the event, then its
        uploads and replicas, unless another node's commit of the same save, which etcd
        recorded, took its place while its record was written (`OtherTiers.learn`): that one
        goes to them instead (`CopyPlans.learned`), and this one, the same version, would
        take its place in their queues, where it is no longer current and does nothing."""
        if deadline is None:
            deadline = trio.current_time() + BACKGROUND_WAIT
        await self._cluster.publish(step_node, manifest, deadline)  # the cluster's record
        self.events.committed(manifest, time.monotonic() - started)
        if step_node.step is not None and step_node.step.manifest is manifest:
            await self.sink.send(manifest)

    async def _finish_in_background(self, step_node: Node, step: StepState,
                                    started: float | None) -> None:
        """Part 2 of a commit made before its hashes were in (see `fs.model.pending_commits`)."""
        try:
            async with step.lock:
                await self._finish_pending(step_node, step, started)
        except CoordinationUnavailable as exc:
            log.info("commit of %s waits for %s: %s", self.tree.relpath(step_node),
                     exc.waits_for, exc)
        except (OSError, FsError) as exc:  # left pending: finished by a retry (space may come
            # back: a /dev/shm other processes filled), the step's next commit or start-up
            pending = step.pending
            if pending is not None and isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                pending.failures += 1
                pending.retry_at = trio.current_time() + min(
                    FINISH_RETRY_MAX, FINISH_RETRY * 2 ** (pending.failures - 1))
            log.log(logging.ERROR if pending is None or pending.failures <= 1 else logging.DEBUG,
                    "commit of %s: its hashes or manifest failed: %s",
                    os.fsdecode(step_node.name), exc)

    async def finish_pending(self, step_node: Node) -> None:
        """The step's commit made before its hashes were in, if it still shows committed,
        finished now (joining its hashes; at once if it was finished already): what
        `tierfs verify` checks is its manifest, and hashing the only copy is that check."""
        step = step_node.step
        if step is None or step.pending is None or step.pending.superseded:
            return
        await self._finish_in_background(step_node, step, None)

    async def _finish_pending(self, step_node: Node, step: StepState,
                              started: float | None = None) -> None:
        """The step's pending commit, if any, finished: its files' hashes, its manifest, then
        the cluster's record and the `CommitSink`. The caller holds the step's lock."""
        pending = step.pending
        if pending is None:
            return
        store = self._store
        self._sealing.start_all([node for node, gen in pending.nodes.values()
                                 if node.gen == gen])
        digests = {}
        for f in pending.record.files:
            if step_node.step is not step or step_node.parent is None:
                break  # gone: no hash needed
            node, gen = pending.nodes[f.name]
            digests[f.name] = await self._sealing.hash_committed(
                node, gen, store.snapshot_path(f.snapshot))
        # From here to the end of StepManifests.finish_pending there is no await.
        if step_node.step is not step or step_node.parent is None:
            log.info("%s: its pending version %d went with it (removed or no longer a step)",
                     os.fsdecode(step_node.name), pending.record.version)
            self._manifests.drop_pending(step_node, step)
            return
        old = step.manifest
        manifest = self._manifests.finish_pending(step_node, digests)
        if manifest is not old:
            await self.announce(step_node, manifest,
                                time.monotonic() if started is None else started)

    def waiting_for(self, relpath: str) -> str | None:
        """What the commit in progress of the step at `relpath` waits for (None: none runs)."""
        step_node = self.tree.find_step(relpath)
        waiting = self._waiting.get(step_node.step) if step_node is not None else None
        return None if waiting is None else self._describe(step_node, waiting.what)

    def _describe(self, step_node: Node, what: str) -> str:
        """`what`, with the files being written and who opened them for OPEN_WRITERS."""
        if what != OPEN_WRITERS:
            return what
        writers = []
        for node in tree_walk.walk_files(step_node):
            if node.active_writers:
                pids = sorted({thread_group(h.pid) for h in node.handles if h.active and h.pid})
                writers.append(self.tree.relpath(node)
                               + (f" (pid {', '.join(map(str, pids))})" if pids else ""))
        return f"{what}: {some_names(writers)}" if writers else what

    async def _commit_locked(self, step_node: Node, step: StepState, wait_for_writers: bool,
                             waiting: Waiting, deadline: float, hashes_later: bool,
                             by_idle: bool = False
                             ) -> tuple[mf.StepManifest | None, mf.StepManifest | None]:
        """The commit itself: (the manifest in force after it, the one before), or (None, _)
        when it is left pending or committed with its hashes to come (`step.pending`).
        Attempts go round until one finds nothing moved (see the module docstring)."""
        tree = self.tree
        async with step.lock:
            self._waiting[step] = waiting
            try:
                waiting.what = SEALS
                await self._finish_pending(step_node, step)  # an earlier version's, first
                if step_node.step is not step or step_node.parent is None:
                    return None, None
                while True:
                    released = tree.released
                    if tree_walk.has_active_writers(step_node):
                        if not wait_for_writers:
                            self._manifests.leave_pending(step, "open writers")
                            log.info("commit of %s waits for open writers",
                                     tree.relpath(step_node))
                            return None, None
                        waiting.what = OPEN_WRITERS
                        await released.wait()
                        continue
                    waiting.what = DCP_FILES
                    if not await self._cluster.locate_files(step_node, deadline):
                        self._manifests.leave_pending(
                            step, "files named by its .metadata or written on other nodes")
                        return None, None  # retried by retry_pending_commits
                    shape = tree.shape
                    files = list(tree_walk.files_under(step_node))
                    elsewhere = self._cluster.held_elsewhere(step_node)  # stay where they are
                    later = hashes_later and self._may_hash_later(step_node, files, elsewhere)
                    await self._resident_and_sealed(files, elsewhere, waiting, later)
                    waiting.what = COPIES
                    copies: dict[Node, bytes] = {}  # private copies made for this attempt
                    cut_to: dict[Node, Seal | tuple[int, int, int]] = {}  # what each copy is
                    try:
                        await self._copy_open_files(files, copies, cut_to, later)
                        # From here to the end of StepManifests.write_manifest (write_pending)
                        # there is no await.
                        if self._still_ready(step_node, step, files, shape, elsewhere, cut_to,
                                             later):
                            old = step.manifest
                            if later:
                                self._manifests.write_pending(step_node, files, copies)
                                return None, old
                            return self._manifests.write_manifest(step_node, files, copies,
                                                                  by_idle=by_idle), old
                    finally:
                        for copy in copies.values():  # those the manifest did not take
                            self._store.discard(copy)
                    if step_node.step is not step or step_node.parent is None:
                        return None, None  # renamed away or removed while it was being sealed
            finally:
                del self._waiting[step]

    def _may_hash_later(self, step_node: Node, files: list[tuple[str, Node]],
                        elsewhere: set[str]) -> bool:
        """Whether this commit may be made before its hashes are in: a step directory whose
        files are all here, with a hash still to come, no --sync-replicas, and a background
        running to finish it in (a namespace driven in-process without one commits as
        before)."""
        spawner = self._sealing.spawner
        return (step_node.is_dir and self.copies_wait is None and not elsewhere
                and spawner is not None and spawner.running
                and all(node.remote is None for _rel, node in files)
                and any(node.seal is None for _rel, node in files))

    async def _resident_and_sealed(self, files: list[tuple[str, Node]], elsewhere: set[str],
                                   waiting: Waiting, later: bool = False) -> None:
        """Bring back the files held only by other tiers, and seal the unsealed ones (unless
        the hashes come `later`)."""
        if not later:
            self._sealing.start_all([node for _rel, node in files])
        for rel, node in files:
            if node.remote is not None and rel not in elsewhere and not node.remote.in_store:
                waiting.what = OTHER_TIERS
                await self._bring_back.make_resident(node, empty=False)
            if node.seal is None and node.remote is None and not later:
                waiting.what = SEALS
                await self.tree.seal(node)  # may come back unsealed: _still_ready sees it

    async def _copy_open_files(self, files: list[tuple[str, Node]], copies: dict[Node, bytes],
                               cut_to: dict[Node, Seal | tuple[int, int, int]],
                               later: bool = False) -> None:
        """Private copies, for the objects, of sealed files that a handle could still write
        into (one whose object exists already needs none); each recorded as it is made, so
        that the caller removes it whatever happens next. With the hashes to come `later`,
        every such file is copied, sealed or not (its snapshot must be bytes no handle can
        write, `fs.model.pending_commits`)."""
        tree = self.tree
        store = self._store
        for _rel, node in files:
            seal = node.seal
            if not node.open_for_writing:
                continue
            if later and (seal is None or store.object_path(seal.digest.xxh3).exists()):
                await self._copy_unsealed(node, copies, cut_to)
                continue
            if seal is None or store.object_path(seal.digest.xxh3).exists():
                continue
            await self._room.make_room(seal.digest.size)
            if node.seal is not seal or not tree.has_backing(node):
                continue  # written or removed meanwhile: _still_ready sees it
            try:
                copy = await trio.to_thread.run_sync(
                    store.copy, tree.backing(node), os.fsencode(store.objects),
                    seal.digest.size)
            except FileNotFoundError:
                continue  # removed or renamed while it was copied: _still_ready sees it
            store.account_path(copy)
            copies[node] = copy
            cut_to[node] = seal

    async def _copy_unsealed(self, node: Node, copies: dict[Node, bytes],
                             cut_to: dict[Node, Seal | tuple[int, int, int]]) -> None:
        """A private copy of a file a handle could still write into, for a commit whose hashes
        come later: recorded with the (inode, size, mtime) it was copied at, which
        `_file_ready` checks the file still has (passthrough writes behind the daemon)."""
        store = self._store
        try:
            path = self.tree.backing(node)
            before = os.lstat(path)
            await self._room.make_room(before.st_size)
            copy = await trio.to_thread.run_sync(
                store.copy, path, os.fsencode(store.objects), before.st_size)
        except (FileNotFoundError, FsError):
            return  # removed or renamed meanwhile: _still_ready sees it
        store.account_path(copy)
        copies[node] = copy
        try:
            after = os.lstat(path)
        except FileNotFoundError:
            return
        if _stat_key(before) == _stat_key(after):
            cut_to[node] = _stat_key(after)

    def _still_ready(self, step_node: Node, step: StepState, files: list[tuple[str, Node]],
                     shape: int, elsewhere: set[str],
                     cut_to: dict[Node, Seal | tuple[int, int, int]], later: bool = False
                     ) -> bool:
        """After an attempt's awaits: whether everything it checked and prepared still holds
        (no await here; the manifest is written right after a True). `files` were listed
        when the tree's shape was `shape`."""
        tree = self.tree
        # Unsealed files (hashes to come `later`) are checked against their copies instead.
        stale = self._sealing.stale([(rel, node) for rel, node in files
                                     if not later or node.seal is not None])
        for node in stale:  # open for writing with no seal of its bytes: being written
            tree.written_behind_seal(node)
        return not (stale or tree_walk.has_active_writers(step_node)
                    or step_node.step is not step or step_node.parent is None
                    or (tree.shape != shape and files != list(tree_walk.files_under(step_node)))
                    or not all(self._file_ready(rel, node, elsewhere, cut_to, later)
                               for rel, node in files))

    def _file_ready(self, rel: str, node: Node, elsewhere: set[str],
                    cut_to: dict[Node, Seal | tuple[int, int, int]], later: bool) -> bool:
        """A file can go into the manifest: held by other nodes, or sealed, with a private
        copy of exactly the sealed bytes if a handle could still write into it (or an object
        of those bytes already). With the hashes to come `later`: in RAM, unsealed too, with
        a private copy of its bytes as they still are if a handle could write into it."""
        if node.remote is not None:  # named as it is: its bytes stay where they are
            return rel in elsewhere or node.remote.in_store
        writable = node.open_for_writing
        if later:
            if node in cut_to:
                cut = cut_to[node]
                if isinstance(cut, Seal):
                    return node.seal is cut
                try:
                    return _stat_key(os.lstat(self.tree.backing(node))) == cut
                except (FsError, FileNotFoundError):
                    return False
            return not writable
        if node.seal is None:
            return False
        if node in cut_to:
            return node.seal is cut_to[node]
        return not writable or self._store.object_path(node.seal.digest.xxh3).exists()

    async def commit_path(self, relpath: str, timeout: float = math.inf) -> mf.StepManifest:
        """`tierfs commit PATH`: commit the step (a directory or a single file) at `relpath`,
        waiting for writers; after `timeout` seconds give up (FsError ETIMEDOUT)."""
        node = self.tree.find_step(relpath) or self.tree.find_dir(relpath)
        if node.step is None:
            raise FsError(errno.EINVAL,
                          f"{relpath} is not a step directory (its name does not match "
                          f"--step-pattern {self._identity.pattern.pattern!r}, "
                          "or it holds step directories itself)")
        try:
            manifest = await self.commit(node, wait_for_writers=True, patience=timeout)
        except CoordinationUnavailable as exc:
            raise FsError(errno.ETIMEDOUT, f"{relpath} could not commit: {exc}; it commits "
                          f"by itself once {_answers(exc)}") from None
        if manifest is None:
            missing = await self._cluster.missing_dcp_files(node)
            if missing:
                raise FsError(errno.EAGAIN, f"{relpath} is not complete: its .metadata names "
                              f"{len(missing)} files that are not there yet "
                              f"({some_names(missing)}); it "
                              "commits by itself when they are")
            raise FsError(errno.EAGAIN, f"{relpath} could not commit yet (see the log)")
        return manifest

    async def commit_quietly(self, step_node: Node, *, by_idle: bool = False) -> None:
        """Commit triggered as a side effect of a user's call: failures are logged, not raised.
        `by_idle`: by the quiet rules (`commit`). A step holding a file a write into failed
        for want of room does not commit so (`fs.tree.cut_short`): it stays `writing`, saying
        why."""
        cut = self._cut_short.in_step(step_node)
        if cut is not None and step_node.step is not None:
            self._manifests.note_waiting(step_node.step, cut_short_reason(cut))
            return
        try:
            await self.commit(step_node, wait_for_writers=False, by_idle=by_idle)
        except CoordinationUnavailable as exc:
            # Said at the 1st, 2nd, 4th, 8th... failure in a row: a step whose writer is gone
            # for good is retried for as long as it stays, and need not fill the log.
            failures = step_node.step.coordination_failures if step_node.step else 1
            log.log(logging.INFO if failures & (failures - 1) == 0 else logging.DEBUG,
                    "commit of %s waits for %s: %s", self.tree.relpath(step_node),
                    exc.waits_for, exc)
        except (OSError, FsError) as exc:
            log.error("commit of %s failed: %s", os.fsdecode(step_node.name), exc)
        except Exception:  # a bug must not take the file system down with it
            log.exception("commit of %s failed", os.fsdecode(step_node.name))

    async def commit_for_saver(self, step_node: Node) -> None:
        """Commit triggered by the saver's own call (`.metadata` closed after writing or renamed
        into place): a failure is that call's error, so the save fails instead of returning
        success for a step that did not commit. The commit is retried meanwhile. What it
        waits for from etcd it waits for `saver_wait` seconds in all (ETIMEDOUT), also for
        the commit record of a step whose files other nodes hold (without it they do not
        list the step)."""
        path = self.tree.relpath(step_node)
        try:
            manifest = await self.commit(step_node, wait_for_writers=False,
                                         deadline=trio.current_time() + self.saver_wait,
                                         hashes_later=True)
        except CoordinationUnavailable as exc:
            log.error("commit of %s failed: %s within %.0f s; the step stays writing and "
                      "commits by itself once %s", path, exc, self.saver_wait, _answers(exc))
            raise FsError(errno.ETIMEDOUT) from None
        except RamFull:
            log.error("commit of %s failed: the RAM tier is full; retried when space frees",
                      self.tree.relpath(step_node))
            raise FsError(errno.ENOSPC) from None
        except OSError as exc:
            log.error("commit of %s failed: %s; retried when it can succeed",
                      self.tree.relpath(step_node), exc.strerror or exc)
            raise FsError(exc.errno or errno.EIO) from None
        step = step_node.step
        if (manifest is not None and self._cluster.awaits_publication(manifest)
                and step is not None and step.manifest is manifest and not step.in_ram):
            log.error("%s is committed on this node, but etcd did not take its commit record "
                      "within %.0f s: the nodes holding its other files list it once etcd "
                      "answers; the saver's call fails", path, self.saver_wait)
            raise FsError(errno.ETIMEDOUT)
        if manifest is not None and self.copies_wait is not None:
            await self._wait_for_copies(path, manifest)

    async def _wait_for_copies(self, path: str, manifest: mf.StepManifest) -> None:
        """--sync-replicas: the saver's call returns once every file has its copies."""
        assert self.copies_wait is not None
        started = time.monotonic()
        try:
            await self.copies_wait(manifest, trio.current_time() + self.saver_wait)
        except CoordinationUnavailable as exc:
            log.error("%s is committed, but not every file of it has its copies within %.0f s "
                      "(--sync-replicas): %s; they are still being made; the saver's call "
                      "fails", path, self.saver_wait, exc)
            raise FsError(errno.ETIMEDOUT) from None
        log.info("%s v%d: every file has its copies, %.3f s after the commit "
                 "(--sync-replicas)", path, manifest.version, time.monotonic() - started)

    async def after_writer(self, node: Node) -> None:
        """A writer of `node` is done (the FLUSH of a close()): a `.metadata` closed after
        writing, or a pending commit whose last writer this was, commits its step now (a file
        step at its RELEASE, `after_release`; a loose file once quiet)."""
        self.writer_done(node)
        parent = node.parent
        if parent is None:
            return
        if node.name == METADATA and parent.step is not None:
            await self.commit_for_saver(parent)
        await self.run_pending_commits(node)

    def writer_done(self, node: Node) -> None:
        """What every writer's end does, whether or not it commits (`after_writer`; alone for
        one that `commits_after_writer` says commits nothing)."""
        if node.parent is not None:
            self._identity.touch_enclosing(node)  # its step commits `commit_idle` s after this
            self._cluster.note_sealed(node)  # the cluster records which node holds the file

    def commits_after_writer(self, node: Node) -> bool:
        """Whether `after_writer(node)` may commit a step (else it never waits: a writer's
        close() then needs no turn of the loop of its own, `Namespace.flush_now`)."""
        parent = node.parent
        return parent is not None and (
            (node.name == METADATA and parent.step is not None)
            or any(step_node.step.commit_pending for step_node in tree_walk.enclosing_steps(node)))

    @staticmethod
    def commits_after_release(node: Node) -> bool:
        """Whether `after_release(node)` may commit a step (a file step not yet committed)."""
        return (node.parent is not None and node.is_file and node.step is not None
                and not node.step.committed)

    async def after_release(self, node: Node) -> None:
        """An open file of `node` that could write into it is gone (its RELEASE)."""
        if node.parent is not None:
            await self.commit_file_step(node)

    async def commit_file_step(self, node: Node) -> None:
        """A file step commits once no open file could write into it (a loose file waits to be
        quiet): at the RELEASE after its writer's close(), not at that close's FLUSH, after
        which writes through a duplicate of the descriptor may still come. So its bytes become
        the committed object as they are, where a commit at the FLUSH had to copy the whole
        file first (`Commits._copy_open_files`: twice the RAM, and a close that waited
        for the copy).

        A tracker (DeepSpeed's `latest`, Megatron-LM's `latest_checkpointed_iteration.txt`)
        commits so too, each version: a saver rewrites it at every save, often more often
        than `--commit-idle`, and a tracker that waited to be quiet never reached another
        tier. Its saver writes it once the step it names is complete, so that step commits
        first (the saver's mark, as `.metadata` is DCP's).

        Any other loose file its writers wrote whole (`Node.written_whole`: Lightning's
        `last.ckpt`, `torch.save(m, "best.pt")`) commits a moment after (`SETTLED`), not
        once quiet: a node lost in the --commit-idle after such a save lost it. The moment
        lets the attributes set right after the close join the version (`shutil.copy2`,
        `cp -p`), and a temporary file renamed or removed at once never commit under its
        name. One changed in place or appended waits to be quiet (it may be written again at
        once: a log)."""
        step = node.step
        if not self.commits_after_release(node) or node.active_writers or node.open_for_writing:
            return
        identity = self._identity
        if step.number is None and identity.is_tracker(node):
            named = identity.tracked_dir(node, adopt=True)
            if named is not None and not named.step.shown_committed and \
                    not tree_walk.has_active_writers(named):
                await self.commit_quietly(named)
        elif step.number is None:
            identity.touch_enclosing(node, settled=node.written_whole)
            return
        if node.step is step and node.parent is not None:
            await self.commit_quietly(node)

    async def run_pending_commits(self, dir_node: Node | None) -> None:
        for step_node in list(tree_walk.enclosing_steps(dir_node)):
            if step_node.step.commit_pending and not tree_walk.has_active_writers(step_node):
                await self.commit_quietly(step_node)

    async def keep_retrying(self) -> None:
        """Every PENDING_RETRY: the commits that wait for other nodes' shards, or failed (a full
        RAM dir), try again (`retry_pending_commits`); so do the persisted marks a full RAM dir
        had no room for."""
        while True:
            await trio.sleep(PENDING_RETRY)
            await self.retry_pending_commits()
            self._marks.write_owed_marks()

    async def retry_pending_commits(self) -> None:
        """Commits left pending (writers, or shards not yet found on other nodes) try again,
        and so do the finishes of commits made before their hashes that failed (their step
        may never be committed again: it would stay unhashed, on this node only)."""
        for step_node in list(self.tree.steps()):
            step = step_node.step
            pending = step.pending
            if pending is not None and pending.retry_at is not None and \
                    pending.retry_at <= trio.current_time() and not step.lock.locked():
                pending.retry_at = None
                await self._finish_in_background(step_node, step, time.monotonic())
                if step_node.step is not step:
                    continue  # removed, or no longer a step, meanwhile
            if step.commit_pending and step.retry_commit_at <= trio.current_time() \
                    and not tree_walk.has_active_writers(step_node):
                await self.commit_quietly(step_node)


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    """What a file's bytes are known by while no seal describes them: inode, size, mtime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def cut_short_reason(path: str) -> str:
    """What a step holding a file that may be cut short waits for (status `waiting_for`)."""
    return (f"{path} to be written again: a write into it failed for want of room, so it "
            "may be cut short (or `tierfs commit` it as it is)")


def _answers(exc: CoordinationUnavailable) -> str:
    """What a commit that failed with `exc` waits for, as "... once X" ends."""
    if exc.waits_for == CoordinationUnavailable.ETCD:
        return "etcd answers"
    return f"{exc.waits_for} answer"
