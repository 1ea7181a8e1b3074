"""This node's view of copies elsewhere: steps in the persistent tier, replicas on peers (per
file, as the cluster's records in etcd say), steps committed in the cluster, and deletes, which
must reach all of them (`fs.lifecycle.deletes`). What this node's own saves and commits tell
the cluster is `fs.lifecycle.cluster_writes`'s.

`OtherTiers` is what the uploader, the replicator, the receiver, the commit follower and the
peer handlers call (the daemon hands them its bound methods; the commit records etcd could not
take are handed on to `ClusterWrites`); it decides, and the `Tree` changes the nodes.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from tierfs import layout, trackers
from tierfs import manifest as mf
from tierfs.fs.lifecycle.deletes import PERSIST, Deletes, Tombstone, peer_target
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import METADATA, FsError, Node, StepState
from tierfs.fs.model.ports import (
    KeepRam,
    LatePublication,
    SealedCollector,
    Spawner,
)
from tierfs.shared_uploads import PERSISTED, RETIRED

if TYPE_CHECKING:
    from tierfs.fs.lifecycle.step_versions import StepVersions
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.holders import Holdings
    from tierfs.fs.tree.recoverable import Recoverability
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.tree import Tree
    from tierfs.fs.tree.tree_view import TreeView

log = logging.getLogger(__name__)


class OtherTiers:
    """Copies of steps in the persistent tier and on peers, as this node knows them."""

    def __init__(self, tree: Tree, view: TreeView, versions: StepVersions, eviction: KeepRam,
                 deletes: Deletes, background: Spawner, writes: LatePublication,
                 sealed: SealedCollector | None = None, *, holdings: Holdings,
                 identity: StepIdentity, recoverable: Recoverability,
                 residents: Residents, store: RamStore) -> None:
        self.tree = tree
        self._holdings = holdings
        self._identity = identity
        self._recoverable = recoverable
        self._residents = residents
        self._store = store
        self.view = view  # the queries a rename's upload asks
        self.versions = versions  # the changes of step versions it makes
        self.eviction = eviction
        self.deletes = deletes
        self.background = background
        self.sealed = sealed  # the cluster's records of who holds which file (etcd)
        self._writes = writes  # this node's records in the cluster: commits etcd lacks
        self.node_id = tree.node_id
        self._tracker_texts: dict[str, str | int | None] = {}  # tracker object -> what it names
        self._owed_marks: dict[str, mf.StepManifest] = {}  # persisted, the RAM dir full
        # Steps whose file records are read again to judge them (`doubtful_steps`): a node
        # dropped out of their holders (it came back without its copies), or this node came
        # back without its own. Set (and replaced) when one is added.
        self._recheck: set[str] = set()
        self.recheck_wanted = trio.Event()

    # -- deletes -----------------------------------------------------------------------------

    def delete_from_peer(self, path: str, version: int, committed_ns: int,
                         sender: str) -> None:
        """A peer deleted this step: drop this node's copy of it (if not newer), remember the
        delete, and remove it from the persistent tier too (an upload from here may be late)."""
        self.deletes.record(path, version, committed_ns,
                            [PERSIST] if PERSIST in self.deletes.targets else [])
        node = self.tree.find_step(path)
        step = node.step if node is not None else None
        if step is None or step.manifest is None or step.manifest.committed_ns > committed_ns:
            return
        written = self._residents.written_in_save
        if step.committed or not tree_walk.busy(node) and not any(
                written(step, rel, file_node) for rel, file_node in tree_walk.files_under(node)):
            # (nothing written here since the commit: a delete of the step here under way, as
            # HF's rotation does on every node with `save_on_each_node`, is no new save)
            self._forget_step(node, f"deleted on {sender}")
            return
        # Being re-saved here: the files written here stay, as a step that is not committed.
        self.versions.drop_remote_files(node)
        log.info("%s was deleted on %s; the version being written here stays", path, sender)

    def _deleted(self, manifest: mf.StepManifest, offered_by: list[str]) -> bool:
        """Whether `manifest` is a deleted version; the tiers that offer it get cleaned."""
        if not self.deletes.covers(manifest):
            return False
        self.deletes.remind(manifest, offered_by)
        return True

    def _forget_step(self, step_node: Node, why: str = "") -> None:
        aside = self.versions.forget_step(step_node)
        self.background.spawn(trio.to_thread.run_sync, shutil.rmtree, aside)
        log.info("%s %s", os.fsdecode(step_node.name), why or "left the last tier that held it")

    # -- the persistent tier -----------------------------------------------------------------

    def is_current(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is still the committed version of its step (worth uploading)."""
        node = self.tree.find_step(manifest.path)
        return node is not None and node.step.manifest is manifest

    def committed_manifests(self) -> list[mf.StepManifest]:
        """Committed steps whose version has not reached the persistent tier and that this
        node uploads: those made here with every file in RAM (or renamed, with files the
        store holds under their old names); in a cluster, whose uploads are shared
        (`tierfs.shared_uploads`), every step made here and every one with a file in RAM
        here, whoever made it."""
        found = []
        for node in self.tree.steps():
            step = node.step
            if not step.committed or step.persisted or \
                    step.retired_version == step.manifest.version:
                continue
            made_here = step.manifest.node_id == self.node_id
            if (made_here and (step.in_ram or self.view.in_ram_or_store(node))) or (
                    self.sealed is not None and (made_here or step.resident)):
                found.append(step.manifest)
        return sorted(found, key=lambda m: (m.step, m.path))

    def not_in_store(self) -> list[mf.StepManifest]:
        """Every committed step listed here whose version the persistent tier does not hold
        (nor retired from it): in a cluster, what `tierfs flush` on any node waits for,
        whichever nodes upload it."""
        return sorted((n.step.manifest for n in self.tree.steps()
                       if n.step.committed and not n.step.persisted
                       and n.step.retired_version != n.step.manifest.version),
                      key=lambda m: (m.step, m.path))

    def mark_persisted(self, manifest: mf.StepManifest) -> None:
        """The uploader put this version in the store. Its mark is written first; if the RAM
        dir's file system has no room for it, the version counts as persisted all the same
        (the store holds it: it is not uploaded again), stays in RAM until the mark is
        written (`write_owed_marks`), and the log says so once."""
        node = self.tree.find_step(manifest.path)
        if node is None or node.step.manifest is not manifest:
            return
        try:
            self.versions.set_persisted(node, manifest.version)
        except OSError as exc:
            self.versions.set_persisted_unrecorded(node, manifest.version)
            self._owed_marks[manifest.path] = manifest
            log.warning("the persisted mark of %s v%d cannot be written (%s): it is written "
                        "once the RAM dir has room; the step stays in RAM until then",
                        manifest.path, manifest.version, exc.strerror or exc)
            return
        self.eviction.enforce_keep_ram(node)

    def write_owed_marks(self) -> None:
        """Write the persisted marks the RAM dir had no room for (`mark_persisted`); a step
        whose mark is written may leave RAM now. Called every half second."""
        for path, manifest in list(self._owed_marks.items()):
            node = self.tree.find_step(path)
            if node is None or node.step.manifest is not manifest or \
                    not node.step.persist_mark_owed:
                del self._owed_marks[path]  # saved again, removed, or retired meanwhile
                continue
            try:
                self.versions.set_persisted(node, manifest.version)
            except OSError:
                return  # still no room: the next call tries again
            del self._owed_marks[path]
            log.info("the persisted mark of %s v%d is written", path, manifest.version)
            self.eviction.enforce_keep_ram(node)

    def move_done(self, tomb: Tombstone,
                  wanted: Callable[[mf.StepManifest], bool] | None) -> bool:
        """Whether a renamed step's old name may leave the tiers: every step at its new name
        is committed there and, with a store, in the store if due there; a rename of the new
        name that its own new name still reads through this one comes first."""
        assert tomb.moved_to is not None
        new = tomb.moved_to
        if any(other.moved_to is not None and other is not tomb and PERSIST in other.pending
               and (other.path == new or other.path.startswith(new + "/"))
               for other in self.deletes.pending()):
            return False
        if self.view.reads_from_store(tomb.path):
            return False  # a file not in RAM here still has its bytes under the old name
        node = tree_walk.node_at(self.tree.root, new)
        # the steps the new name holds: the one it is or lies in, else those below it
        holding = next(tree_walk.enclosing_steps(node), None)
        if holding is not None:
            at_new: Iterable[Node] = [holding]
        else:
            at_new = self.tree.steps(under=node) if node is not None and node.is_dir else ()
        for step_node in at_new:
            step = step_node.step
            if not step.committed or step.manifest.path != self.tree.relpath(step_node):
                return False
            if wanted is not None and not step.persisted and wanted(step.manifest) and \
                    step.retired_version != step.manifest.version:
                return False
        return True

    def copy_sources(self, key: str) -> list[tuple[str, str]]:
        """Objects in the store that may hold the bytes of the object `key` of a step being
        uploaded, as (a step path whose manifest says so, the object): the old names of a
        file not in RAM here, then those of renames not finished in the store."""
        found = []
        node = tree_walk.node_at(self.tree.root, key)
        remote = node.remote if node is not None else None
        if remote is not None and remote.in_store:
            old = layout.object_key(remote.step_path, remote.entry.name)
            if old != key:  # a step directory's file, or a single-file step
                found += [(remote.step_path, old), (old, old)]
        return found + self.deletes.sources(key)

    def single_writer(self, manifest: mf.StepManifest) -> bool:
        """Whether the step's files were all written on one node, as far as this node knows
        (a multi-node step's records name several writers)."""
        node = self.tree.find_step(manifest.path)
        return node is None or len(set(node.step.file_writers.values())) <= 1

    def in_store(self, relpath: str) -> bool:
        """Whether the persistent tier holds the step's committed version."""
        node = self.tree.find_step(relpath)
        return node is not None and node.step.persisted

    def store_state(self, relpath: str, version: int, state: str) -> None:
        """The cluster's records say what the persistent tier holds of the step's `version`
        (whichever node wrote it there): PERSISTED, or RETIRED by --keep-persist."""
        node = self.tree.find_step(relpath)
        if node is None or not node.step.committed or node.step.manifest.version != version:
            return
        if state == PERSISTED and not node.step.persisted:
            try:
                self.versions.set_persisted(node, version)
            except OSError as exc:  # no room for its mark (a full /dev/shm): shown as not
                log.warning("%s v%d is in the persistent tier, but this node could not "
                            "record it: %s", relpath, version, exc.strerror or exc)
                return
            log.info("%s v%d is in the persistent tier (the cluster's records say so)",
                     relpath, version)
            self.eviction.enforce_keep_ram(node)
        elif state == RETIRED and node.step.retired_version != version:
            self.mark_retired(relpath)

    def mark_retired(self, relpath: str) -> None:
        """Retention removed the step from the persistent tier: never upload it again."""
        node = self.tree.find_step(relpath)
        if node is None or node.step.manifest is None:
            return
        if not node.step.in_ram and not node.step.dirty:
            self._forget_step(node)  # both policies let it go: it is gone from tierfs
            return
        try:
            self.versions.set_retired(node, node.step.manifest.version)
        except OSError as exc:  # no room: it counts as retired, and a restart may upload it
            self.versions.set_retired(node, node.step.manifest.version, write_mark=False)
            log.warning("the retired mark of %s cannot be written (%s): after a restart it "
                        "may be uploaded again, and removed again", relpath,
                        exc.strerror or exc)

    def adopt_persisted(self, manifest: mf.StepManifest) -> bool:
        """Show a step found in the persistent tier (a fresh node, or one that left RAM).

        A step this node already has, in any state, is left as it is, and a deleted one is not
        shown. Returns whether the step was added."""
        if self._deleted(manifest, [PERSIST]):
            return False
        node = self.tree.find_step(manifest.path)
        if node is not None:
            step = node.step
            if (step.manifest is not None and step.manifest.version == manifest.version
                    and step.manifest.same_content(manifest) and not step.persisted):
                self.versions.set_persisted(node, manifest.version)
            elif step.committed and self._supersede(
                    node, manifest, "the persistent tier",
                    lambda: self.versions.write_persist_mark(node, manifest.version),
                    release=True) is not None:
                self.versions.set_persisted(node, manifest.version, recorded=True)
                self._residents.add_remote_files(
                    node, [e for e in manifest.files if e.name not in step.resident])
                self.versions.give_dir_attributes(manifest)
            return False
        step_node = self.versions.install_step(manifest, "the persistent tier")
        if step_node is None:
            return False
        self.versions.set_persisted(step_node, manifest.version)
        self._residents.add_remote_files(step_node, list(manifest.files))
        self.versions.give_dir_attributes(manifest)
        return True

    # -- trackers (tierfs.trackers): never in a tier without the step they name ------------

    def tracked_step(self, manifest: mf.StepManifest, content: bytes | None = None
                     ) -> trackers.TrackedStep | None:
        """If this version is a tracker, the step it names (the uploader holds its upload until
        that step is in the store); None if it is no tracker. `content`: the tracker's bytes
        (an older version's, or the store's), else those of this version in RAM."""
        found = self._tracked(manifest, content)
        if found is None:
            return None
        number, step = found
        if step is None:
            return trackers.TrackedStep(number, made_here=False, persisted=False)
        # Being written here (the tracker may commit first) or committed here: this node's
        # uploader puts it in the store.
        made_here = not step.committed or step.manifest.node_id == self.node_id
        return trackers.TrackedStep(number, made_here=made_here, persisted=step.persisted)

    def may_copy(self, manifest: mf.StepManifest, peer: str, wanted: int,
                 is_up: Callable[[str], bool]) -> bool:
        """Whether `peer` may get a copy of this version now: not a tracker whose step is
        neither in the store, nor held whole by `peer` (every file verified there), nor at
        `wanted` verified copies of every file on live nodes (`is_up`; this node's RAM counts):
        the step of a multi-node save is safe with its copies spread over nodes none of which
        holds it all."""
        found = self._tracked(manifest)
        if found is None:
            return True
        step = found[1]
        if step is None or not step.committed:
            return False
        verified = self._holdings.verified_peers
        files = step.manifest.files
        return step.persisted or all(peer in verified(step, e.name) for e in files) or all(
            int(e.name in step.resident) + sum(1 for p in verified(step, e.name) if is_up(p))
            >= wanted for e in files)

    def named_step(self, manifest: mf.StepManifest) -> mf.StepManifest | None:
        """The committed version of the step a tracker names, as this node lists it; None if
        `manifest` is no tracker or that step is not committed here."""
        found = self._tracked(manifest)
        step = found[1] if found is not None else None
        return step.manifest if step is not None and step.committed else None

    def _tracked(self, manifest: mf.StepManifest, content: bytes | None = None
                 ) -> tuple[int, StepState | None] | None:
        """A tracker's step number and the step of that number in its directory, committed or
        being written (None if there is none here); None if `manifest` is no tracker (another
        file, a content that names no step, bytes not in RAM here). `content`: the bytes to
        read instead of this version's."""
        if not (manifest.single_file and manifest.step == mf.NO_STEP
                and trackers.is_tracker_name(manifest.path)):
            return None
        named = (self._tracker_text(manifest.files[0]) if content is None
                 else trackers.named_step(content))
        try:
            run_dir = self.tree.find_dir(manifest.path.rpartition("/")[0])
        except FsError:
            return None
        if isinstance(named, str):
            node = run_dir.children.get(os.fsencode(named))
            number = (node.step.number if node is not None and node.is_dir
                      and node.step is not None else self._identity.step_number(named))
        elif isinstance(named, int):
            number = named
            node = next((n for n in run_dir.children.values()
                         if n.is_dir and n.step is not None and n.step.number == named), None)
        else:
            return None
        if number is None:
            return None  # a name, but not a step's
        return number, node.step if node is not None and node.is_dir else None

    def _tracker_text(self, entry: mf.FileEntry) -> str | int | None:
        """What a tracker object names (`trackers.named_step`), read once per content (a few
        bytes in RAM); None if it is not here."""
        if entry.xxh3 not in self._tracker_texts:
            if entry.size > trackers.MAX_BYTES:
                return None
            try:
                with open(self._store.object_path(entry.xxh3), "rb") as f:
                    content = f.read(trackers.MAX_BYTES + 1)
            except FileNotFoundError:
                return None
            if len(self._tracker_texts) > 256:
                self._tracker_texts.clear()
            self._tracker_texts[entry.xxh3] = trackers.named_step(content)
        return self._tracker_texts[entry.xxh3]

    # -- peers -------------------------------------------------------------------------------

    async def hold_files(self, path: str, version: int, names: list[str],
                         sender: str) -> list[str] | None:
        """A peer sent verified copies of these files of the step's committed `version` (their
        objects are here): this node holds them now, in its copy of that version (listed from
        etcd first if this node does not know that version yet). The names now held, or None
        if this node cannot hold that version (another version is here, the name is in use,
        or the cluster does not know the step at that version)."""
        node = self._committed_at(path, version)
        if node is None and self.sealed is not None:
            found = await self.sealed.manifest_of(path)
            if found is not None and found[0].version == version:
                self.learn(*found)
            node = self._committed_at(path, version)
        if node is None:
            return None
        if self._deleted(node.step.manifest, [peer_target(sender)]):
            return None
        manifest = node.step.manifest
        if not node.step.in_ram:
            self._residents.fill_from_objects(node, names)
        held = [n for n in names if manifest.entry(n) is not None and n in node.step.resident]
        if held:
            self.versions.add_file_holder(node, sender, held)
            log.info("holding %d files of %s v%d from %s", len(held), path, version, sender)
        return held

    def _committed_at(self, path: str, version: int) -> Node | None:
        node = self.tree.find_step(path)
        if node is None or not node.step.committed or node.step.manifest.version != version:
            return None
        return node

    def _supersede(self, step_node: Node, manifest: mf.StepManifest, source: str,
                   record: Callable[[], None] | None = None, *,
                   release: bool = False, recorded: bool = False) -> list[str] | None:
        """A newer version of a step committed elsewhere replaces the older committed version
        this node holds (it was away while the step was re-saved): never let the old bytes
        shadow the new commit. `recorded`: `manifest` is the commit the cluster's records
        name, which also replaces another commit of the same version held here (two nodes
        committed the same save at the same moment, etcd took the other's record), so that
        every node names one commit and a delete covers it everywhere. Refused (None) unless
        `manifest` replaces the version here and nothing here writes, commits or reads the
        step; the caller retries (the next commit event, replication).

        On disk, `record` first notes where the new version's files are (peers, the
        persistent tier), so that a restart finds them; then `Tree.supersede`."""
        step = step_node.step
        old = step.manifest
        if old is None or step.dirty or step.commit_pending or tree_walk.busy(step_node):
            return None
        if manifest.version < old.version or manifest.version == old.version and not (
                recorded and manifest.committed_ns != old.committed_ns):
            return None
        if record is not None:
            record()
        return self.versions.supersede(step_node, manifest, source, release=release)

    def held_manifests(self) -> list[mf.StepManifest]:
        """Committed steps with files in this node's RAM, whoever wrote them (the steps whose
        copies this node may have to send)."""
        return sorted((n.step.manifest for n in self.tree.steps()
                       if n.step.committed and n.step.resident),
                      key=lambda m: (m.step, m.path))

    def listed_manifests(self) -> list[mf.StepManifest]:
        """Every committed step listed here, wherever its files are."""
        return [n.step.manifest for n in self.tree.steps() if n.step.committed]

    def owned_manifests(self) -> list[mf.StepManifest]:
        """Committed steps this node made and holds (not replicas it holds for others)."""
        return sorted((n.step.manifest for n in self.tree.steps()
                       if n.step.committed and n.step.in_ram
                       and n.step.manifest.node_id == self.node_id),
                      key=lambda m: (m.step, m.path))

    def short_of_copies(self, manifest: mf.StepManifest, replicas: int,
                        is_up: Callable[[str], bool]) -> bool:
        """Whether a file of this version here has fewer than `replicas` verified copies on
        live peers while the store does not hold it (status, flush and metrics: replication
        still due)."""
        node = self.tree.find_step(manifest.path)
        if node is None or node.step.manifest is not manifest or node.step.persisted:
            return False
        return any(sum(1 for peer in self._holdings.verified_peers(node.step, name)
                       if is_up(peer)) < replicas
                   for name in node.step.resident)

    def note_placements(self, manifest: mf.StepManifest, holders: dict[str, set[str]],
                        writers: dict[str, str]) -> None:
        """Who holds and who wrote each file of this version, from the cluster's records
        (eviction judges each file by its writer: `Eviction.file_leaves`)."""
        node = self.tree.find_step(manifest.path)
        if node is not None and node.step.manifest is manifest:
            self.versions.set_file_holders(node, holders, writers)
            self._recoverable.loss(node.step, fresh=True)  # whole again, or not

    def want_recheck(self, paths: list[str] | None = None) -> None:
        """Have the file records of these steps (None: every committed step not wholly in RAM
        here) read again before they are judged (`doubtful_steps`)."""
        if paths is None:
            paths = [self.tree.relpath(n) for n in self.tree.steps()
                     if n.step.committed and not n.step.in_ram]
        if paths:
            self._recheck.update(paths)
            self.recheck_wanted.set()
            self.recheck_wanted = trio.Event()

    def doubtful_steps(self, may_be_up: Callable[[str], bool]) -> list[mf.StepManifest]:
        """Committed steps, not persisted, with a file not in RAM here whose holders as known
        here are none that `may_be_up`, or are known only for the whole step (a node that
        holds no file of a step knows who holds *some* file of it) with one of them not up,
        and those `want_recheck` named: their records are read again (`note_placements`)
        before the step is called incomplete, or whole again."""
        found = []
        recheck, self._recheck = self._recheck, set()
        for node in self.tree.steps():
            step = node.step
            if not step.committed or step.persisted or step.in_ram:
                continue
            if self.tree.relpath(node) in recheck:
                found.append(step.manifest)
                continue
            for entry in step.manifest.files:
                if entry.name in step.resident:
                    continue
                peers = self._holdings.file_peers(step, entry.name)
                if (not any(map(may_be_up, peers)) or entry.name not in step.file_holders
                        and not all(map(may_be_up, peers))):
                    found.append(step.manifest)
                    break
        return found

    def mark_held(self, manifest: mf.StepManifest, peer: str, names: list[str]) -> None:
        """`peer` verified copies of these files of this version."""
        node = self.tree.find_step(manifest.path)
        if node is not None and node.step.manifest is manifest:
            self.versions.add_file_holder(node, peer, names)
            self.eviction.enforce_keep_ram(node)

    def unlisted(self, path: str) -> None:
        """The cluster's commit record of the step left etcd (a delete, or no node held it any
        more): a step listed here only from it (no file in RAM here, not in the store, not
        being written) is no longer listed."""
        node = self.tree.find_step(path)
        if node is None:
            return
        step = node.step
        if (step.committed and not step.resident and not step.persisted
                and not step.commit_pending and not tree_walk.busy(node)):
            self._forget_step(node, "is no longer in the cluster's records")

    def learn(self, manifest: mf.StepManifest, holders: list[str]) -> None:
        """A peer holds this committed step: list it here, readable from those holders."""
        others = set(holders) - {self.node_id}
        if self._deleted(manifest, [peer_target(h) for h in sorted(others)]):
            return
        node = self.tree.find_step(manifest.path)
        if node is not None:
            step = node.step
            if (step.manifest is not None and step.manifest.version == manifest.version
                    and not (step.committed
                             and step.manifest.committed_ns != manifest.committed_ns)):
                if others != step.holders - {self.node_id}:
                    # the commit record names the holders now: one that dropped out (it came
                    # back without its copies) may have held the only copy of a file, which
                    # no holder that remains can tell: the file records say
                    if step.holders - {self.node_id} - others and not step.in_ram:
                        self.want_recheck([manifest.path])
                    self.versions.set_holders(node, others, record=not step.in_ram)
            elif not step.committed:
                if manifest.version > step.base:  # another node's commit of this save
                    self.versions.join_commit(node, manifest, others)
                # else an older version's record, changed late (a copy made of it): this
                # node has committed a newer one since, and writes the step again
            elif self._supersede(node, manifest, ", ".join(sorted(others)),
                                 lambda: self.versions.write_peers_mark(node, manifest.version,
                                                                    others),
                                 release=True, recorded=True) is not None:
                self.versions.set_holders(node, others, record=False)
                self._residents.add_remote_files(
                    node, [e for e in manifest.files if e.name not in step.resident])
            self.versions.give_dir_attributes(manifest)
            return
        step_node = self.versions.install_step(manifest, f"node {', '.join(sorted(others))}")
        if step_node is None:
            return
        self.versions.set_holders(step_node, others, record=True)
        self._residents.add_remote_files(step_node, list(manifest.files))
        self.versions.give_dir_attributes(manifest)
        log.info("%s v%d is in the cluster (held by %s)", manifest.path, manifest.version,
                 ", ".join(sorted(others)))

    def publish_later(self, manifest: mf.StepManifest) -> None:
        """A step committed here whose commit record etcd lacks: written later
        (`ClusterWrites.publish_later`)."""
        self._writes.publish_later(manifest)

    async def publish_pending(self) -> None:
        """Commit records etcd could not take before: tried again
        (`ClusterWrites.publish_pending`)."""
        await self._writes.publish_pending()

    def may_catch_up(self, dir_node: Node, name: bytes) -> bool:
        """Whether `catch_up` would ask the cluster about `name` (else a LOOKUP of it that
        finds nothing fails at once, `Operations.lookup_absent`)."""
        step_node = next(tree_walk.enclosing_steps(dir_node), None)
        return not (self.sealed is None or step_node is None or step_node.step.committed
                    or name != METADATA or dir_node is not step_node)

    async def catch_up(self, dir_node: Node, name: bytes) -> bool:
        """`name` was not found in a step this node holds as being written: if it is the
        step's `.metadata` (where a DCP load starts) and the cluster committed the step
        meanwhile (another node got its `.metadata`), list it committed now rather than at
        the watch event. Whether the step changed. Other names are not asked about: a saver
        creating a file looks its name up first, and must not wait for etcd each time. Nor
        is etcd asked while it is known not to answer: the lookups of `.metadata` on the way
        to its rename, the saver's call that commits, would each wait a request's timeout
        on top of --commit-timeout."""
        if not self.may_catch_up(dir_node, name):
            return False
        step_node = dir_node
        found = await self.sealed.manifest_of(self.tree.relpath(step_node), patient=False)
        if found is None:
            return False
        self.learn(*found)
        return step_node.step.committed
