"""The commit's one change to the tree: a step's manifest written (temp, fsync, objects linked,
rename), its files' objects referenced in the RAM store and its state committed, all in one
synchronous call (see `fs.tree.tree`: no await may come between the commit's last check and this);
and the step state a commit waits in (pending, what for, the files a DCP `.metadata` names).
Part of the tree's core; `fs.lifecycle.commits` decides when.

* `write_manifest` runs without any `await` from the moment the commit re-checks the step (no
  active writer, every file sealed, same set of files) until the manifest is renamed into place
  and the in-memory state updated: a concurrent handler sees either the old state or the new
  one, never a manifest that disagrees with the tree.
* Order on disk: write the manifest's temp file, fsync, link the objects, rename. A crash before
  the rename leaves only unreferenced objects, which start-up removes; the step stays
  `writing`. A full RAM dir fails the first of these, before anything changed."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierfs import manifest as mf
from tierfs.fs.model import append_layout
from tierfs.fs.model import pending_commits as pc
from tierfs.fs.model.nodes import FsError, Node, Pending, Seal, StepState
from tierfs.fs.tree.dir_attributes import recorded, times_kept

if TYPE_CHECKING:
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.records import StepRecords
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.tree_primitives import TreePrimitives


class StepManifests:
    """The commits of one mount's tree (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, residents: Residents, *, records: StepRecords,
                 store: RamStore) -> None:
        self.tree = tree
        self._records = records
        self._store = store
        self._residents = residents

    def write_manifest(self, step_node: Node, files: list[tuple[str, Node]],
                       copies: dict[Node, bytes], *, by_idle: bool = False
                       ) -> mf.StepManifest:
        """The commit's change (see the module docstring: no await may come before it once
        the step is checked): the manifest on disk, the objects' references, the step state.
        Returns the old manifest if nothing changed since it. The private copies it makes
        committed objects leave `copies`; the caller removes the rest."""
        step = step_node.step
        old = step.manifest
        step_path = self.tree.relpath(step_node)
        number = mf.NO_STEP if step.number is None else step.number
        entries = []
        for rel, node in files:
            if node.remote is not None:  # held by other nodes (a multi-node step's shards)
                entries.append(dataclasses.replace(node.remote.entry, name=rel))
            elif node.seal.settled is not None and not node.open_for_writing:
                entries.append(node.seal.entry(rel))  # no writer since it settled
            else:
                entries.append(mf.entry_from_stat(rel, node.seal.digest,
                                                  os.lstat(self.tree.backing(node))))
        if step.number is None and step_node.is_file and files and files[0][1].remote is None:
            # a loose file: appended, only its new bytes go (fs.model.append_layout)
            node = files[0][1]
            entries = [append_layout.lay_out(old, step_path, entries[0],
                                       copies.get(node) or self.tree.backing(node))]
        dirs = recorded(step_node, self.tree.backing, self.tree.relpath)
        if (old is not None and old.path == step_path and old.step == number
                and (old.same_entries(entries) and old.same_own_dirs(dirs)
                     if step.attributes_changed else
                     old.same_content(mf.StepManifest(step_path, 0, 1, "", 0, tuple(entries))))):
            step.attributes_changed = False
            step.dirty = False
            step.commit_pending = False
            return old
        manifest = mf.StepManifest(
            path=step_path, step=number, version=old.version + 1 if old else 1,
            node_id=self.tree.node_id, committed_ns=time.time_ns(), files=tuple(entries),
            single_file=step_node.is_file, dirs=dirs, by_idle=by_idle,
        )

        def link_objects() -> None:
            for (_rel, node), entry in zip(files, entries, strict=True):
                if node.remote is None:
                    self._store.add_ref(entry.xxh3, lambda node=node: self.tree.backing(node),
                                        copies.get(node))
                    copies.pop(node, None)  # the object now, or removed by add_ref

        self._put_in_place(step_node, manifest, link_objects,
                           {rel for rel, node in files if node.remote is None})
        step.attributes_changed = False
        step.dirty = False
        step.commit_pending = False
        return manifest

    # -- a commit whose hashes come later (fs.model.pending_commits)
    # ------------------------------------

    def write_pending(self, step_node: Node, files: list[tuple[str, Node]],
                      copies: dict[Node, bytes]) -> Pending:
        """Part 1 of a pending commit, with no await since the commit's last check (as
        `write_manifest`): each file's snapshot (its private copy from `copies`, which it
        takes, else a hard link of its backing file), then the pending record, renamed into
        place: the commit point. Every file is in RAM (no file held only elsewhere)."""
        step = step_node.step
        store = self._store
        made: list[bytes] = []
        pending_files = []
        nodes: dict[str, tuple[Node, int]] = {}
        try:
            for rel, node in files:
                key = uuid.uuid4().hex
                snapshot = store.snapshot_path(key)
                copy = copies.pop(node, None)
                if copy is not None:
                    os.rename(copy, snapshot)
                else:
                    os.link(self.tree.backing(node), snapshot)
                made.append(snapshot)
                st = os.lstat(snapshot)
                pending_files.append(pc.PendingFile(rel, st.st_size, st.st_mtime_ns,
                                                    st.st_mode & 0o7777, st.st_uid, st.st_gid,
                                                    key))
                nodes[rel] = (node, node.gen)
            record = pc.PendingRecord(step.manifest.version + 1 if step.manifest else 1,
                                      time.time_ns(), tuple(pending_files))
            self._records.write_atomically(self._pending_path(step_node),
                                           pc.encode(record))  # may fail: ENOSPC
        except BaseException:
            for snapshot in made:
                store.drop_snapshot(snapshot)
            raise
        step.pending = Pending(record, nodes)
        step.commit_pending = False
        return step.pending

    def finish_pending(self, step_node: Node, digests: dict[str, mf.Digest]
                       ) -> mf.StepManifest:
        """Part 2, once every hash is in (no await): the manifest the commit would have
        written had it waited, its snapshots linked as committed objects; once it is in place,
        the record removed and the snapshots dropped (a crash at any point finds the record with
        every snapshot, or the manifest). Returns the old manifest if the content is the same
        as it (no new version)."""
        step = step_node.step
        pending = step.pending
        assert pending is not None
        old = step.manifest
        store = self._store
        step_path = self.tree.relpath(step_node)
        number = mf.NO_STEP if step.number is None else step.number
        entries = [f.entry(digests[f.name]) for f in pending.record.files]
        if (old is not None and old.path == step_path and old.step == number
                and old.same_entries(entries)):
            manifest = old
        else:
            manifest = mf.StepManifest(
                path=step_path, step=number, version=pending.record.version,
                node_id=self.tree.node_id, committed_ns=pending.record.committed_ns,
                files=tuple(entries), single_file=step_node.is_file,
                dirs=recorded(step_node, self.tree.backing, self.tree.relpath))

            def adopt_snapshots() -> None:
                for f, entry in zip(pending.record.files, entries, strict=True):
                    store.adopt_snapshot(entry.xxh3, store.snapshot_path(f.snapshot))

            self._put_in_place(step_node, manifest, adopt_snapshots,
                               {f.name for f in pending.record.files})
        # The record goes before its snapshots: a crash between leaves snapshots that no
        # record names, which the next start removes, never a record without them.
        self._remove_pending_record(step_node)
        for f in pending.record.files:
            store.drop_snapshot(store.snapshot_path(f.snapshot))
        step.pending = None
        # Changed since the pending commit: that change is a new version, still being written.
        step.dirty = pending.superseded
        for f, entry in zip(pending.record.files, entries, strict=True):
            node, gen = pending.nodes[f.name]
            if node.seal is None and node.gen == gen and not node.active_writers:
                with contextlib.suppress(OSError):
                    st = os.lstat(self.tree.backing(node))
                    if st.st_ino == os.lstat(store.object_path(entry.xxh3)).st_ino:
                        node.seal = Seal(mf.Digest.of(entry), st.st_ino, st.st_mtime_ns)
        return manifest

    def _put_in_place(self, step_node: Node, manifest: mf.StepManifest,
                      link_objects: Callable[[], None], resident: set[str]) -> None:
        """A new manifest on disk, in the order of the module docstring (its temp file, the
        objects linked by `link_objects`, the rename), then in the step's state."""
        step = step_node.step
        records = self.tree.records_path(step_node)
        manifest_path = os.path.join(records, mf.MANIFEST_NAME.encode())
        with times_kept(records):
            tmp = self._records.write_temp(manifest_path, mf.encode(manifest))  # ENOSPC
            link_objects()
            os.rename(tmp, manifest_path)
        self._residents.drop_resident_refs(step)
        step.manifest = manifest
        step.resident = resident
        # Peers acknowledge a version: those of the one before hold none of this one until
        # the cluster's records say so (a peer may have dropped its copy meanwhile: a step
        # renamed away and back was deleted there), as after a first commit.
        step.replicas = set()
        step.file_holders = {}

    def drop_pending(self, step_node: Node, step: StepState) -> None:
        """A pending commit whose step was removed or stopped being a step: its snapshots and
        record go (nothing of it left the node)."""
        pending = step.pending
        if pending is None:
            return
        for f in pending.record.files:
            self._store.drop_snapshot(self._store.snapshot_path(f.snapshot))
        with contextlib.suppress(OSError, FsError):  # its directory went with it
            self._remove_pending_record(step_node)
        step.pending = None

    def _pending_path(self, step_node: Node) -> bytes:
        return os.path.join(self.tree.records_path(step_node), pc.PENDING_NAME)

    def _remove_pending_record(self, step_node: Node) -> None:
        path = self._records.reach(self._pending_path(step_node))
        with times_kept(os.path.dirname(path)), contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    @staticmethod
    def leave_pending(step: StepState, reason: str | None) -> None:
        """The commit waits (`reason`, shown by status; None keeps the reason known)."""
        step.commit_pending = True
        if reason is not None:
            step.waiting_for = reason

    @staticmethod
    def note_waiting(step: StepState, reason: str | None) -> None:
        step.waiting_for = reason

    @staticmethod
    def note_dcp_files(step: StepState, key: tuple[int, int, int], names: set[str]) -> None:
        """The files a DCP `.metadata` (inode, size, mtime) names: pending commits ask again."""
        step.dcp_files = (key, names)
