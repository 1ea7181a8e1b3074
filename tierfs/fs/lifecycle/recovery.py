"""Start-up: putting the RAM store back in order after a restart or a crash, then building the
tree's nodes from it (through the tree's own `attach`, before the mount serves anything).

Committed steps are put back exactly as their manifests say (uncommitted writes into a committed
step are dropped); a step committed before its files' hashes were in (a pending record,
`fs.model.pending_commits`) is finished first: its snapshots hashed, its manifest written. Files of
persisted steps that left RAM come back as non-resident; leftovers of interrupted saves,
fetches and commits are removed. Recovery works on paths in the store (through `StepRecords`,
which reaches paths longer than PATH_MAX) until `_load_tree` makes the nodes.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model import append_layout, tree_walk
from tierfs.fs.model import pending_commits as pc
from tierfs.fs.model.nodes import (
    MANIFEST,
    METADATA,
    OWN_LATEST_MARK,
    PEERS_MARK,
    REPLICAS_MARK,
    Node,
    Seal,
    StepState,
)
from tierfs.fs.store.committed_files import give_attributes, make_from_object
from tierfs.fs.store.ram_store import RamStore, is_reserved
from tierfs.fs.tree.step_identity import marked_number

if TYPE_CHECKING:
    from tierfs.fs.model.ports import DeleteLog
    from tierfs.fs.tree.records import StepRecords
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.tree import Tree

log = logging.getLogger(__name__)

# What start-up recovered: a step's records directory in the store (`Tree.records_path`) ->
# (its manifest, names whose objects are here).
Recovered = dict[bytes, tuple[mf.StepManifest, set[str]]]


@dataclass(frozen=True)
class RecoveryReport:
    """What start-up found: whether copies this node was counted for may be gone."""

    steps: int  # committed steps put back
    set_aside: int  # committed steps found damaged (a file neither here nor persisted)
    damaged_files: int  # files of persisted steps whose object had the wrong size
    objects_removed: int  # unreferenced objects removed

    @property
    def may_have_lost_copies(self) -> bool:
        """No committed step in RAM (a new or emptied RAM dir), or some set aside or removed:
        the cluster's records may count copies this node no longer has. Otherwise every copy
        it was counted for is here as its step's manifest says (a file of a step not persisted
        left the records before it left RAM; one of a persisted step counted too many is no
        loss)."""
        return not self.steps or bool(self.set_aside or self.damaged_files
                                      or self.objects_removed)


class Recovery:
    """Rebuilds one mount's tree from its RAM store (`load`, once, before the mount serves)."""

    def __init__(self, tree: Tree, deletes: DeleteLog, *, identity: StepIdentity,
                 residents: Residents, records: StepRecords) -> None:
        self.tree = tree
        self._identity = identity  # which directories are steps
        self._residents = residents  # the files of steps held elsewhere
        self._deletes = deletes
        self.store: RamStore = tree.store
        self.records = records  # the steps' records in the RAM store (manifests, marks)
        self._top = os.fsencode(self.store.tree)
        self._set_aside = 0
        self._damaged_files = 0

    def _renamed_in_store(self, manifest: mf.StepManifest) -> bool:
        """Whether the files of this version are in the store under the old names of a rename
        not finished there (fs.lifecycle.deletes)."""
        data_dir = layout.data_dir(manifest.path, manifest.single_file)
        return bool(manifest.files) and all(
            self._deletes.old_keys(layout.object_key(data_dir, entry.name))
            for entry in manifest.files)

    def load(self) -> RecoveryReport:
        """Rebuild the namespace from the RAM store after a restart or a crash (see the module
        docstring), and say what was lost. A step found `writing` may be a save a crash cut
        short: it does not commit by itself (fs.lifecycle.quiet_commits), only once written again
        or by `tierfs commit`."""
        started = time.monotonic()
        tmp_removed = self.store.remove_tmp_files()
        with self.records.long_paths():  # the tree stands still until the mount serves it
            recovered = self._recover_committed_steps()
            self._load_tree(recovered)
        garbage = self.store.collect_garbage()
        self.store.scan_usage()
        log.info("loaded RAM store %s: %d committed steps, %d bytes; removed %d temporary "
                 "files and %d unreferenced objects in %.2f s", self.store.root, len(recovered),
                 self.store.used_bytes, tmp_removed, garbage, time.monotonic() - started)
        return RecoveryReport(len(recovered), self._set_aside, self._damaged_files, garbage)

    def _recover_committed_steps(self) -> Recovered:
        recovered: Recovered = {}
        reach = self.records.reach
        in_steps: set[bytes] = set()  # step directories and every directory inside one
        for dirpath, _dirs, files in self.records.walk(self._top):
            single = layout.file_of_records_name(os.path.basename(dirpath))
            if single is not None:
                # A single-file step's records, beside its file: a step unless inside one.
                is_step = os.path.dirname(dirpath) not in in_steps
                if not is_step:
                    shutil.rmtree(reach(dirpath))
                    continue
            elif os.path.dirname(dirpath) in in_steps:
                in_steps.add(dirpath)
                is_step = False  # a directory inside a step is part of it
            else:
                number = self._identity.step_number(os.path.basename(dirpath))
                if number is None and dirpath != self._top:  # named by a tracker
                    number = marked_number(reach(dirpath))
                is_step = dirpath != self._top and number is not None
                if is_step:
                    in_steps.add(dirpath)
            if pc.PENDING_NAME in files:
                if is_step and single is None and self._finish_pending(dirpath):
                    files = [*files, MANIFEST]
                else:
                    os.unlink(reach(os.path.join(dirpath, pc.PENDING_NAME)))
            if MANIFEST not in files:
                continue
            if not is_step:
                # Not a step (any more): its files are plain files, its manifest is stale.
                os.unlink(reach(os.path.join(dirpath, MANIFEST)))
                continue
            manifest = self.records.read_manifest(dirpath)
            if manifest is None:
                continue
            held_elsewhere = (
                self.records.persist_mark(dirpath) == (manifest.version, "persisted")
                or self.records.read_node_list(dirpath, PEERS_MARK, manifest.version)
                is not None or self._renamed_in_store(manifest))
            data = os.path.dirname(dirpath) if single is not None else dirpath
            try:
                resident = self._restore_step(data, manifest, held_elsewhere, dirpath)
            except OSError as exc:
                log.error("cannot restore step %s v%d (%s); its manifest is set aside",
                          manifest.path, manifest.version, exc)
                self.records.set_aside(dirpath)
                self._set_aside += 1
                continue
            if resident is not None:
                recovered[dirpath] = (manifest, resident)
        return recovered

    def _finish_pending(self, dirpath: bytes) -> bool:
        """A step directory's pending commit (fs.model.pending_commits), finished as the daemon that
        made it would have: its snapshots hashed and made committed objects, its manifest
        written, its record removed. False when there is nothing to finish (a newer manifest
        is in place; the caller removes the record) or it cannot be (a snapshot lost)."""
        reach = self.records.reach
        record_path = os.path.join(dirpath, pc.PENDING_NAME)
        try:
            with open(reach(record_path), "rb") as f:
                record = pc.decode(f.read())
        except (OSError, pc.PendingError) as exc:
            log.error("step %s: its pending commit cannot be read (%s); it stays writing",
                      os.fsdecode(dirpath), exc)
            return False
        manifest = self.records.read_manifest(dirpath)
        if manifest is not None and manifest.version >= record.version:
            return False  # finished before the restart, the record not yet removed
        relpath = os.fsdecode(os.path.relpath(dirpath, self._top))
        entries = []
        for f in record.files:
            snapshot = self.store.snapshot_path(f.snapshot)
            try:
                size = os.lstat(snapshot).st_size
            except FileNotFoundError:
                size = -1
            if size != f.size:
                log.error("step %s v%d: the snapshot of %s is missing or has the wrong size; "
                          "its pending commit is dropped", relpath, record.version, f.name)
                return False
            entries.append(f.entry(mf.hash_file(snapshot)))
        number = self._identity.step_number(os.path.basename(dirpath))
        if number is None:
            number = marked_number(reach(dirpath))
        finished = mf.StepManifest(
            path=relpath, step=mf.NO_STEP if number is None else number,
            version=record.version, node_id=self.tree.node_id,
            committed_ns=record.committed_ns, files=tuple(entries))
        snapshots = [self.store.snapshot_path(f.snapshot) for f in record.files]
        # Linked, not renamed: a crash before the manifest is in place finds the record whole.
        for snapshot, entry in zip(snapshots, entries, strict=True):
            if not os.path.lexists(self.store.object_path(entry.xxh3)):
                os.link(snapshot, self.store.object_path(entry.xxh3))
        self.records.write_manifest(dirpath, finished)
        os.unlink(reach(record_path))
        for snapshot in snapshots:
            os.unlink(snapshot)
        log.warning("step %s v%d was committed before a restart with its hashes to come: "
                    "its %d files hashed now", relpath, record.version, len(entries))
        return True

    def _restore_step(self, dir_path: bytes, manifest: mf.StepManifest,
                      persisted: bool, records: bytes) -> set[str] | None:
        """Put the tree of a committed step back as its manifest says; return the names whose
        objects are in RAM, or None if the step is damaged (a file neither here nor persisted).
        `dir_path`: the directory its files are relative to; `records`: where its records are
        (the same for a step directory; beside the file for a single-file step)."""
        reach = self.records.reach
        resident = set()
        for entry in manifest.files:
            try:
                size = os.lstat(self.store.object_path(entry.xxh3)).st_size
            except FileNotFoundError:
                size = -1
            if size == entry.size:
                resident.add(entry.name)
                continue
            if size >= 0:
                self._damaged_files += 1
            if not persisted:
                log.error("committed step %s v%d is damaged: object of %s is missing or has "
                          "the wrong size; its manifest is set aside", manifest.path,
                          manifest.version, entry.name)
                self.records.set_aside(records)
                self._set_aside += 1
                return None
        restored = removed = 0
        wanted = {os.fsencode(name) for name in resident}
        # A single file has nothing beside it that belongs to it: what is there is not its.
        for dirpath, _dirs, files in () if manifest.single_file else self.records.walk(dir_path):
            for name in files:
                full = os.path.join(dirpath, name)
                if (not is_reserved(name) and stat.S_ISREG(os.lstat(reach(full)).st_mode)
                        and os.path.relpath(full, dir_path) not in wanted):
                    os.unlink(reach(full))  # written after the commit: not in the step
                    removed += 1
        for entry in manifest.files:
            if entry.name not in resident:
                continue
            path = os.path.join(dir_path, os.fsencode(entry.name))
            obj = os.fsencode(self.store.object_path(entry.xxh3))
            try:
                linked = os.path.samefile(reach(path), obj)
            except FileNotFoundError:
                linked = False
            # its bytes from the object, its mode, owner and mtime from the manifest
            tmp = reach(self.store.tmp_path(os.path.dirname(path)))
            if linked:
                restored += give_attributes(obj, reach(path), tmp, entry)
                continue
            if manifest.step == mf.NO_STEP and append_layout.appended_to(reach(path), entry):
                continue  # a loose file appended since: it keeps its bytes, and commits again
            self._clear_way(dir_path, os.fsencode(entry.name))
            make_from_object(obj, reach(path), tmp, entry)
            restored += 1
        if restored or removed:
            log.warning("step %s v%d put back as committed: %d files restored, %d uncommitted "
                        "files removed", manifest.path, manifest.version, restored, removed)
        return resident

    def _clear_way(self, dir_path: bytes, relative: bytes) -> None:
        """Make room for a committed file at `relative`: what was put in its place or in the
        place of one of its directories after the commit goes."""
        reach = self.records.reach
        current = dir_path
        *parents, name = relative.split(b"/")
        for part in parents:
            current = os.path.join(current, part)
            reached = reach(current)
            if os.path.lexists(reached) and not os.path.isdir(reached):
                os.unlink(reached)
            os.makedirs(reached, 0o755, exist_ok=True)
        target = reach(os.path.join(current, name))
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)  # start-up: nothing is served yet

    # -- the nodes, built from the RAM store once it is in order --------------------------------

    def _load_tree(self, recovered: Recovered) -> None:
        """Build the nodes from the RAM store (`fs.lifecycle.recovery` put it in order first), and
        count the references of the committed objects found in RAM."""
        self._load_dir(self.tree.root, self._top, recovered)
        for manifest, resident in recovered.values():
            for entry in manifest.files:
                if entry.name in resident:
                    self.store.count_ref(entry.xxh3)

    def _load_dir(self, dir_node: Node, path: bytes, recovered: Recovered,
                  in_step: bool = False) -> None:
        reach = self.records.reach
        with os.scandir(reach(path)) as entries:
            for entry in entries:
                if entry.name == OWN_LATEST_MARK:
                    dir_node.own_latest = True
                if is_reserved(entry.name):
                    continue
                st = entry.stat(follow_symlinks=False)
                kind = stat.S_IFMT(st.st_mode)
                if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK, stat.S_IFIFO,
                                stat.S_IFSOCK):
                    continue
                node = self.tree.attach(dir_node, entry.name, kind)
                if kind == stat.S_IFDIR:
                    child_path = os.path.join(path, entry.name)
                    number = None if in_step else self._identity.step_number(entry.name)
                    if number is None and not in_step:  # a directory a tracker named
                        number = marked_number(reach(child_path))
                    self._load_dir(node, child_path, recovered, in_step or number is not None)
                    if number is not None:
                        self._load_step(node, number, child_path, recovered)
                elif kind == stat.S_IFREG and not in_step:
                    state = self._identity.single_file_step(dir_node, entry.name)
                    if state is not None:
                        self._load_step(node, state.number, os.path.join(
                            path, layout.records_name(entry.name)), recovered)

    def _load_step(self, node: Node, number: int | None, path: bytes,
                   recovered: Recovered) -> None:
        """`path`: the step's records directory (`records_path`)."""
        manifest, resident = recovered.get(path, (None, set()))
        step = node.step = StepState(number, manifest)
        step.resident = resident
        step.empty = (manifest is None and node.is_dir
                      and next(tree_walk.walk_files(node), None) is None)
        # A DCP step whose .metadata came before its shards (a copy under way) commits when
        # the last of them is closed, as before the restart.
        step.commit_pending = manifest is None and node.is_dir and METADATA in node.children
        if manifest is None:
            return
        mark = self.records.persist_mark(path)
        if mark is not None and mark[0] == manifest.version:
            if mark[1] == "persisted":
                step.persisted_version = mark[0]
            elif mark[1] == "retired":
                step.retired_version = mark[0]
        version = manifest.version
        step.replicas = self.records.read_node_list(path, REPLICAS_MARK, version) or set()
        step.holders = self.records.read_node_list(path, PEERS_MARK, version) or set()
        for rel, file_node in tree_walk.files_under(node):
            entry = manifest.entry(rel)
            if entry is not None:
                st = os.lstat(self.tree.backing(file_node))
                if number is None and rel in resident and st.st_size != entry.size:
                    # a loose file appended since its commit, kept so above: it commits again
                    self.tree.mark_dirty(file_node)
                    continue
                file_node.seal = Seal(mf.Digest.of(entry), st.st_ino)
        self._residents.add_remote_files(
            node, [e for e in manifest.files if e.name not in resident], in_store=step.persisted)
