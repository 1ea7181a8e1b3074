"""The tree's changes that the other tiers drive: a step version committed elsewhere installed
here, joined (multi-node DCP), superseded by a newer one or forgotten, and which tiers hold a
version (persisted, retired, its replicas and holders, per-file holders), each recorded on disk
before it counts; and the symbolic links the persistent tier keeps, made in a fresh RAM dir.
Part of the tree's core (see `fs.tree.tree`): it changes nodes and step state only through `Tree`'s
primitives and by the same rules; each change is one synchronous method."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import stat
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import (
    LATEST,
    METADATA,
    PEERS_MARK,
    REPLICAS_MARK,
    Node,
    Seal,
    StepState,
    some_names,
)
from tierfs.fs.store.committed_files import give_attributes
from tierfs.fs.store.fetch import RemoteFile
from tierfs.fs.tree.dir_attributes import times_kept

if TYPE_CHECKING:
    from collections.abc import Callable

    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.dir_attributes import DirAttributes
    from tierfs.fs.tree.records import StepRecords
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.sealing import Sealing
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.tree import Tree
    from tierfs.fs.tree.tree_primitives import StepRemoval
    from tierfs.fs.tree.virtual_latest import VirtualLatest

log = logging.getLogger(__name__)


class StepVersions:
    """The step-version changes of one mount's tree (see the module docstring)."""

    def __init__(self, tree: Tree, *, dir_attributes: DirAttributes, identity: StepIdentity,
                 latest: VirtualLatest, records: StepRecords, residents: Residents,
                 removals: StepRemoval, sealing: Sealing, store: RamStore) -> None:
        self.tree = tree
        self._removals = removals
        self._dir_attributes = dir_attributes
        self._identity = identity
        self._latest = latest
        self._records = records
        self._residents = residents
        self._sealing = sealing
        self._store = store

    # -- which tiers hold a version ----------------------------------------------------------

    def set_persisted(self, step_node: Node, version: int, *, recorded: bool = False) -> None:
        """This version of the step is in the persistent tier (recorded on disk first, unless
        `write_persist_mark` did already). Its files not in RAM are read from there from now
        on, under its own name (a renamed step's were read from the old name until now)."""
        if not recorded:
            self.write_persist_mark(step_node, version)
        step = step_node.step
        step.persisted_version = version
        step.store_lacking = frozenset()
        step.persist_mark_owed = False
        if step.manifest is None or step.manifest.version != version:
            return
        data_dir = self.tree.data_dir(step)
        for rel, node in tree_walk.files_under(step_node):
            entry = step.manifest.entry(rel)
            if node.remote is not None and entry is not None:
                node.remote = RemoteFile(data_dir, entry, True)

    def set_store_lost(self, step_node: Node, lacking: list[str]) -> None:
        """The persistent tier was seen to lack files of the committed version it was believed
        to hold (a bucket emptied or made again, a prefix pruned by hand): the version no
        longer counts as persisted. In memory only: the mark on disk stays, and the next mount
        asks the store again (a mark rewritten here would make a restart set the step aside
        as damaged, though the right store may still come back)."""
        step = step_node.step
        step.persisted_version = 0
        step.store_lacking = frozenset(lacking)
        for _rel, node in tree_walk.files_under(step_node):
            remote = node.remote
            if remote is not None and remote.in_store and remote.entry.name in lacking:
                node.remote = RemoteFile(remote.step_path, remote.entry, False)  # not there

    def write_persist_mark(self, step_node: Node, version: int) -> None:
        records = self._records
        records.write_persist_mark(self.tree.records_path(step_node), version, "persisted")

    def set_persisted_unrecorded(self, step_node: Node, version: int) -> None:
        """The store holds this version, but its mark could not be written (the RAM dir's
        file system full): it counts as persisted, and nothing of it leaves RAM for the store
        until the mark is written (`StepState.persisted_on_record`)."""
        self.set_persisted(step_node, version, recorded=True)
        step_node.step.persist_mark_owed = True

    def set_retired(self, step_node: Node, version: int, *, write_mark: bool = True) -> None:
        """Retention removed this version from the persistent tier: never upload it again
        (recorded on disk first, unless not `write_mark`: the RAM dir had no room for it, and
        a restart may upload it again, which retention then removes again)."""
        if write_mark:
            self._records.write_persist_mark(self.tree.records_path(step_node), version,
                                             "retired")
        step_node.step.persist_mark_owed = False
        step_node.step.persisted_version = 0
        step_node.step.retired_version = version

    def add_replica(self, step_node: Node, peer: str) -> None:
        step_node.step.replicas.add(peer)
        self._write_node_list(step_node, REPLICAS_MARK, step_node.step.replicas)

    def set_holders(self, step_node: Node, holders: set[str], *, record: bool) -> None:
        """Peers that hold files of this version (etcd); `record`ed on disk for a restart."""
        step_node.step.holders = set(holders)
        if record:
            self._write_node_list(step_node, PEERS_MARK, step_node.step.holders)

    def forget_holders(self, step_node: Node) -> None:
        """The cluster's etcd has no commit record of this version, which this node made: the
        copies its marks name (replicas, holders) were counted by records that are gone (a
        new cluster, a prefix wiped), on nodes that may not be members at all. Forgotten, on
        disk too (in memory only if the RAM dir has no room: a restart forgets them again)."""
        step = step_node.step
        step.replicas, step.holders, step.file_holders = set(), set(), {}
        with contextlib.suppress(OSError):
            self._write_node_list(step_node, REPLICAS_MARK, set())
            self._write_node_list(step_node, PEERS_MARK, set())

    def add_holder(self, step_node: Node, peer: str) -> None:
        step_node.step.holders.add(peer)

    def _write_node_list(self, step_node: Node, mark: bytes, nodes: set[str]) -> None:
        self._records.write_node_list(self.tree.records_path(step_node), mark,
                                     step_node.step.manifest.version, nodes)

    def write_peers_mark(self, step_node: Node, version: int, holders: set[str]) -> None:
        self._records.write_node_list(self.tree.records_path(step_node), PEERS_MARK, version,
                                     holders)

    def set_file_holders(self, step_node: Node, holders: dict[str, set[str]],
                         writers: dict[str, str] | None = None) -> None:
        """Who holds (and who wrote) these files of the committed version, as the cluster's
        records say."""
        step = step_node.step
        for name, nodes in holders.items():
            if step.manifest.entry(name) is not None:
                step.file_holders[name] = set(nodes) - {self.tree.node_id}
        for name, writer in (writers or {}).items():
            if step.manifest.entry(name) is not None:
                step.file_writers[name] = writer

    def add_file_holder(self, step_node: Node, peer: str, names: list[str]) -> None:
        """`peer` holds verified copies of these files; once it holds every file of the step
        it counts as a replica of the step (recorded on disk for a restart)."""
        step = step_node.step
        for name in names:  # until the records are read again, at least `peer` (never more)
            step.file_holders.setdefault(name, set()).add(peer)
        if peer != self.tree.node_id and peer not in step.replicas and all(
                peer in step.file_holders.get(e.name, ()) for e in step.manifest.files):
            self.add_replica(step_node, peer)

    # -- versions arriving and leaving ---------------------------------------------------------

    def install_step(self, manifest: mf.StepManifest, source: str) -> Node | None:
        """The directories of a step committed elsewhere, and its manifest, written first."""
        if manifest.single_file:
            return self._install_single_file(manifest, source)
        parent = self.tree.root
        made: list[Node] = []
        parts = list(map(os.fsencode, manifest.path.split("/")))
        for depth, part in enumerate(parts, 1):
            child = parent.children.get(part)
            if child is None:
                os.mkdir(os.path.join(self.tree.backing(parent), part), 0o755)
                child = self.tree.attach(parent, part, stat.S_IFDIR)
                made.append(child)
                self._dir_attributes.made(child)  # given its recorded attributes
                number = self._identity.step_number_at(parent, part)
                if number is not None:
                    child.step = StepState(number)
                elif depth == len(parts) and not tree_walk.in_a_step(parent):
                    # a step with no step name: a directory its saver's tracker named
                    self._identity.become_named_step(child, manifest.step)
            elif not child.is_dir:
                log.warning("step %s from %s is hidden by a file here", manifest.path, source)
                return None
            parent = child
        step = parent.step
        if step is None or step.manifest is not None or parent.children:
            log.warning("step %s from %s does not fit this namespace (step pattern, or a "
                        "directory of that name in use)", manifest.path, source)
            return None
        self._take_manifest(parent, step, manifest, made)
        return parent

    def _install_single_file(self, manifest: mf.StepManifest, source: str) -> Node | None:
        """A single-file step committed elsewhere: its directories (none of them a step),
        its file's node (whose bytes the caller places) and its records, written first."""
        *dirs, name = manifest.path.split("/")
        parent = self.tree.root
        made: list[Node] = []
        for part in map(os.fsencode, dirs):
            child = parent.children.get(part)
            if child is None:
                if self._identity.step_number_at(parent, part) is not None:
                    break
                os.mkdir(os.path.join(self.tree.backing(parent), part), 0o755)
                child = self.tree.attach(parent, part, stat.S_IFDIR)
                made.append(child)
                self._dir_attributes.made(child)
            elif not child.is_dir or child.step is not None:
                break
            parent = child
        else:
            file_name = os.fsencode(name)
            state = (None if file_name in parent.children
                     else self._identity.single_file_step(parent, file_name))
            if state is not None:
                if file_name == LATEST:
                    self._latest.keep_own(parent)  # a saver's own `latest`, from another tier
                node = self.tree.attach(parent, file_name, stat.S_IFREG)
                node.step = state
                self._take_manifest(node, state, manifest, made,
                                    functools.partial(self._unmake_file, parent, node))
                return node
        log.warning("file %s from %s does not fit this namespace (a step directory or a "
                    "file of that name in use)", manifest.path, source)
        return None

    def _take_manifest(self, node: Node, state: StepState, manifest: mf.StepManifest,
                       made: list[Node], undo: Callable[[], None] | None = None) -> None:
        """An installed step's manifest written to its records, then its state: committed
        here, no byte resident yet. No room (the RAM dir's file system full): what the install
        made goes (`undo`, then the directories made for it), or an empty step directory,
        `writing`, would hide the committed step from then on (also after a restart: a step
        this node has is never adopted again)."""
        try:
            self._records.write_manifest(self.tree.records_path(node), manifest)
        except OSError:
            if undo is not None:
                undo()
            self._unmake(made)
            raise
        state.manifest = manifest
        state.dirty = False
        state.resident = set()

    def give_dir_attributes(self, manifest: mf.StepManifest) -> None:
        """The directories made here for other tiers' steps that `manifest` records get the
        attributes it (or a newer commit) records for them (`fs.tree.dir_attributes`)."""
        self._dir_attributes.give(self.tree.root, manifest, self.tree.backing)

    def give_written_dirs(self, entries: Iterable[mf.DirEntry]) -> None:
        """The directories made here for files other nodes write of a step being committed
        here get the attributes those nodes say theirs have (`FilesOnPeers.dirs`), which the
        commit then records: the owner and mode of a rank's own directory (Megatron-LM's
        `mp_rank_NN/`), not those of a directory this daemon made."""
        self._dir_attributes.give_entries(self.tree.root, entries, time.time_ns(),
                                          self.tree.backing)

    def _unmake_file(self, parent: Node, node: Node) -> None:
        """Remove the file node a single-file install made, and its records directory."""
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(self.tree.backing(parent), layout.records_name(node.name)))
        self.tree.detach(node)

    def _unmake(self, made: list[Node]) -> None:
        """Remove the directories an install made (empty), last made first."""
        for node in reversed(made):
            os.rmdir(self.tree.backing(node))
            self.tree.detach(node)

    def join_commit(self, step_node: Node, manifest: mf.StepManifest, others: set[str]) -> bool:
        """Another node committed this step (multi-node DCP) while ranks here wrote some of
        its files: if every file written here is sealed with the content the manifest names,
        this node's copy is committed as the same version; of a step without `.metadata`,
        files written here that it lacks or holds with other bytes go in the next version,
        committed from here; otherwise it stays `writing` (False). Files of an older
        committed version that were not written here since (held elsewhere, perhaps by nobody
        now, or a copy held here: a step saved again, also under an old name) are no part of
        the question: the new manifest says what they are now."""
        step = step_node.step
        files = list(tree_walk.files_under(step_node))
        unchanged = self._residents.unchanged_since_commit
        old = [(rel, node) for rel, node in files if unchanged(step, rel, node)]
        local = [(rel, node) for rel, node in files
                 if node.remote is None and (rel, node) not in old]
        # Files written here that the version lacks or holds with other bytes, of a step
        # without `.metadata` (a rank that began its save after another node committed it;
        # every node writing the whole checkpoint, HF's `save_on_each_node`): as on one file
        # system, the bytes written last are the file's, in the next version.
        late = [] if manifest.entry(os.fsdecode(METADATA)) is not None else \
            [(rel, node) for rel, node in local if _written_over(manifest.entry(rel), node)]
        local = [found for found in local if found not in late]
        # Files no writer holds that have no seal (this daemon restarted since they were
        # written: seals live in memory) are hashed now: the commit's next word (a copy to
        # this node, the record's next change) finds them sealed, and joins if they match.
        self._sealing.start_all([node for _rel, node in local])
        for rel, node in local:
            entry = manifest.entry(rel)
            why = ("is not in it" if entry is None else "is being written" if
                   node.active_writers else "is not sealed yet" if node.seal is None else
                   "has other content" if node.seal.digest.xxh3 != entry.xxh3 else None)
            if why is not None:
                # (a file still being written or hashed joins at the commit's next word)
                level = logging.INFO if node.active_writers or node.seal is None else \
                    logging.WARNING
                log.log(level, "%s here differs from the version %s committed (its %s here "
                        "%s): kept as writing", self.tree.relpath(step_node),
                        ", ".join(sorted(others)), rel, why)
                return False
        stale = [(rel, node) for rel, node in old
                 if (entry := manifest.entry(rel)) is None or entry.xxh3 != node.seal.digest.xxh3]
        if any(node.handles or (node.fetch is not None and node.fetch.busy)
               for _rel, node in stale):
            log.info("%s v%d committed on %s: it joins once its older files here are closed",
                     manifest.path, manifest.version, ", ".join(sorted(others)))
            return False
        local += [found for found in old if found not in stale]  # saved again as they were
        for rel, node in stale:  # the new version's file is elsewhere, or not in it
            self._residents.evict_file(step, step.manifest.entry(rel), node)
        for rel, node in files:
            if node.remote is not None:  # of the older version: its bytes are not the new ones
                self._residents.drop_fetch(node)
                if manifest.entry(rel) is None:
                    self.tree.detach(node)
        self._records.write_manifest(self.tree.records_path(step_node), manifest)
        self._residents.drop_resident_refs(step)
        for rel, node in local:
            self._store.add_ref(manifest.entry(rel).xxh3, self.tree.backing(node))
        step.manifest = manifest
        step.resident = {rel for rel, _node in local}
        step.dirty = False
        step.commit_pending = False
        step.holders = others
        step.replicas = set()  # who held copies of an older version holds none of this one
        step.file_holders = {}
        step.file_writers = {}
        self._write_node_list(step_node, PEERS_MARK, others)
        written_here = step.resident | {rel for rel, _node in late}
        self._residents.add_remote_files(step_node, [e for e in manifest.files
                                          if e.name not in written_here])
        log.info("%s v%d committed on %s; this node holds %d of its files", manifest.path,
                 manifest.version, ", ".join(sorted(others)), len(local))
        if late:
            self.tree.mark_dirty(step_node)  # written over that version: committed next
            log.warning("%s: %s written here, as %s committed it: in its next version, with "
                        "the bytes written here", manifest.path,
                        some_names({rel for rel, _node in late}), ", ".join(sorted(others)))
        return True

    def supersede(self, step_node: Node, manifest: mf.StepManifest, source: str, *,
                  release: bool) -> list[str]:
        """A newer version of a step committed elsewhere replaces the older committed version
        held here, or another node's commit of the same version the cluster recorded replaces
        this node's (the caller checked that nothing here writes, commits or reads it, and
        recorded where the new files are). The new manifest replaces the old one on disk, then
        the old files leave the tree, but those in RAM here with the bytes the new version
        names at the same name: they are its copy (a step renamed and renamed back is committed
        again with the same files, and the cluster's records count this node as holding them).
        The old version's object digests are released here (`release`) or returned for the
        caller to release once the new version holds its own references (objects both
        versions share must stay)."""
        step = step_node.step
        old = step.manifest
        self._records.write_manifest(self.tree.records_path(step_node), manifest)
        kept = set()
        for rel, node in list(tree_walk.files_under(step_node)):
            entry, before = manifest.entry(rel), old.entry(rel)
            if (node.remote is None and rel in step.resident and entry is not None
                    and before is not None and (entry.size, entry.xxh3) == (before.size,
                                                                            before.xxh3)):
                path = self.tree.backing(node)
                if give_attributes(self._store.object_path(entry.xxh3), path,
                                   self._store.tmp_path(os.path.dirname(path)), entry):
                    self._store.account_path(path)  # (a copy of its own, if it shared)
                node.seal = Seal(mf.Digest.of(entry), os.lstat(path).st_ino)
                kept.add(rel)
                continue
            if node.remote is None:
                path = self.tree.backing(node)
                # the version's swap is tierfs's, not a change of the job's: a saver rotating
                # its checkpoints by mtime (HF's Trainer) must not see this step as the newest
                with times_kept(os.path.dirname(path)):
                    self.tree.unlink_backing(path, node)
            self._residents.drop_fetch(node)
            if node is step_node:  # a single-file step: the node stays, its bytes are elsewhere
                node.remote = RemoteFile(layout.data_dir(manifest.path, True), manifest.files[0])
                node.seal = None
                self.tree.attrs_changed(node)
            else:
                self.tree.detach(node)
        old_refs = [old.entry(name).xxh3 for name in step.resident - kept]
        step.manifest = manifest
        step.resident = kept
        step.replicas = set()
        step.holders = set()
        step.file_holders = {}
        step.file_writers = {}
        step.persisted_version = 0
        step.retired_version = 0
        unchanged = f"; {len(kept)} of its files here are unchanged in it" if kept else ""
        if manifest.version == old.version:  # the cluster recorded another commit of it
            log.info("%s v%d was committed here and by %s at the same moment; the cluster "
                     "recorded %s's commit, taken here%s", manifest.path, manifest.version,
                     manifest.node_id, manifest.node_id, unchanged)
        else:
            log.warning("%s v%d here is superseded by v%d from %s%s", manifest.path,
                        old.version, manifest.version, source, unchanged)
        if release:
            self.release_refs(old_refs)
            return []
        return old_refs

    def release_refs(self, digests: list[str]) -> None:
        for digest in digests:
            self._store.drop_ref(digest)

    def forget_step(self, step_node: Node) -> bytes:
        """The step leaves the tree and the RAM store at once; its directory is renamed aside
        (to a temporary name at the top of the tree: a short path, and start-up removes it if
        a crash comes first) and returned, for the caller to remove off the trio thread. A
        single-file step sets its records directory aside so, and its file goes."""
        if step_node.is_file:
            records = self.tree.records_path(step_node)
            if step_node.remote is None:
                self.tree.unlink_backing(self.tree.backing(step_node), step_node)
            self._residents.drop_fetch(step_node)
            self._residents.drop_resident_refs(step_node.step)
            aside = self._store.tmp_path(self.tree.tree_path)
            os.rename(records, aside)
            self.tree.detach(step_node)
            return aside
        for _rel, node in list(tree_walk.files_under(step_node)):
            if node.remote is None:
                self.tree.unlink_backing(self.tree.backing(node), node)
            self._residents.drop_fetch(node)
            self.tree.detach(node)
        self._residents.drop_resident_refs(step_node.step)
        path = self.tree.backing(step_node)
        aside = self._store.tmp_path(self.tree.tree_path)
        os.rename(path, aside)
        self._detach_tree(step_node)
        return aside

    def _detach_tree(self, node: Node) -> None:
        for child in list((node.children or {}).values()):
            self._detach_tree(child)
        self.tree.detach(node)

    def drop_remote_files(self, step_node: Node) -> None:
        """A step being re-saved here whose committed version was deleted elsewhere: the
        files at hand stay, as a step that is not committed."""
        for _rel, child in list(tree_walk.files_under(step_node)):
            if child.remote is not None:
                self._residents.drop_fetch(child)
                self.tree.detach(child)
        self._removals.remove_hidden(step_node, self.tree.backing(step_node))

    # -- symbolic links the persistent tier keeps (fs.model.links) --------------------------------


def _written_over(entry: mf.FileEntry | None, node: Node) -> bool:
    """Whether a file written here, sealed, is not what the version another node committed
    holds at its name (none, or other bytes)."""
    return entry is None or (not node.active_writers and node.seal is not None
                             and node.seal.digest.xxh3 != entry.xxh3)
