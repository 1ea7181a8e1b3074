"""Appended loose files: a log or a TensorBoard event file under a run directory that grows for
as long as the job runs.

Two things would otherwise go wrong with such a file. Appended more often than `--commit-idle`
it never falls quiet, so it never commits and lives only in this node's RAM (lost with the
node); appended more slowly, every append commits a new version and the store would get the
whole file again each time. So:

* `AppendSnapshots` commits a loose file that has been written for `--append-every` seconds
  without committing, while it is still being written: a private copy of its bytes so far
  (the writer goes on undisturbed), sealed, becomes its next version, provided that copy
  extends the version before it (bytes are only added: a file rewritten in place waits to be
  quiet, as before, since a copy of it could be half written). A name with a checkpoint
  extension (`last.ckpt`) or a tracker (`latest`) is never committed this way: a copy of one
  being written would be a partial checkpoint.
* `fs.model.append_layout.lay_out` decides, at every commit of a loose file, how the persistent tier
  holds the new version (`FileEntry.segments`): a version that extends the one before it keeps
  that one's objects and adds one segment with the new bytes, so only the appended bytes
  travel (`s3tier.segments` sends and reads them).
* At start-up, a loose file appended after its last version keeps what was appended
  (`fs.lifecycle.recovery`, `append_layout.appended_to`), and commits again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs.fs.model.append_layout import extends, lay_out, never_snapshot
from tierfs.fs.model.ports import Announcer, CoordinationUnavailable, RoomInRam
from tierfs.fs.tree.dir_attributes import recorded

if TYPE_CHECKING:
    from tierfs.fs.lifecycle.quiet_watch import QuietWatch
    from tierfs.fs.model.nodes import Node
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.records import StepRecords
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.tree import Tree

log = logging.getLogger(__name__)

class AppendSnapshots:
    """Commits loose files still being written every `append_every` seconds (see the module
    docstring). Works on the steps the quiet watch holds: those being written."""

    def __init__(self, tree: Tree, watch: QuietWatch, commits: Announcer, room: RoomInRam,
                 append_every: float, *, records: StepRecords, residents: Residents,
                 store: RamStore) -> None:
        self.tree = tree
        self._records = records
        self._residents = residents
        self._store = store
        self.watch = watch
        self.commits = commits
        self._room = room  # room in RAM for a snapshot of the file
        self.append_every = append_every
        self._since: dict[Node, float] = {}  # file -> when its current stretch of writes began

    def _candidate(self, node: Node) -> bool:
        step = node.step
        return (node.is_file and step is not None and step.number is None
                and node.parent is not None and node.remote is None and not step.committed
                and not never_snapshot(node.name) and self.tree.has_backing(node))

    async def run(self) -> None:
        """The daemon's background task (only with a positive `append_every`)."""
        tick = max(0.05, self.append_every / 4)
        while True:
            await trio.sleep(tick)
            now = time.monotonic()
            for node in list(self.watch.due):
                if not self._candidate(node):
                    self._since.pop(node, None)
                    continue
                since = self._since.setdefault(node, now)
                if now - since >= self.append_every:
                    self._since[node] = now
                    await self.snapshot(node)
            for node in [n for n in self._since if n not in self.watch.due]:
                del self._since[node]  # committed, removed or renamed: a new stretch later

    async def snapshot(self, node: Node) -> mf.StepManifest | None:
        """Commit what `node` holds now as its next version if that extends its last one;
        the file goes on being written. Returns the new manifest, or None."""
        try:
            return await self._snapshot(node)
        except CoordinationUnavailable as exc:
            log.info("append snapshot of %s waits for etcd: %s", self.tree.relpath(node), exc)
        except (OSError, mf.ManifestError) as exc:
            log.warning("append snapshot of %s failed: %s", self.tree.relpath(node), exc)
        except Exception:  # a bug must not take the file system down with it
            log.exception("append snapshot of %s failed", self.tree.relpath(node))
        return None

    async def _snapshot(self, node: Node) -> mf.StepManifest | None:
        tree, store = self.tree, self._store
        step = node.step
        assert step is not None
        started = time.monotonic()
        async with step.lock:
            if not self._candidate(node) or node.step is not step:
                return None
            path = tree.relpath(node)
            old = step.manifest
            size = os.lstat(tree.backing(node)).st_size
            if old is not None and old.path == path and size <= old.files[0].size:
                return None  # nothing new (or shorter: not an append)
            await self._room.make_room(size)
            if not self._candidate(node) or node.step is not step or step.manifest is not old:
                return None
            copy = await trio.to_thread.run_sync(store.copy, tree.backing(node),
                                                 os.fsencode(store.objects), size)
            store.account_path(copy)
            try:
                digest = await trio.to_thread.run_sync(mf.hash_file, copy)
                if node.step is not step or node.parent is None or step.manifest is not old:
                    return None  # removed, renamed or committed meanwhile
                manifest = self._install(node, path, old, digest, copy)
                copy = None
            finally:
                if copy is not None:
                    with contextlib.suppress(FileNotFoundError):  # or made the object
                        store.discard(copy)
        if manifest is not None:
            log.info("%s v%d: %d bytes committed while it is being appended", path,
                     manifest.version, digest.size)
            await self.commits.announce(node, manifest, started)
        return manifest

    def _install(self, node: Node, path: str, old: mf.StepManifest | None, digest: mf.Digest,
                 copy: bytes) -> mf.StepManifest | None:
        """The snapshot's commit (no await): its manifest on disk, the copy its object, the
        step's new version. The step stays `writing`: the file is still being written, and
        commits again (by this or once quiet) with what is added. None if the copy does not
        extend the last version (the copy is then removed)."""
        tree, store = self.tree, self._store
        step = node.step
        entry = mf.entry_from_stat(os.fsdecode(node.name), digest, os.lstat(copy))
        if old is not None and old.path == path:
            if not extends(old.files[0], entry, copy):
                store.discard(copy)
                return None
            entry = lay_out(old, path, entry, copy)
        manifest = mf.StepManifest(
            path=path, step=mf.NO_STEP, version=old.version + 1 if old else 1,
            node_id=tree.node_id, committed_ns=time.time_ns(), files=(entry,),
            single_file=True, dirs=recorded(node, tree.backing, tree.relpath))
        manifest_path = os.path.join(tree.records_path(node), mf.MANIFEST_NAME.encode())
        tmp = self._records.write_temp(manifest_path, mf.encode(manifest))
        store.add_ref(entry.xxh3, tree.backing(node), copy)
        os.rename(tmp, manifest_path)
        self._residents.drop_resident_refs(step)
        step.manifest = manifest
        step.resident = {entry.name}
        step.commit_pending = False
        return manifest
